#!/usr/bin/env python3
"""Which ggml ops and types SFI's graphs build on a backend without our fused ops, and whether Metal and Vulkan run them.

The graphs are real ones: SFI generations of random-weight tiny models on the CPU with LLAMA_SFI_FUSED=0 (the
composite ops that Metal, Vulkan and RPC get, since they lack the fused ones), single sequence and batched, with
flash attention on and off, F16 and Q8_0 caches, the Selector in the graph (every cell, or candidates) and on the
host, refreshes of one group of layers, greedy picks in the graph. Every node that llama.cpp's scheduler computes
is recorded through cb_eval (op, types, shape, strides, sources), once per distinct node; a dense run gives the
model's own nodes, so that the rest are SFI's.

Each distinct node is then put to `ggml_metal_device_supports_op` (ggml-metal-device.m) and
`ggml_backend_vk_device_supports_op` (ggml-vulkan.cpp) as the vendored llama.cpp tree defines them, run by
native/supports_op.py on the node (Metal: an Apple7+ GPU, M1 or later; Vulkan: its device properties are not
assumed, so a verdict that depends on one says so). When the loaded library has a Metal or Vulkan device, its own
supports_op answers too, and must agree with the source wherever the source's answer is known.

    python3 native/backend_audit.py                   # the table; exit 1 if SFI needs an op Metal lacks
    python3 native/backend_audit.py --json out.json   # also every distinct node and its verdicts
    python3 native/backend_audit.py --tree DIR        # the sources of a prepared llama.cpp tree (default: the
                                                      # pinned sdist; SFI_LLAMA_CPP_SOURCE if set)

Exit status 1 when one of SFI's own nodes is not supported by Metal (or its verdict is unknown) unless it is in
METAL_GAPS (each listed in docs/backends.md, "Apple Silicon"), or when a device's own supports_op disagrees with its
source.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import json
import os
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import supports_op as so  # noqa: E402

# SFI nodes (op and types, as Node.signature writes them) that Metal does not run, each named in docs/backends.md,
# "Apple Silicon" with what it costs there; any other one fails the audit. None today.
METAL_GAPS: dict[str, str] = {}
# ggml_custom ops run on the CPU only, and SFI builds one only for a cache in host memory (the column gather of a
# transposed V, flash attention off: llama_sfi_build_gather_v_trans); Metal's buffer types are not host buffers
# (checked from ggml-metal.cpp below), so a cache there takes GET_ROWS + CPY instead
HOST_ONLY_OPS = {"CUSTOM"}
METAL_BUFFER_TYPES_IS_HOST = ("ggml_backend_metal_buffer_type_shared_is_host",
                              "ggml_backend_metal_buffer_type_private_is_host",
                              "ggml_backend_metal_buffer_type_mapped_is_host")

METAL_FILES = ("ggml/src/ggml-metal/ggml-metal-device.m", "ggml/src/ggml-metal/ggml-metal-common.cpp",
               "ggml/src/ggml-metal/ggml-metal.cpp")
METAL_HEADERS = ("ggml/include/ggml.h", "ggml/src/ggml-metal/ggml-metal-impl.h")
VULKAN_FILES = ("ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-vulkan/ggml-vulkan-types.h")
VULKAN_HEADERS = ("ggml/include/ggml.h",)
# Apple7 (A14, M1) and later: simdgroup reductions and matrices, bfloat (ggml-metal-device.m's props)
METAL_DEVICE = {"props": {"has_simdgroup_mm": True, "has_simdgroup_reduction": True, "has_bfloat": True,
                          "max_theadgroup_memory_size": 32768}}
# Vulkan: the size limits only (a layer's cache below them); any feature a verdict needs is reported, not assumed
VULKAN_DEVICE = {"max_buffer_size": 1 << 32, "properties": {"limits": {"maxStorageBufferRange": (1 << 32) - 1}},
                 "shader_64b_indexing": False}


# -- the sources -----------------------------------------------------------------------------------


def read_sources(tree: Path | None) -> dict[str, str]:
    """Path in the llama.cpp tree -> text, for the files the audit reads: from `tree`, or the pinned sdist."""
    paths = METAL_FILES + METAL_HEADERS + VULKAN_FILES + VULKAN_HEADERS
    if tree is not None:
        return {p: (tree / p).read_text(errors="replace") for p in paths}
    sys.path.insert(0, str(HERE))
    import prepare_llama_cpp as prep

    with tarfile.open(prep.fetch_sdist()) as tar:
        return {p: tar.extractfile(prep.VENDOR_PREFIX + p).read().decode(errors="replace") for p in paths}


def backend_sources(sources: dict[str, str]) -> dict[str, so.Sources]:
    pick = lambda paths: {Path(p).name: sources[p] for p in paths}  # noqa: E731
    return {
        "Metal": so.Sources(pick(METAL_FILES), headers=[sources[p] for p in METAL_HEADERS]),
        "Vulkan": so.Sources(pick(VULKAN_FILES), headers=[sources[p] for p in VULKAN_HEADERS],
                             overrides={"ggml_vk_get_device": lambda *_: so.Props(VULKAN_DEVICE, "device")}),
    }


def backends(sources: dict[str, str]) -> dict[str, so.SupportsOp]:
    """Each backend's supports_op, as its source defines it."""
    src = backend_sources(sources)
    return {
        "Metal": so.SupportsOp(src["Metal"], "ggml_metal_device_supports_op",
                               bind={"dev": so.Props(METAL_DEVICE, "dev")}),
        "Vulkan": so.SupportsOp(src["Vulkan"], "ggml_backend_vk_device_supports_op"),
    }


# -- the graphs ------------------------------------------------------------------------------------


class ggml_tensor(ctypes.Structure):
    """Head of struct ggml_tensor (ggml.h): what supports_op reads."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


@functools.cache
def _ggml_base():
    from sfi_gguf.core.library import LIB_PATH

    base = ctypes.CDLL(str(next(p for p in LIB_PATH.parent.iterdir() if p.name.startswith("libggml-base."))))
    for name, args, res in (("ggml_op_name", [ctypes.c_int], ctypes.c_char_p),
                            ("ggml_unary_op_name", [ctypes.c_int], ctypes.c_char_p),
                            ("ggml_glu_op_name", [ctypes.c_int], ctypes.c_char_p),
                            ("ggml_type_name", [ctypes.c_int], ctypes.c_char_p),
                            ("ggml_type_size", [ctypes.c_int], ctypes.c_size_t),
                            ("ggml_blck_size", [ctypes.c_int], ctypes.c_int64),
                            ("ggml_is_quantized", [ctypes.c_int], ctypes.c_bool),
                            ("ggml_backend_buffer_name", [ctypes.c_void_p], ctypes.c_char_p)):
        fn = getattr(base, name)
        fn.argtypes, fn.restype = args, res
    return base


@dataclass
class Seen:
    node: so.Node
    count: int = 0
    runs: set = field(default_factory=set)
    device: dict = field(default_factory=dict)  # backend name -> its own supports_op (a device of the library)
    buffers: set = field(default_factory=set)   # where its result was: the buffer of the backend that computed it


class Recorder:
    """cb_eval that records every node the scheduler computes, once per distinct node, and asks the library's
    devices (`devices`: backend name -> ggml_backend_dev_t) whether they support it."""

    def __init__(self, devices: dict[str, int] | None = None):
        self.seen: dict[tuple, Seen] = {}
        self.run = ""
        self.devices = devices or {}
        self._supports = None
        if self.devices:
            from sfi_gguf.core import devices as d

            self._supports = d._ggml().ggml_backend_dev_supports_op
            self._supports.argtypes, self._supports.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_bool
        from sfi_gguf.core.library import llama_cpp

        self.errors: list[str] = []

        def cb(t_ptr, ask, _user):
            if ask:
                try:
                    self._record(t_ptr)
                except Exception as exc:  # noqa: BLE001  (raised after the run: a callback cannot raise)
                    self.errors.append(repr(exc))
            return False  # no data wanted: the scheduler computes as without a callback

        self.fn = llama_cpp.ggml_backend_sched_eval_callback(cb)

    def _describe(self, ptr: int, depth: int = 0) -> tuple[tuple, so.Node]:
        base = _ggml_base()
        t = ctypes.cast(ptr, ctypes.POINTER(ggml_tensor)).contents
        tname = base.ggml_type_name(t.type).decode().upper()
        if tname not in so.TYPES:
            so.TYPES[tname] = so.TypeInfo(base.ggml_type_size(t.type), base.ggml_blck_size(t.type),
                                          base.ggml_is_quantized(t.type))
        op = base.ggml_op_name(t.op).decode()
        sub = ""
        if op == "UNARY":
            sub = base.ggml_unary_op_name(t.op_params[0]).decode()
        elif op == "GLU":
            sub = base.ggml_glu_op_name(t.op_params[0]).decode()
        srcs = [self._describe(s, depth + 1) if s and depth == 0 else (None, None) for s in t.src]
        key = (op, sub, tname, tuple(t.ne), tuple(t.nb), tuple(t.op_params), t.view_offs,
               tuple(k for k, _ in srcs))
        node = so.Node(op, tname, tuple(t.ne), tuple(t.nb), [n for _, n in srcs], tuple(t.op_params), sub,
                       t.name.decode(errors="replace"), t.view_offs)
        return key, node

    def _record(self, ptr: int) -> None:
        key, node = self._describe(ptr)
        s = self.seen.get(key)
        if s is None:
            s = self.seen[key] = Seen(node)
            for backend, dev in self.devices.items():
                s.device[backend] = bool(self._supports(dev, ptr))
        s.count += 1
        s.runs.add(self.run)
        t = ctypes.cast(ptr, ctypes.POINTER(ggml_tensor)).contents
        if t.buffer:
            s.buffers.add(_ggml_base().ggml_backend_buffer_name(t.buffer).decode())


@dataclass
class Run:
    name: str
    model: str
    config: dict
    flash_attn: bool = True
    type_kv: str = "f16"
    temperature: float = 0.0
    batched: bool = False
    dense: str = ""  # the dense run of the same model, cache and batch: the model's own nodes


def runs() -> list[Run]:
    base = dict(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=8, min_context=0)
    dev = dict(base, device_selector=True)  # the Selector in the slow step's graph: the default on a GPU
    sfi = [
        Run("device-selector", "tiny-qwen3", dev),                                   # 256 candidates of 700 cells
        Run("device-selector-all-cells", "tiny-qwen3", dict(dev, n_candidates=0)),
        Run("device-selector-no-fa", "tiny-qwen3", dev, flash_attn=False),
        Run("device-selector-q8_0", "tiny-qwen3", dev, type_kv="q8_0"),
        Run("device-selector-4-kv-heads", "tiny-llama", dev),                        # cross-head exclusivity
        Run("device-selector-layer-groups", "tiny-qwen3", dict(dev, refresh_layer_groups=2)),
        Run("device-selector-sampled", "tiny-qwen3", dev, temperature=0.8),
        Run("device-selector-gemma3", "tiny-gemma3", dev),                           # sliding-window layers
        Run("host-selector", "tiny-qwen3", dict(base, device_selector=False)),
        Run("host-selector-no-fa", "tiny-qwen3", dict(base, device_selector=False), flash_attn=False),
        Run("batched-mixed", "tiny-qwen3", dev, batched=True),
        Run("batched-mixed-no-fa", "tiny-qwen3", dev, flash_attn=False, batched=True),
        Run("batched-mixed-q8_0", "tiny-qwen3", dev, type_kv="q8_0", batched=True),  # (a quantized V needs FA)
        Run("batched-mixed-host-selector", "tiny-qwen3", dict(base, device_selector=False), batched=True),
    ]
    # the model's own nodes: a dense run (sfi=False) of every model, cache and batch the SFI runs use
    dense = {}
    for r in sfi:
        name = f"dense-{r.model}{'' if r.flash_attn else '-no-fa'}-{r.type_kv}{'-batched' if r.batched else ''}"
        dense.setdefault(name, Run(name, r.model, {}, r.flash_attn, r.type_kv, batched=r.batched))
        r.dense = name
    return list(dense.values()) + sfi


def with_their_dense_runs(names: set[str]) -> set[str]:
    """The runs named, and the dense runs that tell their SFI nodes from the model's."""
    return set(names) | {r.dense for r in runs() if r.name in names}


def capture(recorder: Recorder, n_gpu_layers: int = 0, only: set[str] | None = None) -> dict[str, dict]:
    """Every run of runs() with the recorder attached; returns each run's step counts."""
    import numpy as np

    from sfi_gguf import sfi_llama
    from sfi_gguf.core import context
    from sfi_gguf.core.config import SFIConfig
    from sfi_gguf.tools.random_model import random_model

    out = {}
    rng = np.random.default_rng(0)
    for run in runs():
        if only and run.name not in only:
            continue
        recorder.run = run.name
        make = functools.partial(context.LlamaContext, cb_eval=recorder.fn, type_kv=run.type_kv)
        sfi = SFIConfig(**run.config) if run.config else False
        with mock.patch.object(sfi_llama, "LlamaContext", make):
            llm = sfi_llama.SFILlama(random_model(run.model), n_ctx=1024, n_threads=1, flash_attn=run.flash_attn,
                                 n_gpu_layers=n_gpu_layers, sfi=sfi, n_parallel=3 if run.batched else 1)
        with llm:
            prompt = [int(t) for t in rng.integers(3, 300, 700)]
            if not run.batched:
                s = llm.generate(prompt, max_tokens=40, temperature=run.temperature, seed=1, ignore_eos=True).stats.sfi
                out[run.name] = dict(dense=40) if s is None else dict(bootstrap=s.n_bootstrap, slow=s.n_slow, fast=s.n_fast, dense=s.n_dense,
                                     device_selections=s.n_device_selections)
                continue
            # 4 prompts on 3 sequences, the first one short: the fourth starts while the others take fast steps,
            # and its refreshes fall between theirs (steps of slow and fast sequences together)
            decoder = llm.batched_decoder()
            requests = [llm.batch_request([int(t) for t in rng.integers(3, 300, 500 + 40 * i)], max_tokens=m,
                                          temperature=0.0, ignore_eos=True)
                        for i, m in enumerate((13, 40, 40, 30))]
            decoder.run(requests)
            out[run.name] = dict(mixed=decoder.n_mixed, **{k: v for k, v in decoder.n_decode.items()})
    return out


# -- the verdicts ----------------------------------------------------------------------------------


def audit(seen: dict[tuple, Seen], checkers: dict[str, so.SupportsOp]) -> dict:
    dense_sigs = {s.node.signature() for s in seen.values() if any(r.startswith("dense") for r in s.runs)}
    rows: dict[str, dict] = {}
    mismatches = []
    for s in seen.values():
        sig = s.node.signature()
        row = rows.setdefault(sig, dict(signature=sig, nodes=0, sfi=sig not in dense_sigs,
                                        host_only=s.node.op in HOST_ONLY_OPS, runs=set(),
                                        names=set(), verdicts={b: set() for b in checkers}, examples={},
                                        buffers=set(), device={}))
        row["nodes"] += s.count
        row["runs"] |= s.runs
        row["buffers"] |= s.buffers
        for backend, ok in s.device.items():
            row["device"].setdefault(backend, set()).add(ok)
        if s.node.name:
            row["names"].add(s.node.name.rsplit("-", 1)[0] if s.node.name.rsplit("-", 1)[-1].isdigit() else s.node.name)
        for backend, check in checkers.items():
            v = check(s.node)
            text = "yes" if v.supported else "no" if v.supported is False else "unknown"
            row["verdicts"][backend].add(text)
            if text != "yes":
                row["examples"].setdefault(backend, f"{v} ne={list(s.node.ne)} src ne="
                                                    f"{[list(x.ne) for x in s.node.src if x is not None]}")
            if backend in s.device and v.supported is not None and v.supported != s.device[backend]:
                mismatches.append(dict(backend=backend, signature=sig, source=str(v), device=s.device[backend],
                                       ne=list(s.node.ne), nb=list(s.node.nb)))
    return dict(rows=sorted(rows.values(), key=lambda r: (not r["sfi"], r["signature"])), mismatches=mismatches)


def verdict_text(verdicts: set) -> str:
    return "/".join(v for v in ("yes", "no", "unknown") if v in verdicts)


def print_report(result: dict, steps: dict, checkers: dict, where: bool = False) -> None:
    """where: a column of the buffers the nodes' results were in (the backends that computed them)."""
    print("SFI's graphs on the CPU with LLAMA_SFI_FUSED=0 (what a backend without the fused ops builds):")
    for name, counts in steps.items():
        print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    backends_ = list(checkers)
    print(f"\n{'op, type <- source types':54} {'nodes':>6}  " + "  ".join(f"{b:8}" for b in backends_) + "  SFI's")
    for r in result["rows"]:
        print(f"{r['signature'][:54]:54} {r['nodes']:6d}  "
              + "  ".join(f"{verdict_text(r['verdicts'][b]):8}" for b in backends_)
              + ("  " + ", ".join(sorted(r["names"])[:3]) if r["sfi"] and r["names"] else "  yes" if r["sfi"] else "")
              + (f"  [in {', '.join(sorted(r['buffers']))}]" if where else ""))
    for b in backends_:
        bad = [r for r in result["rows"] if r["verdicts"][b] != {"yes"}]
        print(f"\n{b}: {len(bad)} kinds of node not known to run there" + (":" if bad else ""))
        for r in bad:
            what = "SFI, host cache only" if r["host_only"] else "SFI" if r["sfi"] else "model"
            print(f"  {what} {r['signature']}: {r['examples'][b]}")
    for m in result["mismatches"]:
        print(f"\nMISMATCH {m['backend']}: {m['signature']} ne={m['ne']} nb={m['nb']}: source says {m['source']}, "
              f"the device says {m['device']}")


def metal_buffers_are_host(sources: dict[str, str]) -> list[str]:
    """Metal's buffer types whose is_host is not false in ggml-metal.cpp (HOST_ONLY_OPS rely on none being host)."""
    metal = backend_sources(sources)["Metal"]
    return [f for f in METAL_BUFFER_TYPES_IS_HOST if metal.call(f).supported is not False]


def failures(result: dict, host_buffers: list[str]) -> list[str]:
    out = [f"Metal: {r['signature']} ({r['examples']['Metal']})" for r in result["rows"]
           if r["sfi"] and r["verdicts"]["Metal"] != {"yes"} and r["signature"] not in METAL_GAPS
           and not r["host_only"]]
    out += [f"Metal: {f} is not false, and {', '.join(HOST_ONLY_OPS)} would run there" for f in host_buffers]
    out += [f"{m['backend']} disagrees with its source on {m['signature']}" for m in result["mismatches"]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=os.environ.get("SFI_LLAMA_CPP_SOURCE") or None,
                    help="a llama.cpp tree to read the backends' sources from (default: the pinned sdist)")
    ap.add_argument("--json", type=Path, help="write the verdicts of every kind of node here")
    ap.add_argument("--n-gpu-layers", type=int, default=0,
                    help="layers on the library's GPU device (a Vulkan build: its device's own verdicts, in place)")
    ap.add_argument("--runs", nargs="*", help="only these runs (the dense one is always needed)")
    args = ap.parse_args(argv)
    # the composite ops everywhere: the library's default of llama_sfi_params.fused_ops, read once, at the first
    # SFI context (so not set on import: a test process importing this module keeps its own setting)
    os.environ["LLAMA_SFI_FUSED"] = "0"

    sources = read_sources(args.tree)
    checkers = backends(sources)
    from sfi_gguf.core import devices

    own = {d["backend"]: d["ptr"] for d in devices.devices() if d["backend"] in checkers}
    recorder = Recorder(own)
    only = with_their_dense_runs(set(args.runs)) if args.runs else None
    steps = capture(recorder, args.n_gpu_layers, only)
    if recorder.errors:
        raise RuntimeError(f"recording the graphs failed: {recorder.errors[0]} ({len(recorder.errors)} errors)")
    result = audit(recorder.seen, checkers)
    print_report(result, steps, checkers, where=args.n_gpu_layers > 0)
    problems = failures(result, metal_buffers_are_host(sources))
    if args.json:
        def plain(x):
            return sorted(x) if isinstance(x, set) else x
        args.json.write_text(json.dumps(dict(steps=steps, devices=sorted(own), failures=problems, **{
            "rows": [{k: ({b: plain(v) for b, v in val.items()} if k in ("verdicts", "device") else plain(val))
                      for k, val in r.items()} for r in result["rows"]],
            "mismatches": result["mismatches"]}), indent=1))
    print("\n" + ("audit: FAILED\n  " + "\n  ".join(problems) if problems else
                  f"audit: every SFI node runs on Metal{' (devices asked too: ' + ', '.join(own) + ')' if own else ''}"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
