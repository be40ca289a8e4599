"""Tool calling and structured output through `sfi-gguf serve`, with the official openai client (real default
model, greedy): a tool-call round trip whose tool result is long enough for SFI to be sparse, streamed tool
calls, tool_choice required / named / parallel_tool_calls, the legacy functions, json_schema and json_object
replies validated with jsonschema."""
import json

import jsonschema
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text
from serving import running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SUM = [{"role": "user", "content": "What is 2 plus 3? Use the tool."}]


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=4096, n_threads=1, sfi=SFIConfig(k_head=64, n_recent=64))


def _create(client, **kwargs):
    return client.chat.completions.create(**{"model": "test-model", "temperature": 0, "max_tokens": 64, **kwargs})


def test_tool_call_round_trip(client):
    reply = _create(client, messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert "Paris" in json.loads(call.function.arguments).values()  # (the 0.5B model may name the key "name")

    # the tool's answer: long enough that the final answer decodes with SFI's sparse memory
    report = "Weather report for Paris: 18 degrees Celsius, light rain, wind 10 km/h.\n\n" + natural_text(3000)
    turn = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": report}]
    final = _create(client, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=32)
    answer = final.choices[0]
    stats = final.model_extra["sfi_stats"]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    assert stats["n_prompt_decoded"] < stats["n_prompt"] - 100  # the first turn's prefix came from the cache
    assert stats["sfi"]["n_fast"] > 0 and stats["sfi"]["n_bootstrap"] == 1  # SFI was sparse for this answer


def test_streamed_tool_calls_are_the_same_calls(client):
    whole = _create(client, messages=ASK, tools=TOOLS).choices[0].message.tool_calls
    chunks = list(_create(client, messages=ASK, tools=TOOLS, stream=True))
    calls = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_arguments_arrive_in_pieces(client):
    """The openai client's own stream helper (which accumulates tool-call deltas as it does for OpenAI): the call's
    arguments come in several `arguments.delta` events as the model writes them, and add up to the JSON of the
    call the whole answer has."""
    whole = _create(client, messages=SUM, tools=TOOLS).choices[0].message.tool_calls
    with client.chat.completions.stream(model="test-model", messages=SUM, tools=TOOLS, temperature=0,
                                        max_tokens=64) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    (call,) = final.message.tool_calls
    assert len(pieces) >= 3 and json.loads("".join(pieces)) == json.loads(call.function.arguments)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == \
        [(call.function.name, json.loads(call.function.arguments))]
    assert final.finish_reason == "tool_calls" and call.id.startswith("call_")


def test_required_named_and_single_calls(client):
    required = _create(client, messages=SUM, tools=TOOLS, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    assert all(c.function.name in ("add", "get_weather") for c in required.message.tool_calls)

    named = _create(client, messages=SUM, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                    parallel_tool_calls=False).choices[0]
    (call,) = named.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and args["a"] + args["b"] == 5


def test_legacy_functions(client):
    reply = _create(client, messages=SUM, functions=[ADD["function"]], function_call={"name": "add"})
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "add"
    assert set(json.loads(choice.message.function_call.arguments)) == {"a", "b"}


def test_json_schema_reply_is_valid(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                               "hobbies": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "hobbies"], "additionalProperties": False}
    reply = _create(client, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=96,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)

    plain = _create(client, messages=[{"role": "user", "content": "Give three colours as JSON."}], max_tokens=64,
                    response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), (dict, list))


def test_grammar_field(client):
    reply = _create(client, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=4,
                    extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert reply.choices[0].message.content in ("yes", "no")


def test_parallel_slots_constrain_each_request():
    """`serve --parallel 2`: a json_schema request and a required tool call decode in one batch, each with its
    own grammar in its own sampler chain."""
    import threading

    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    llm = SFILlama(None, n_ctx=1024, n_threads=1, n_parallel=2)
    results = {}
    with running_server(llm, "test-model") as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
        jobs = {"json": dict(messages=[{"role": "user", "content": "Name a colour."}],
                             response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}),
                "tool": dict(messages=SUM, tools=TOOLS, tool_choice="required")}
        threads = [threading.Thread(target=lambda k=k, kw=kw: results.__setitem__(k, _create(client, **kw)))
                   for k, kw in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    jsonschema.validate(json.loads(results["json"].choices[0].message.content), schema)
    assert results["tool"].choices[0].finish_reason == "tool_calls"
    assert results["tool"].choices[0].message.tool_calls[0].function.name in ("add", "get_weather")
