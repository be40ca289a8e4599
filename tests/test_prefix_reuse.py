"""The same prompt again continues as from a fresh object (real default model, greedy, token for token): after a
finished generation, after a KeyboardInterrupt in the middle of one, and after reset(), dense and SFI.

A prompt's last n_prefill_queries tokens are a llama_decode of their own (`LlamaContext.prefill`), whether the rest
was decoded now or came from the cache. Before, a fresh prefill decoded these prompts in one batch and the cached
prompt re-decoded its last token (dense) or its last 16 (SFI) alone; llama.cpp's CPU kernels round a row by its
batch's shape, and the two parted at generated token 45 (dense) and 4 (SFI) on these prompts. The bit-exact
check of the logits, for every way a generation ends, is tests/test_reliability.py's
test_the_same_prompt_again_continues_from_a_fresh_objects_logits (random weights).
"""
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

THREADS = 1
N_CTX = 512
SFI = SFIConfig(k_head=32, n_recent=32, min_context=0)  # sparse from the first step on these ~280-token prompts
GREEDY = dict(max_tokens=50, temperature=0, ignore_eos=True)


def make(sfi):
    return SFILlama(None, n_ctx=N_CTX, n_threads=THREADS, sfi=sfi)


@pytest.mark.parametrize("sfi, seed", [(False, 1), (SFI, 2)], ids=["dense", "sfi"])
def test_the_same_prompt_again_gives_a_fresh_objects_tokens(sfi, seed):
    prompt = natural_text(1000, seed=seed) + "\n\nSummarise this text:"
    with make(sfi) as fresh:
        want = fresh.generate(prompt, **GREEDY)
    if sfi:
        assert want.stats.sfi.n_bootstrap == 1 and want.stats.sfi.n_fast > 0
    with make(sfi) as llm:
        llm.generate(prompt, **{**GREEDY, "max_tokens": 40})
        again = llm.generate(prompt, **GREEDY)
        assert again.tokens == want.tokens
        assert again.stats.n_prompt_decoded == SFI.n_prefill_queries  # the rest of the prompt came from the cache
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(llm.generate(prompt, stream=True, **GREEDY)):
                if i == 5:
                    raise KeyboardInterrupt  # (Ctrl-C in the loop that reads the stream)
        assert llm.generate(prompt, **GREEDY).tokens == want.tokens
        llm.reset()
        assert llm.generate(prompt, **GREEDY).tokens == want.tokens
