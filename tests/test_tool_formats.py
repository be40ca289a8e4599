"""The tool-call formats read from synthetic model answers (Hermes, Llama 3.x, Mistral), whole and streamed in
pieces: the calls, the text around them, the arguments streamed as the model writes them, the choice of format
from a chat template, and the grammars of forced calls (accepted by llama-cpp-python's grammar parser)."""
import json

import pytest

from sfi_gguf.serve import tool_calls
from sfi_gguf.serve.tool_formats import Hermes, Llama3, Mistral, for_template, value_end

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                  "required": ["a", "b"]}}}
PARIS = ("get_weather", {"city": "Paris"})
ONE_TWO = ("add", {"a": 1, "b": 2.5})

LLAMA3_TEMPLATE = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}{%- if message.role == "
                   "'ipython' %}{{ '<|start_header_id|>ipython<|end_header_id|>' }}{% endif %}")
NEMO_TEMPLATE = "{%- if message['role'] == 'assistant' %}{{ '[TOOL_CALLS][' }}{{ tool_call.id }}{% endif %}"
MAGISTRAL_TEMPLATE = "{{ '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' + tool_call.function.arguments }}"
QWEN_TEMPLATE = "{{- '<tool_call>\\n{\"name\": \"' }}{{ '\"}\\n</tool_call>' }}"

# (format, answer, expected content, expected calls)
CASES = [
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [PARIS]),
    (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>', "", [PARIS, ONE_TWO]),
    (Hermes(), '```json\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n```', "", [ONE_TWO]),
    (Hermes(), '<tool_call>\n{"arguments": {"a": 1, "b": 2.5}, "name": "add"}\n</tool_call>', "", [ONE_TWO]),
    (Hermes(), 'No tools needed: <tool_call> is a tag.', "No tools needed: <tool_call> is a tag.", []),
    (Llama3(), '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (Llama3(), '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (Llama3(), '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": '
               '{"a": 1, "b": 2.5}}', "", [PARIS, ONE_TWO]),
    (Llama3(), '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2.5}}', "", [ONE_TWO]),
    (Llama3(), '<|python_tag|>brave_search.call(query="weather in Paris")', "",
     [("brave_search", {"query": "weather in Paris"})]),
    (Llama3(), 'It is sunny in Paris: {"city": "Paris"}.', 'It is sunny in Paris: {"city": "Paris"}.', []),
    (Llama3(), '{"city": "Paris", "temp": 18}', '{"city": "Paris", "temp": 18}', []),
    (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2.5}, "id": "f5g6h7i8j"}]', "", [PARIS, ONE_TWO]),
    (Mistral(), 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking.",
     [PARIS]),
    (Mistral(), '[{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', "", [ONE_TWO]),  # the marker left out
    (Mistral(), '[1, 2, 3] are numbers.', "[1, 2, 3] are numbers.", []),
    (Mistral(True), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2.5}', "",
     [PARIS, ONE_TWO]),
    (Mistral(True), '[TOOL_CALLS]add[CALL_ID]k3j4h5g6f[ARGS]{"a": 1, "b": 2.5}', "", [ONE_TWO]),
]


def _request(fmt, **kwargs):
    request = tool_calls.tool_request(tools=[WEATHER, ADD], **kwargs)
    request.format = fmt
    return request


def _calls(openai_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in openai_calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_answer(fmt, text, content, calls):
    got_content, got_calls = tool_calls.parse(text, _request(fmt))
    assert (got_content, _calls(got_calls)) == (content, calls)
    message, finish = tool_calls.message(text, "stop", _request(fmt))
    assert finish == ("tool_calls" if calls else "stop")
    assert len({c["id"] for c in message.get("tool_calls") or []}) == len(calls)


def _stream(fmt, text, size, **kwargs):
    stream = tool_calls.CallStream(_request(fmt, **kwargs))
    deltas = [d for k in range(0, len(text), size) for d in stream.deltas(text[k:k + size])]
    return deltas + list(stream.deltas(None)), stream


def _joined(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for part in d.get("tool_calls", []):
            entry = calls.setdefault(part["index"], {"id": part.get("id"), "name": "", "arguments": ""})
            entry["name"] += part["function"].get("name") or ""
            entry["arguments"] += part["function"].get("arguments") or ""
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_answer_gives_the_same_calls(fmt, text, content, calls, size):
    deltas, stream = _stream(fmt, text, size)
    got_content, got_calls = _joined(deltas)
    assert got_content.strip() == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls.values()] == calls
    assert all(c["id"] for c in got_calls.values())
    assert stream.finish_reason("stop") == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("fmt, text", [
    (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}\n'
               '</tool_call>'),
    (Hermes(), '{"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}'),  # untagged
    (Llama3(), '{"name": "get_weather", "parameters": {"city": "Paris, the capital of France"}}'),
    (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}]'),
    (Mistral(True), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris, the capital of France"}'),
])
def test_arguments_stream_as_they_are_written(fmt, text):
    """Token by token: the call's id and name come once, in its first delta, then its arguments in many pieces,
    each sent as soon as the model wrote it (before the answer ends)."""
    stream = tool_calls.CallStream(_request(fmt))
    pieces = []
    for k in range(0, len(text), 2):
        for d in stream.deltas(text[k:k + 2]):
            pieces.append((k, d["tool_calls"][0]))
    heads = [p for _, p in pieces if "id" in p]
    assert len(heads) == 1 and heads[0]["function"] == {"name": "get_weather", "arguments": ""}
    arguments = [p["function"]["arguments"] for _, p in pieces if "id" not in p]
    assert len(arguments) > 10 and "".join(arguments) == '{"city": "Paris, the capital of France"}'
    assert all(k < len(text) for k, _ in pieces)
    assert not list(stream.deltas(None))


def test_content_that_may_start_a_call_is_held_back():
    stream = tool_calls.CallStream(_request(Hermes()))
    assert list(stream.deltas("Looking it up <tool")) == [{"content": "Looking it up "}]
    assert list(stream.deltas("box> now")) == [{"content": "<toolbox> now"}]


def test_no_parallel_calls_keeps_the_first():
    text = CASES[1][1]
    deltas, _ = _stream(Hermes(), text, 4, parallel_tool_calls=False)
    assert [c["name"] for c in _joined(deltas)[1].values()] == ["get_weather"]
    message, _ = tool_calls.message(text, "stop", _request(Hermes(), parallel_tool_calls=False))
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_legacy_function_call_streams_its_arguments():
    request = tool_calls.tool_request(functions=[WEATHER["function"]])
    stream = tool_calls.CallStream(request)
    text = CASES[0][1]
    deltas = [d for k in range(0, len(text), 5) for d in stream.deltas(text[k:k + 5])]
    parts = [d["function_call"] for d in deltas if "function_call" in d]
    assert parts[0]["name"] == "get_weather" and json.loads("".join(p["arguments"] for p in parts)) == PARIS[1]
    assert stream.finish_reason("stop") == "function_call"


def test_mistral_ids_fit_its_templates():
    _, calls = tool_calls.parse(CASES[12][1], _request(Mistral()))
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("template, kind", [
    (QWEN_TEMPLATE, Hermes), (LLAMA3_TEMPLATE, Llama3), (NEMO_TEMPLATE, Mistral), (MAGISTRAL_TEMPLATE, Mistral),
    (None, Hermes),
])
def test_format_from_template(template, kind):
    fmt = for_template(template)
    assert isinstance(fmt, kind)
    if kind is Mistral:
        assert fmt.named_form == ("[ARGS]" in template)


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=1024, n_threads=1, sfi=False)


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", [Hermes(), Llama3(), Mistral(), Mistral(True)],
                         ids=["hermes", "llama3", "mistral-array", "mistral-named"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_forced_call_grammar_gives_a_call_in_the_format(llm, fmt, choice):
    """The grammar of a forced choice, in llama.cpp's grammar sampler on the default model: the answer is a call
    that the same format reads back, of the named tool when one is named."""
    request = _request(fmt, tool_choice=choice if choice == "required" else
                       {"type": "function", "function": {"name": choice}})
    out = llm.generate([{"role": "user", "content": "What is 1 plus 2.5?"}], max_tokens=60, temperature=0,
                       grammar=tool_calls.grammar(request))
    _, calls = tool_calls.parse(out.text, request)
    assert out.finish_reason == "stop" and calls, out.text
    names = {"add"} if choice == "add" else {"add", "get_weather"}
    assert {c["function"]["name"] for c in calls} <= names
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)


@pytest.mark.parametrize("text, end", [('{"a": "}"}x', 10), ('[1, [2]]', 8), ('"a\\"b" ', 6), ('{"a": ', None),
                                       ('"abc', None)])
def test_value_end(text, end):
    assert value_end(text, 0) == end
