"""`sfi_gguf.Llama`: a llama_cpp.Llama whose token loop runs SFI (real default model).

The prompts are long enough for SFI to be sparse (k_head 32, n_recent 32: a 100-cell memory), so the
greedy answers are SFI's, compared with SFILlama's on the same engine; the features (chat handler,
grammar, JSON schema, logprobs, state) are llama-cpp-python's own.
"""
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

import sfi_gguf  # first: points llama_cpp at the patched library
import llama_cpp  # noqa: I001
from sfi_gguf import Llama, SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

THREADS = 1  # llama.cpp's reductions are the same for one thread in both objects (and 2 shared cores)
N_CTX = 1024
SFI = SFIConfig(k_head=32, n_recent=32)
DOC = natural_text(1400)
PROMPT = DOC + "\n\nIn one sentence, the text above is about"
CHAT = [{"role": "system", "content": "Answer briefly.\n\n" + DOC},
        {"role": "user", "content": "What is the text above about?"}]


def _llama(**kwargs) -> Llama:
    kwargs = {"n_ctx": N_CTX, "n_threads": THREADS, "n_threads_batch": THREADS, "flash_attn": True,
              "verbose": False, "sfi": SFI, **kwargs}
    return Llama(**kwargs)


@pytest.fixture(scope="module")
def llm():
    model = _llama()
    yield model
    model.close()


@pytest.fixture(scope="module")
def ref():
    model = SFILlama(None, n_ctx=N_CTX, n_threads=THREADS, sfi=SFI)
    yield model
    model.close()


def _assert_sparse(llm: Llama):
    stats = llm.last_sfi_stats
    assert stats is not None and stats.n_bootstrap == 1 and stats.n_fast > 0, stats


def test_is_a_llama_cpp_llama(llm):
    assert isinstance(llm, llama_cpp.Llama) and sfi_gguf.Llama is Llama
    assert llm.sfi_active and llm.sfi_unavailable is None
    assert llm.n_ctx() >= N_CTX and llm.n_vocab() == 151936 and llm.token_eos() >= 0
    assert llm.tokenize(b"Hello") == llama_cpp.Llama.tokenize(llm, b"Hello")


def test_greedy_completion_equals_sfillama(llm, ref):
    ours = llm.create_completion(PROMPT, max_tokens=24, temperature=0)
    _assert_sparse(llm)
    theirs = ref.create_completion(PROMPT, max_tokens=24, temperature=0)
    assert theirs["sfi_stats"]["sfi"]["n_fast"] == llm.last_sfi_stats.n_fast
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours["usage"] == theirs["usage"]


def test_plain_greedy_sample_is_llama_cpps_greedy_token(llm, monkeypatch):
    # the argmax in place picks what llama-cpp-python's sampler chain picks, without running the chain
    llm.create_completion(PROMPT, max_tokens=4, temperature=0)
    chain = llama_cpp.Llama.sample(llm, temp=0.0)
    monkeypatch.setattr(llama_cpp.Llama, "sample", lambda *a, **k: pytest.fail("the chain ran"))
    assert llm.sample(temp=0.0) == chain
    with pytest.raises(pytest.fail.Exception):
        llm.sample(temp=0.0, repeat_penalty=1.1)  # a penalty: the chain samples


def test_stream_is_the_same_text(llm):
    whole = llm.create_completion(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    pieces = [c["choices"][0]["text"] for c in llm.create_completion(PROMPT, max_tokens=16, temperature=0, stream=True)]
    _assert_sparse(llm)
    assert "".join(pieces) == whole


def test_chat_equals_sfillama(llm, ref):
    ours = llm.create_chat_completion(CHAT, max_tokens=24, temperature=0)
    _assert_sparse(llm)
    theirs = ref.create_chat_completion(CHAT, max_tokens=24, temperature=0)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"] > 300


def test_second_turn_reuses_the_prefix(llm):
    first = llm.create_chat_completion(CHAT, max_tokens=8, temperature=0)
    n_before = llm.n_tokens
    turn = CHAT + [first["choices"][0]["message"], {"role": "user", "content": "Say it in three words."}]
    evals = []
    original = llm.eval
    llm.eval = lambda tokens: (evals.append(len(tokens)), original(tokens))[1]
    try:
        llm.create_chat_completion(turn, max_tokens=8, temperature=0)
    finally:
        del llm.eval
    assert evals[0] < 40 < n_before  # only the new messages were prefilled
    _assert_sparse(llm)


def test_json_schema_response_format(llm):
    schema = {"type": "object", "properties": {"topic": {"type": "string"}, "sentences": {"type": "integer"}},
              "required": ["topic", "sentences"]}
    out = llm.create_chat_completion(CHAT[:1] + [{"role": "user", "content": "Describe the text as JSON."}],
                                     max_tokens=64, temperature=0,
                                     response_format={"type": "json_object", "schema": schema})
    _assert_sparse(llm)
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)


def test_grammar(llm):
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
    out = llm.create_completion(DOC + "\n\nIs the text above about music? Answer yes or no:", max_tokens=4,
                                temperature=0, grammar=grammar)
    assert out["choices"][0]["text"] in ("yes", "no")


def test_state_round_trip(llm):
    tokens = llm.tokenize(PROMPT.encode())
    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()
    first = [t for _, t in zip(range(12), llm.generate(tokens, temp=0))]
    _assert_sparse(llm)
    llm.create_completion("Something else entirely.", max_tokens=2, temperature=0)
    llm.load_state(state)
    again = [t for _, t in zip(range(12), llm.generate(tokens, temp=0))]
    assert again == first


def test_logprobs_with_logits_all():
    llm = _llama(logits_all=True)
    try:
        out = llm.create_completion(PROMPT, max_tokens=10, temperature=0, logprobs=2)
        _assert_sparse(llm)
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 10
        for token, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert max(top, key=top.get) == token  # greedy: the sampled token is the most likely one
    finally:
        llm.close()


def test_sfi_false_is_llama_cpp_python():
    prompt = "The three most important ideas in computer architecture are"
    outs = []
    for cls, kwargs in ((Llama, {"sfi": False}), (llama_cpp.Llama, {})):
        model = cls(str(sfi_gguf.ensure_model()), n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
                    **kwargs)
        try:
            outs.append(model.create_completion(prompt, max_tokens=12, temperature=0)["choices"][0]["text"])
            if cls is Llama:
                assert not model.sfi_active and model.sfi_unavailable == "sfi=False"
        finally:
            model.close()
    assert outs[0] == outs[1]


def test_every_call_after_close_raises_context_error():
    """llama-cpp-python's objects keep pointers into the freed model: a call after close() must raise, not crash
    the process (run in a subprocess, so that a crash fails this test instead of ending pytest)."""
    code = ("from sfi_gguf import Llama\n"
            "from sfi_gguf.core.context import ContextError\n"
            "llm = Llama(None, n_ctx=256, n_threads=1, verbose=False)\n"
            "llm('Hi', max_tokens=2)\n"
            "llm.close(); llm.close()\n"
            "calls = {'__call__': lambda: llm('hi'), 'tokenize': lambda: llm.tokenize(b'hi'),\n"
            "         'detokenize': lambda: llm.detokenize([9707]), 'n_vocab': llm.n_vocab, 'reset': llm.reset,\n"
            "         'chat': lambda: llm.create_chat_completion([{'role': 'user', 'content': 'hi'}]),\n"
            "         'eval': lambda: llm.eval([9707]), 'save_state': llm.save_state}\n"
            "for name, call in calls.items():\n"
            "    try:\n"
            "        call()\n"
            "    except ContextError as exc:\n"
            "        assert 'closed' in str(exc), exc\n"
            "    else:\n"
            "        raise AssertionError(name + ' answered after close()')\n"
            "print('all refused')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0 and "all refused" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_unsupported_settings_name_the_option():
    with pytest.raises(ValueError, match="k_head"):
        _llama(n_ctx=256, sfi=SFIConfig(k_head=512))
    with pytest.raises(ValueError, match="split_mode"):
        _llama(n_ctx=256, split_mode=llama_cpp.LLAMA_SPLIT_MODE_ROW)


TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
SUM = [{"role": "user", "content": "What is 2 plus 3? Use the tool."}]


def test_tool_calls(llm):
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    out = llm.create_chat_completion([{"role": "user", "content": "What is the weather in Paris?"}],
                                     tools=[weather] + TOOLS, max_tokens=48, temperature=0, repeat_penalty=1.0)
    c = out["choices"][0]
    assert c["finish_reason"] == "tool_calls", c  # tool_choice "auto": the model chose to call
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "Paris" in json.loads(call["function"]["arguments"]).values()
    out = llm.create_chat_completion(SUM, tools=TOOLS, tool_choice="required", max_tokens=48, temperature=0)
    c = out["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    chunks = list(llm.create_chat_completion(SUM, tools=TOOLS, tool_choice="required", max_tokens=48, temperature=0,
                                             stream=True))
    deltas = [d for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["add"]  # a call's first delta names it
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"a": 2, "b": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the next turn: the call and its result
    turn = SUM + [c["message"], {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    final = llm.create_chat_completion(turn, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0)
    assert "5" in final["choices"][0]["message"]["content"]


def test_openai_json_schema_form(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    out = llm.create_chat_completion([{"role": "user", "content": "Invent a person."}], max_tokens=48,
                                     temperature=0, response_format={"type": "json_schema",
                                                                     "json_schema": {"name": "p", "schema": schema}})
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)


def test_draft_model_decodes_as_llama_cpp_python():
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = _llama(n_ctx=256, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2))
    try:
        assert not model.sfi_active and "draft_model" in model.sfi_unavailable
        text = model.create_completion("1, 2, 3, 4, 5, 6,", max_tokens=8, temperature=0)["choices"][0]["text"]
        assert "7" in text
    finally:
        model.close()
