"""`SFILlama.stepper`: the public `Stepper` that the benchmark tools drive decode steps with, on a random-weight
model (fast tier)."""
import pytest

from sfi_gguf import GenerationStats, SFIConfig, SFILlama, Stepper
from sfi_gguf.core.context import ContextError
from sfi_gguf.core.generate import DenseStepper
from sfi_gguf.core.stepper import SFIStepper
from sfi_gguf.tools.random_model import random_model

CONFIGS = {"dense": SFIConfig(policy="dense"), "sfi": SFIConfig(k_head=64, n_recent=32, min_context=0)}


@pytest.fixture(scope="module")
def llm():
    with SFILlama(str(random_model("tiny-llama")), n_ctx=1024, n_threads=1) as model:
        yield model


@pytest.mark.parametrize("name", CONFIGS)
def test_a_stepper_decodes_as_generate_does(llm, name):
    config = CONFIGS[name]
    prompt = llm.tokenize("the quick brown fox jumps over the lazy dog " * 40)[:400]
    llm.reset()
    want = llm.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True, sfi=config)
    llm.reset()
    stepper = llm.stepper(config)
    assert isinstance(stepper, Stepper) and isinstance(stepper, {"dense": DenseStepper, "sfi": SFIStepper}[name])
    assert stepper.ctx is llm.context and stepper.mode == name
    assert stepper.prefill(prompt) == len(prompt)
    got = []
    for _ in range(24):
        got.append(llm.context.greedy_token())
        stepper.step(got[-1])
    assert got == want.tokens
    stats = GenerationStats()
    stepper.annotate(stats)
    if name == "sfi":
        assert stats.sfi.n_bootstrap == 1 and stats.sfi.n_fast > 0 and stats.sfi.k_head == 64
    else:
        assert stats.sfi is None


def test_a_closed_model_gives_no_stepper():
    model = SFILlama(str(random_model("tiny-llama")), n_ctx=256, n_threads=1)
    model.close()
    with pytest.raises(ContextError, match="closed"):
        model.stepper()
