"""native/backend_audit.py: SFI's composite graphs against Metal's and Vulkan's supports_op, as the vendored sources
define them (native/supports_op.py runs those functions on the nodes).

The interpreter is checked on the real files (the pinned llama.cpp tree's ggml-metal-device.m and ggml-vulkan.cpp):
it must understand the whole of Metal's function, and give the answers the source's own cases give for nodes
written out here. Then the audit runs (in a child process: LLAMA_SFI_FUSED=0 is read once per process) and must
find that every node of SFI's slow, fast and mixed graphs runs on Metal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))

import backend_audit  # noqa: E402
import supports_op as so  # noqa: E402
from supports_op import Node  # noqa: E402


@pytest.fixture(scope="module")
def sources():
    return backend_audit.read_sources(None)  # the pinned sdist's tree (our patches change neither supports_op)


@pytest.fixture(scope="module")
def checkers(sources):
    return backend_audit.backends(sources)


def f32(*ne):
    return Node("NONE", "F32", ne)


def f16(*ne):
    return Node("NONE", "F16", ne)


def i64(*ne):
    return Node("NONE", "I64", ne)


def run(code: str, fn: str = "f", headers=(), **bind):
    return so.Sources({"x.c": code}, headers=list(headers)).call(fn, **bind)


# -- the interpreter on small functions ------------------------------------------------------------

def test_three_valued_logic_and_fallthrough():
    code = """
    static bool helper(const struct ggml_tensor * t) { return t->ne[0] % 4 == 0; }
    bool f(const struct ggml_tensor * op, int dev) {
        const bool fast = dev > 2;   // dev is not bound: UNKNOWN
        switch (op->op) {
            case GGML_OP_ADD:
            case GGML_OP_MUL:
                return false && fast;                     // false whatever fast is
            case GGML_OP_SCALE:
                return fast || helper(op->src[0]);        // true when the helper says so, else UNKNOWN
            case GGML_OP_CPY:
                {
                    switch (op->type) {
                        case GGML_TYPE_F16: break;        // leaves the inner switch only
                        default: return false;
                    }
                    for (int i = 0, n = 2; i < n; ++i) {
                        if (op->src[i] == NULL) { return false; }
                    }
                    auto ok = [&](int x) { return x == 64; };
                    return ok(op->ne[0]) ? true : false;
                }
            default:
                return false;
        }
    }"""
    assert run(code, op=Node("MUL", "F32", src=[f32(8)])).supported is False
    assert run(code, op=Node("SCALE", "F32", src=[f32(8)])).supported is True
    v = run(code, op=Node("SCALE", "F32", src=[f32(7)]))
    assert v.supported is None and v.reasons == {"dev"}
    assert run(code, op=Node("CPY", "F16", (64,), src=[f16(64), f16(64)])).supported is True
    assert run(code, op=Node("CPY", "F16", (32,), src=[f16(32), f16(32)])).supported is False
    assert run(code, op=Node("CPY", "F16", (64,), src=[f16(64)])).supported is False  # src[1] NULL
    assert run(code, op=Node("CPY", "F32", (64,), src=[f32(64), f32(64)])).line == 15  # the inner default


def test_what_it_does_not_understand_is_unknown():
    code = """
    bool f(const struct ggml_tensor * op) {
        if (op->type == GGML_TYPE_F32) {
            for (auto * t : {op, op->src[0]}) { if (!t) return false; }
            return true;
        }
        return mystery(op);
    }"""
    assert run(code, op=Node("ADD", "F32", src=[f32(1)])).supported is None  # the range-for
    assert run(code, op=Node("ADD", "F16", src=[f16(1)])).supported is None  # a function defined nowhere


def test_contiguity_and_sizes_as_ggml_defines_them():
    row = Node("VIEW", "F16", (64, 100, 2), (2, 256, 128))  # head h of a [128 x 100] cache: rows apart, heads inside
    fns = so.GGML_FUNCTIONS
    assert fns["ggml_is_contiguous_rows"](row) and not fns["ggml_is_contiguous"](row)
    assert fns["ggml_is_contiguous"](Node("NONE", "Q8_0", (64, 3)))
    assert fns["ggml_nbytes"](Node("NONE", "Q8_0", (64, 3))) == 3 * 2 * 34
    assert fns["ggml_nbytes"](row) == 2 + 63 * 2 + 99 * 256 + 1 * 128


def test_enumerators_and_constants_from_the_headers(sources):
    enums, defines = so.header_constants(sources["ggml/include/ggml.h"])
    assert enums["GGML_TYPE_F32"] == 0 and enums["GGML_TYPE_F16"] == 1 and enums["GGML_TYPE_Q8_0"] == 8
    assert enums["GGML_OP_NONE"] == 0 and defines["GGML_MAX_SRC"] == 10
    assert enums["GGML_SCALE_FLAG_ANTIALIAS"] == 1 << 9


# -- the real supports_op functions ----------------------------------------------------------------

def test_the_whole_of_metals_function_is_understood(checkers):
    assert so.opaque_statements(checkers["Metal"].fn) == []
    # Vulkan's: only the range-based for of an op no graph of ours has (LIGHTNING_INDEXER)
    assert [s.parts[0].split(": ")[-1] for s in so.opaque_statements(checkers["Vulkan"].fn)] == ["range-based for"]


CASES = [
    # (node, Metal, Vulkan): the answers of the sources' own cases
    # SET_ROWS: Metal takes an F16 source into F16 only, Vulkan into any type it quantizes to
    (Node("SET_ROWS", "Q8_0", (64, 100), src=[f16(64, 4), i64(4)]), False, True),
    (Node("SET_ROWS", "Q8_0", (64, 100), src=[f32(64, 4), i64(4)]), True, True),
    # SET: Vulkan F32 and I32 only
    (Node("SET", "F32", (64, 4), src=[f32(64, 4), f32(64, 1)]), True, True),
    (Node("SET", "F16", (64, 4), src=[f16(64, 4), f16(64, 1)]), True, False),
    # an F16 cache's keys times F32 queries; ggml_log is LOG, never a unary op
    (Node("MUL_MAT", "F32", (100, 1), src=[f16(64, 100), f32(64, 1)]), True, True),
    (Node("UNARY", "F32", (8, 4), src=[f32(8, 4)], sub_op="EXP"), True, True),
    (Node("UNARY", "F32", (8, 4), src=[f32(8, 4)], sub_op="LOG"), False, False),
    (Node("LOG", "F32", (8, 4), src=[f32(8, 4)]), True, True),
    # Metal's flash attention takes listed head sizes only
    (Node("FLASH_ATTN_EXT", "F32", (64, 8, 1), src=[f32(64, 1, 8), f16(64, 256, 2), f16(64, 256, 2), f16(256, 1)]),
     True, None),
    (Node("FLASH_ATTN_EXT", "F32", (16, 8, 1), src=[f32(16, 1, 8), f16(16, 256, 2), f16(16, 256, 2), f16(256, 1)]),
     False, None),
    # our fused ops: neither backend has them (the default case)
    (Node("SFI_TOP_K", "I32", (8, 4), src=[f32(100, 4)]), False, False),
    (Node("POOL_2D", "F32", (8, 4), src=[f32(8, 4)]), True, True),
    (Node("CONCAT", "F32", (100, 4), src=[f32(100, 2), f32(100, 2)]), True, True),
    (Node("SOFT_MAX", "F32", (100, 4), src=[f32(100, 4), f16(100, 4)]), True, True),
    # Vulkan multiplies a quantized matrix in place only when its first two dimensions are contiguous: not one
    # head of a Q8_0 cache's rows (heads side by side in a row)
    (Node("MUL_MAT", "F32", (100, 16, 2), src=[Node("VIEW", "Q8_0", (64, 100, 2), (34, 68 * 2, 68)),
                                              f32(64, 16, 2)]), True, False),
    (Node("MUL_MAT", "F32", (100, 16, 2), src=[Node("VIEW", "F16", (64, 100, 2), (2, 256, 128)),
                                              f32(64, 16, 2)]), True, True),
]


@pytest.mark.parametrize("node, metal, vulkan", CASES, ids=[c[0].signature() for c in CASES])
def test_verdicts_of_the_real_sources(checkers, node, metal, vulkan):
    assert checkers["Metal"](node).supported is metal
    v = checkers["Vulkan"](node)
    assert v.supported is vulkan, v
    if vulkan is None:  # what the device would have to say
        assert v.reasons and all(r.startswith("device->") for r in v.reasons), v


def test_vulkan_top_k_depends_on_the_device(checkers):
    v = checkers["Vulkan"](Node("TOP_K", "I32", (8, 4), src=[f32(100, 4)]))
    assert v.supported is None and "device->pipeline_topk_f32" in v.reasons


def test_metal_buffers_are_not_host_buffers(sources):
    assert backend_audit.metal_buffers_are_host(sources) == []


# -- the audit -------------------------------------------------------------------------------------

def test_every_node_of_sfis_graphs_runs_on_metal(tmp_path):
    out = tmp_path / "audit.json"
    env = dict(os.environ, LLAMA_SFI_FUSED="0")
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "backend_audit.py"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["mismatches"] == []
    steps = result["steps"]
    for name, counts in steps.items():  # the graphs were there: slow (the Selector in them), fast, mixed
        if name.startswith("device-selector") and "all-cells" not in name:
            assert counts["slow"] > 0 and counts["fast"] > 0 and counts["device_selections"] > 0, (name, counts)
        if name.startswith("batched"):
            assert counts["mixed"] > 0, (name, counts)
    rows = {r["signature"]: r for r in result["rows"]}
    sfi = {sig for sig, r in rows.items() if r["sfi"]}
    assert not any(sig.startswith("SFI_") for sig in rows)  # composite ops only
    # the device Selector's top-k and the gathers into the view were there, and Metal runs them
    assert {"TOP_K I32 <- F32", "ARGSORT I32 <- F32"} <= sfi
    gathers = [sig for sig, r in rows.items() if "sfi_gather" in r["names"]]
    assert gathers and all(rows[sig]["verdicts"]["Metal"] == ["yes"] for sig in gathers), gathers
    assert all(rows[sig]["verdicts"]["Metal"] == ["yes"] for sig in sfi if not rows[sig]["host_only"])
