"""SFILlama's own API with llama-cpp-python's `echo`, `suffix` (fill in the middle with the default model's FIM
tokens), `logits_processor` and `stopping_criteria` (real default model, greedy, a few tokens each)."""
import numpy as np
import pytest

from sfi_gguf import SFILlama  # first: points llama_cpp at the patched library
from llama_cpp import LogitsProcessorList, StoppingCriteriaList  # noqa: E402,I001

pytestmark = pytest.mark.real_model

PROMPT = "The three most important ideas in computer architecture are"


def test_echo_puts_the_prompt_first(llm):
    plain = llm(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    echoed = llm(PROMPT, max_tokens=6, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + plain
    streamed = [c["choices"][0]["text"] for c in llm(PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)]
    assert streamed[0] == PROMPT and "".join(streamed) == echoed
    ids = llm.tokenize(PROMPT)
    assert llm(ids, max_tokens=6, temperature=0, echo=True)["choices"][0]["text"] == llm.detokenize(ids) + plain


def test_suffix_fills_in_the_middle(llm):
    prefix, suffix = "def greet(name):\n    print(", ')\n\ngreet("Ann")\n'
    middle = llm(prefix, suffix=suffix, max_tokens=12, temperature=0)["choices"][0]["text"]
    plain = llm(prefix, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert "name" in middle and middle != plain, (middle, plain)  # the code after the gap reached the model


def test_suffix_needs_fim_tokens_and_one_text_prompt(llm):
    with pytest.raises(ValueError, match="suffix"):
        llm([PROMPT, PROMPT], suffix="x", max_tokens=2)
    gemma = SFILlama("gemma3-270m", n_ctx=256, n_threads=1)
    try:
        with pytest.raises(ValueError, match="fill-in-the-middle tokens"):
            gemma("def f(", suffix="):\n", max_tokens=2)
    finally:
        gemma.close()


def test_logits_processor_rewrites_the_logits(llm):
    target = llm.tokenize(" banana", add_special=False)[0]
    seen = []

    def only_banana(input_ids, scores):
        seen.append(len(input_ids))
        out = np.full_like(scores, -np.inf)
        out[target] = 0.0
        return out

    out = llm(PROMPT, max_tokens=3, temperature=0, logits_processor=LogitsProcessorList([only_banana]))
    assert out["choices"][0]["text"] == " banana" * 3
    prompt_len = len(llm.tokenize(PROMPT))
    assert seen == [prompt_len, prompt_len + 1, prompt_len + 2]  # the tokens so far, each step
    chat = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
                                      logits_processor=only_banana)
    assert chat["choices"][0]["message"]["content"] == " banana" * 2
    sampled = llm.generate(PROMPT, max_tokens=2, temperature=0.8, seed=3, logits_processor=only_banana)
    assert sampled.text == " banana" * 2  # the sampler chain samples the rewritten logits too


def test_stopping_criteria_end_the_generation(llm):
    full = llm(PROMPT, max_tokens=8, temperature=0)
    prompt_len = len(llm.tokenize(PROMPT))

    def after_three(input_ids, logits):
        assert logits.shape == (llm.context.n_vocab,)
        return len(input_ids) >= prompt_len + 3

    out = llm(PROMPT, max_tokens=8, temperature=0, stopping_criteria=StoppingCriteriaList([after_three]))
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 3
    assert full["choices"][0]["text"].startswith(out["choices"][0]["text"])
    streamed = "".join(c["choices"][0]["text"] for c in llm(PROMPT, max_tokens=8, temperature=0, stream=True,
                                                             stopping_criteria=after_three))
    assert streamed == out["choices"][0]["text"]


@pytest.mark.parametrize("kwargs, name", [({"logits_processor": 3}, "logits_processor"),
                                          ({"stopping_criteria": "x"}, "stopping_criteria"),
                                          ({"echo": "yes"}, "echo")])
def test_bad_options_are_named(llm, kwargs, name):
    with pytest.raises(ValueError, match=name):
        llm(PROMPT, max_tokens=2, **kwargs)
