"""llama-cpp-python's API on SFILlama (real default model): shapes, streaming, stop, logprobs, errors,
prefix reuse across chat turns. Generations are a few greedy tokens each."""
import inspect

import pytest

from sfi_gguf import ensure_model  # first: points llama_cpp at the patched library
from sfi_gguf.serve import openai_api
from llama_cpp import llama_types  # noqa: E402,I001
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

THREADS = 1  # one thread: 2 cores shared with other jobs make 2 llama.cpp threads spin-wait (10x slower)
PROMPT = "The three most important ideas in computer architecture are"
CHAT = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def completion(llm):
    return llm(PROMPT, max_tokens=12, temperature=0, logprobs=3)


def _keys(typed_dict) -> tuple[set, set]:
    """(required, all) keys of a llama_types TypedDict."""
    return set(typed_dict.__required_keys__), set(typed_dict.__annotations__)


def _assert_shape(obj: dict, typed_dict, extra=frozenset()):
    required, allowed = _keys(typed_dict)
    assert required <= set(obj) <= allowed | set(extra), (typed_dict.__name__, sorted(obj))


def test_signatures_are_llama_cpp_pythons():
    from llama_cpp import Llama

    for ours, theirs in ((openai_api.create_completion, Llama.create_completion),
                         (openai_api.create_chat_completion, Llama.create_chat_completion)):
        a = {n: p.default for n, p in inspect.signature(ours).parameters.items()
             if n not in ("llm", "sfi", "parallel_tool_calls", "n")}  # (our keyword-only extras)
        b = {n: p.default for n, p in inspect.signature(theirs).parameters.items() if n != "self"}
        assert list(a) == list(b)
        assert {n: d for n, d in a.items() if n != "stop"} == {n: d for n, d in b.items() if n != "stop"}


def test_completion_shape_and_usage(llm, completion):
    _assert_shape(completion, llama_types.CreateCompletionResponse, extra={"sfi_stats"})
    choice = completion["choices"][0]
    _assert_shape(choice, llama_types.CompletionChoice)
    _assert_shape(completion["usage"], llama_types.CompletionUsage)
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    assert choice["finish_reason"] == "length" and len(choice["text"]) > 10
    assert completion["usage"] == {"prompt_tokens": len(llm.tokenize(PROMPT)), "completion_tokens": 12,
                                   "total_tokens": len(llm.tokenize(PROMPT)) + 12}
    stats = completion["sfi_stats"]
    assert stats["n_generated"] == 12 and stats["mode"] == "sfi" and "n_fast" in stats["sfi"]


def test_logprobs_are_the_greedy_tokens(completion):
    choice = completion["choices"][0]
    lp = choice["logprobs"]
    _assert_shape(lp, llama_types.CompletionLogprobs)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == len(PROMPT)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and len(top) <= 4 and top[token] == logprob
        assert logprob == max(top.values())  # greedy picks the most likely token


def test_stream_chunks_concatenate_to_the_greedy_text(llm, completion):
    chunks = list(llm.create_completion(PROMPT, max_tokens=12, temperature=0, stream=True))
    for c in chunks:
        _assert_shape(c, llama_types.CreateCompletionResponse, extra={"sfi_stats"})
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == completion["choices"][0]["text"]
    assert "sfi_stats" in chunks[-1] and chunks[-1]["sfi_stats"]["n_generated"] == 12


def test_stop_string(llm, completion):
    full = completion["choices"][0]["text"]
    cut = full.strip().split()[2]
    out = llm(PROMPT, max_tokens=12, temperature=0, stop=[cut])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == full[: full.index(cut)]
    streamed = "".join(c["choices"][0]["text"] for c in llm(PROMPT, max_tokens=12, temperature=0, stop=cut,
                                                             stream=True))
    assert streamed == out["choices"][0]["text"]


@pytest.mark.parametrize("kwargs", [{"tfs_z": 0.5}, {"logprobs": 1, "stream": True}, {"echo": True, "logprobs": 1}])
def test_unsupported_completion_arguments_raise(llm, kwargs):
    with pytest.raises(NotImplementedError):
        llm.create_completion(PROMPT, max_tokens=2, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}}, "'g'"),
    ({"tools": [{"function": {}}]}, "tools must be"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"grammar": object()}, "grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar and response_format"),
    ({"grammar": "root ::= nothing-defined"}, "grammar"),
])
def test_bad_tool_and_format_arguments_name_the_option(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.create_chat_completion(CHAT, max_tokens=2, **kwargs)


def test_logit_bias_typical_and_mirostat(llm):
    banana = llm.tokenize(" banana", add_special=False)[0]
    assert llm.generate(PROMPT, max_tokens=3, temperature=0, logit_bias={banana: 100.0}).tokens == [banana] * 3
    greedy = llm.generate(PROMPT, max_tokens=1, temperature=0).tokens[0]
    assert llm.generate(PROMPT, max_tokens=1, temperature=0, logit_bias={str(greedy): -100}).tokens[0] != greedy
    for kwargs in ({"typical_p": 0.5}, {"mirostat_mode": 1}, {"mirostat_mode": 2, "mirostat_tau": 3.0}):
        runs = [llm.generate(PROMPT, max_tokens=8, temperature=0.8, seed=7, **kwargs).tokens for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 8, kwargs  # seeded: the same draw twice
    out = llm(PROMPT, max_tokens=2, temperature=0, logit_bias={banana: 100.0})
    assert out["choices"][0]["text"] == " banana" * 2
    with pytest.raises(ValueError, match="logit_bias"):
        llm(PROMPT, max_tokens=1, logit_bias={"x": 1})
    with pytest.raises(ValueError, match="logit_bias: token ids out of range"):
        llm(PROMPT, max_tokens=1, logit_bias={10**7: 1})
    with pytest.raises(ValueError, match="mirostat_mode"):
        llm(PROMPT, max_tokens=1, mirostat_mode=3)
    with pytest.raises(ValueError, match="typical_p"):
        llm(PROMPT, max_tokens=1, typical_p=0)


def test_bad_input_is_a_value_error(llm):
    with pytest.raises(ValueError, match="create_chat_completion"):
        llm.create_completion(CHAT)
    with pytest.raises(ValueError, match="messages"):
        llm.create_chat_completion([])
    with pytest.raises(ValueError, match="SFIConfig field"):
        llm.create_completion(PROMPT, max_tokens=1, sfi={"k_heads": 3})


def test_chat_equals_llama_cpp_python(llm):
    """Same prompt (the GGUF's Jinja template), same greedy answer, same dict and chunk shapes."""
    from llama_cpp import Llama

    ref = Llama(str(ensure_model()), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, flash_attn=True,
                verbose=False)
    expected = ref.create_chat_completion(CHAT, max_tokens=8, temperature=0)
    expected_chunks = list(ref.create_chat_completion(CHAT, max_tokens=8, temperature=0, stream=True))
    del ref
    got = llm.create_chat_completion(CHAT, max_tokens=8, temperature=0)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"] == expected["usage"]
    assert set(got) == set(expected) | {"sfi_stats"} and got["object"] == "chat.completion"
    assert set(got["choices"][0]) == set(expected["choices"][0])
    _assert_shape(got["choices"][0], llama_types.ChatCompletionResponseChoice)
    chunks = list(llm.create_chat_completion(CHAT, max_tokens=8, temperature=0, stream=True))
    for stream in (chunks, expected_chunks):  # how the text is split into chunks may differ
        assert stream[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert stream[-1]["choices"][0]["delta"] == {}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in stream) == \
            got["choices"][0]["message"]["content"]
        assert [c["choices"][0]["finish_reason"] for c in stream] == [None] * (len(stream) - 1) + ["length"]
    for c in chunks:
        _assert_shape(c, llama_types.CreateChatCompletionStreamResponse, extra={"sfi_stats"})
        _assert_shape(c["choices"][0], llama_types.ChatCompletionStreamResponseChoice)
        assert c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-")
    assert "sfi_stats" in chunks[-1]


def test_penalties_equal_llama_cpp_python(llm):
    """repeat, frequency and presence penalties: the greedy text of llama_cpp.Llama on the same library
    (both run llama.cpp's penalties sampler over the generated tokens, last 64), and not the text
    without penalties (they did act)."""
    from llama_cpp import Llama

    prompt = "List the word 'cache' ten times, separated by spaces:"
    cases = (dict(repeat_penalty=1.3), dict(frequency_penalty=1.0),
             dict(repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5))
    ref = Llama(str(ensure_model()), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, flash_attn=True,
                verbose=False)
    expected = [ref.create_completion(prompt, max_tokens=24, temperature=0, **kw)["choices"][0]["text"]
                for kw in ({}, *cases)]
    del ref
    plain = llm.create_completion(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    assert plain == expected[0]
    for kw, want in zip(cases, expected[1:]):
        got = llm.create_completion(prompt, max_tokens=24, temperature=0, **kw)["choices"][0]["text"]
        assert got == want != plain, kw
        assert llm.generate(prompt, max_tokens=24, temperature=0, **kw).text == want
    chat = llm.create_chat_completion(CHAT, max_tokens=4, temperature=0, presence_penalty=0.5)
    assert chat["usage"]["completion_tokens"] == 4


def test_chat_logprobs(llm):
    out = llm.create_chat_completion(CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == out["choices"][0]["message"]["content"]
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"] for t in content)


def test_conversation_reuses_the_cache_and_keeps_sfi(llm):
    """A conversation growing turn by turn prefills only the new messages; SFI selects on every turn
    (a per-call `sfi=` small enough for this short context)."""
    sfi = SFIConfig(k_head=32, n_recent=32)
    messages = [{"role": "user", "content": natural_text(800, seed=4) + "\n\nWhat is this text about?"}]
    first = llm.create_chat_completion(messages, max_tokens=10, temperature=0, sfi=sfi)
    s1 = first["sfi_stats"]
    assert s1["sfi"]["n_bootstrap"] == 1 and s1["sfi"]["n_fast"] > 0
    follow_up = "Say it in three words."
    messages += [first["choices"][0]["message"], {"role": "user", "content": follow_up}]
    second = llm.create_chat_completion(messages, max_tokens=6, temperature=0, sfi=sfi)
    s2 = second["sfi_stats"]
    new_turn = llm.tokenize(f"<|im_end|>\n<|im_start|>user\n{follow_up}<|im_end|>\n<|im_start|>assistant\n",
                            add_special=False)
    # the history is not prefilled again: only the new turn (+ the last answer token, sampled but never decoded)
    assert s2["n_prompt"] > s1["n_prompt"] + s1["n_generated"]
    assert s2["n_prompt_decoded"] <= len(new_turn) + 1
    assert s2["sfi"]["n_bootstrap"] == 1 and s2["sfi"]["n_fast"] > 0
    dense = llm.create_chat_completion(messages, max_tokens=2, temperature=0, sfi=False)
    # (the prompt's last n_prefill_queries tokens are decoded again, as a fresh prefill decodes them)
    assert dense["sfi_stats"]["mode"] == "dense" and dense["sfi_stats"]["n_prompt_decoded"] == 16
