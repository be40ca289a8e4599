"""Dense decoding through SFILlama on the real default model (and Gemma 3 for sliding-window layers)."""
import subprocess
import sys

import pytest

from sfi_gguf import SFILlama, ensure_model
from sfi_gguf.core.devices import gpu_count

pytestmark = pytest.mark.real_model

PROMPT = "The three most important ideas in computer architecture are"
THREADS = 2


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=1024, n_threads=THREADS, sfi=False)


def test_greedy_generation_is_deterministic(llm):
    a = llm.generate(PROMPT, max_tokens=32, temperature=0)
    b = llm.generate(PROMPT, max_tokens=32, temperature=0)
    assert a.tokens == b.tokens and a.text == b.text
    assert len(a.tokens) == 32 and a.finish_reason == "length"
    assert a.stats.n_generated == 32
    assert len(a.text) > 20


def test_greedy_equals_llama_cpp_python(llm):
    from llama_cpp import Llama

    ref = Llama(str(ensure_model()), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, flash_attn=True,
                verbose=False, seed=0)
    expected = ref(PROMPT, max_tokens=48, temperature=0.0)["choices"][0]["text"]
    got = llm.generate(PROMPT, max_tokens=48, temperature=0)
    assert got.text == expected
    del ref


def test_seeded_sampling_is_reproducible(llm):
    a = llm.generate(PROMPT, max_tokens=24, temperature=0.9, seed=42)
    b = llm.generate(PROMPT, max_tokens=24, temperature=0.9, seed=42)
    assert a.tokens == b.tokens
    assert a.stats.seed == 42


def test_stream_yields_the_same_text(llm):
    full = llm.generate(PROMPT, max_tokens=24, temperature=0).text
    pieces = list(llm.generate(PROMPT, max_tokens=24, temperature=0, stream=True))
    assert len(pieces) > 1
    assert "".join(pieces) == full
    assert llm.last_stats.n_generated == 24


def test_stop_string_cuts_the_text(llm):
    full = llm.generate(PROMPT, max_tokens=32, temperature=0).text
    cut_at = full.strip().split()[2]
    got = llm.generate(PROMPT, max_tokens=32, temperature=0, stop=[cut_at])
    assert got.finish_reason == "stop"
    assert got.text == full[: full.index(cut_at)]
    streamed = "".join(llm.generate(PROMPT, max_tokens=32, temperature=0, stop=cut_at, stream=True))
    assert streamed == got.text


def test_chat_template_is_applied(llm):
    text = llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = llm.generate([{"role": "user", "content": "Name a prime number below 10."}], max_tokens=16, temperature=0)
    assert any(d in out.text for d in "2357")


def test_prefix_of_the_previous_call_is_reused(llm):
    prompt = " ".join([PROMPT] * 4)  # longer than the n_prefill_queries (16) tokens a prompt always decodes last
    llm.generate(prompt, max_tokens=4, temperature=0)
    first = llm.last_stats
    assert first.n_prompt_decoded >= 16
    llm.generate(prompt + " memory", max_tokens=4, temperature=0)
    second = llm.last_stats
    assert second.n_prompt_decoded == 16 < second.n_prompt  # the new token and the 15 before it
    assert second.n_prompt - second.n_prompt_decoded >= first.n_prompt - 16


def test_max_tokens_zero_only_processes_the_prompt(llm):
    out = llm.generate(PROMPT, max_tokens=0)
    assert out.text == "" and out.tokens == [] and out.stats.n_prompt > 0


def test_bad_generate_arguments_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPT, max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPT, top_p=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", max_tokens=4)
    with pytest.raises(ValueError, match="role"):
        llm.generate([{"content": "no role"}], max_tokens=4)
    long_prompt = "word " * 1100
    with pytest.raises(ValueError, match="n_ctx"):
        llm.generate(long_prompt, max_tokens=4)
    # the object still works after the errors
    assert llm.generate(PROMPT, max_tokens=4, temperature=0).stats.n_generated == 4


def test_bad_constructor_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        SFILlama(tmp_path / "nope.gguf")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        SFILlama(not_gguf)
    truncated = tmp_path / "truncated.gguf"
    with open(ensure_model(), "rb") as f:
        truncated.write_bytes(f.read(1 << 16))
    with pytest.raises(ValueError, match="could not load"):
        SFILlama(truncated)
    with pytest.raises(ValueError, match="training context"):
        SFILlama(None, n_ctx=10**6)
    with pytest.raises(ValueError, match="n_ctx"):
        SFILlama(None, n_ctx=-5)


def test_gemma3_sliding_window_model_generates():
    with SFILlama("gemma3-270m", n_ctx=1024, n_threads=THREADS, sfi=False) as gemma:
        out = gemma.generate("The capital of France is", max_tokens=8, temperature=0)
        assert "France" in out.text and out.stats.n_generated == 8
        with pytest.raises(ValueError, match="no chat template"):
            gemma.generate([{"role": "user", "content": "hi"}], max_tokens=2)


def test_cli_run_streams_text_and_reports_speed():
    result = subprocess.run([sys.executable, "-m", "sfi_gguf.cli", "run", "Write a haiku about caches",
                             "-n", "24", "--seed", "1", "-c", "512", "-t", str(THREADS), "-v", "-ngl", "99"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 10
    assert "tok/s" in result.stderr and "context" in result.stderr
    # -v: llama.cpp's information (the model's description), not its debug lines (several per decode)
    assert "print_info: arch" in result.stderr
    assert "llama_graph_n_input_tensors" not in result.stderr and len(result.stderr.splitlines()) < 400
    if gpu_count() == 0:  # -ngl without a GPU: said once, as the command's warning
        assert result.stderr.count("sfi-gguf: warning: n_gpu_layers=99: llama.cpp finds no GPU") == 1


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "sfi_gguf.cli", "run", "hi", "-m", str(tmp_path / "none.gguf")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "model file not found" in result.stderr and "Traceback" not in result.stderr
