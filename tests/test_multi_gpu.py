"""SFI with the layers split over several GPUs (llama.cpp's layer split, split_mode "layer").

Each layer's KV cache lives on the GPU of the layer, and the SFI compact view of the layer is allocated
next to it, so selection gathers and fast-step attention never cross GPUs. The GPU tests need a CUDA build
and 2+ GPUs (scripts/gpu_run.sh multigpu sets SFI_TEST_GPUS=2, which makes too few GPUs a failure instead
of a skip); the refusal of row split and the bench's --split-mode option are checked everywhere.
SFI_VOCAB_SOURCE: GGUF whose tokenizer the random model copies (default: the default model).
"""
from __future__ import annotations

import json
import os

import pytest

from sfi_gguf.core import devices
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.sfi_llama import SFILlama
from sfi_gguf.tools.random_model import random_model
from placement import SPLIT_LAYER, PlacedModel, all_cells_equal_dense, buffer_names, llama_log

GPUS = devices.gpu_count()
WANT_GPUS = int(os.environ.get("SFI_TEST_GPUS", "0"))
need_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs visible to llama.cpp (found {GPUS})")


def six_layers() -> str:
    """tiny-qwen3 with 6 layers: with the default split by free memory, layers 0-3 go to GPU 0 and 4-5
    (with the output layer) to GPU 1; the 2-3 layers of the other tiny models would all land on GPU 0."""
    return random_model("tiny-qwen3", n_layer=6)


def test_gpus_visible():
    if WANT_GPUS > GPUS:
        pytest.fail(f"SFI_TEST_GPUS={WANT_GPUS} but llama.cpp sees {GPUS} GPU(s): "
                    f"{[d['name'] for d in devices.devices()]}")


@need_2_gpus
@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no_fa"])
def test_layer_split_all_cells_equals_dense(flash_attn):
    with llama_log() as log:
        m = PlacedModel(six_layers(), split_mode=SPLIT_LAYER)
        try:
            d, identical = all_cells_equal_dense(m, n_steps=64, flash_attn=flash_attn)
        finally:
            m.close()
    kv, view = buffer_names(log, "KV"), buffer_names(log, "SFI view")
    assert len({b for b in kv if b != "CPU"}) >= 2, f"the KV cache is not split over GPUs: {kv}"
    assert view == kv, (view, kv)  # every view buffer sits with its layer's KV cache
    print(f"max |dlogit| {d:.2e}, bit-identical {identical}, KV on {sorted(kv)}")


@need_2_gpus
def test_layer_split_generation_equals_one_gpu():
    """SFILlama greedy generation, SFI on with a small memory (fast steps really run): 2 GPUs == 1 GPU."""
    from sfi_gguf.tools.texts import natural_text

    model = random_model("tiny-qwen3", n_layer=6, vocab="copy", vocab_source=os.environ.get("SFI_VOCAB_SOURCE", ""))
    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, min_context=0)  # SFI also below GPU_MIN_CONTEXT
    results = []
    for split in (dict(split_mode="layer"), dict(split_mode="none", main_gpu=0)):
        with SFILlama(model, n_ctx=2048, n_gpu_layers=99, sfi=config, **split) as llm:
            prompt = llm.tokenize(natural_text(6000))[:900]
            out = llm.generate(prompt, max_tokens=96, temperature=0, ignore_eos=True)
            assert out.stats.sfi.n_fast > 0 and out.stats.sfi.n_fell_back == 0, out.stats.sfi
            results.append(out.tokens)
    assert len(results[0]) == 96
    assert results[0] == results[1]


def test_row_split_refused_with_sfi():
    tiny = random_model("tiny-qwen3")
    with pytest.raises(ValueError, match="split_mode='row'"):
        SFILlama(tiny, split_mode="row")  # refused before the model is loaded
    with pytest.raises(ValueError, match="split_mode must be one of"):
        SFILlama(tiny, split_mode="rows", sfi=False)
    with pytest.raises(ValueError, match="tensor_split"):
        SFILlama(tiny, tensor_split=[1.0] * 17, sfi=False)


def test_bench_split_mode_option(tmp_path, monkeypatch):
    """`sfi-gguf bench --split-mode` reaches SFILlama and the JSON rows."""
    from sfi_gguf import cli, sfi_llama

    seen = []
    init = sfi_llama.SFILlama.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("split_mode"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(sfi_llama.SFILlama, "__init__", spy)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "-m", str(random_model("tiny-qwen3")), "--depths", "512", "-n", "8", "--k-head", "64",
                   "-t", "1", "--split-mode", "none", "--json", str(out)])
    assert rc == 0 and seen == ["none"]
    assert [r["split_mode"] for r in json.loads(out.read_text())] == ["none"]
