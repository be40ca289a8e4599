"""`sfi-gguf serve`'s Responses API (/v1/responses) and Messages API (/v1/messages) against the official openai and
anthropic clients: the answers and their streamed events agree, a forced tool call's arguments stream, a chained
response reuses the cached prefix, JSON schemas hold the output, stop sequences and errors come back in each API's
own shape. The agent frameworks on top of these are in test_agent_clients.py."""
import json
import re
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
from pydantic import BaseModel  # noqa: E402

pytestmark = pytest.mark.real_model

TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)


# -- /v1/responses ------------------------------------------------------------------------------------
def test_response_streamed_and_not(client):
    kwargs = dict(model="test-model", instructions="Answer briefly.", input="Name three primary colors.",
                  max_output_tokens=8, **GREEDY)
    full = client.responses.create(**kwargs)
    assert full.object == "response" and full.model == "test-model"
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in full.output] == ["message"] and len(full.output_text) > 5
    assert full.usage.output_tokens == 8 and full.usage.input_tokens > 10
    events = list(client.responses.create(**kwargs, stream=True))  # (the SDK's stream() helper wants "completed")
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == 8 and final.id != full.id


def test_forced_function_call_streams_its_arguments(client):
    with client.responses.stream(model="test-model", input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice="required", max_output_tokens=40, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris"} and final.status == "completed"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.item_id == call.id


def test_previous_response_id_reuses_the_cached_prefix(client):
    """The chained request sends only the tool's output; its prompt begins with the tokens the first one left in the
    cache. A stored response reads back, and once deleted it cannot be continued."""
    first = client.responses.create(model="test-model", input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    **GREEDY)
    (call,) = first.output
    second = client.responses.create(model="test-model", previous_response_id=first.id, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=16, **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 degrees Celsius, light rain"}])
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="previous response .* not found"):
        client.responses.create(model="test-model", previous_response_id=first.id, input="Hi", max_output_tokens=1)


class Person(BaseModel):
    name: str
    age: int


def test_json_schema_text_format(client):
    parsed = client.responses.parse(model="test-model", input="Invent a person.", text_format=Person,
                                    max_output_tokens=40, **GREEDY)
    assert isinstance(parsed.output_parsed, Person) and parsed.output_parsed.name


def test_responses_refusals_are_400(client):
    cases = [(dict(input="Hi", tools=[{"type": "web_search"}]), "only function tools"),
             (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
              "input_image"),
             (dict(input="Hi", background=True), "background"),
             (dict(input=[{"type": "item_reference", "id": "x"}]), "item_reference"),
             (dict(input="Hi", extra_body={"bogus": 1}), "bogus")]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.responses.create(model="test-model", max_output_tokens=1, **kwargs)


# -- /v1/messages -------------------------------------------------------------------------------------
def test_message_streamed_and_not_with_stop_sequences(claude):
    kwargs = dict(model="test-model", max_tokens=24, system="You count.",
                  messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                  stop_sequences=["7", "never"], extra_body=GREEDY)
    full = claude.messages.create(**kwargs)
    assert full.type == "message" and full.role == "assistant" and full.model == "test-model"
    assert full.stop_reason == "stop_sequence" and full.stop_sequence == "7"
    assert full.content[0].type == "text" and "6" in full.content[0].text and "7" not in full.content[0].text
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == full.content[0].text and final.stop_sequence == "7"
    assert final.usage.output_tokens == full.usage.output_tokens
    # the same request again: its prompt comes from the cache (all but its last tokens, decoded again for the logits)
    again = claude.messages.create(**{**kwargs, "max_tokens": 2})
    n_prompt = full.usage.input_tokens + full.usage.cache_read_input_tokens
    assert again.stop_reason == "max_tokens" and again.usage.output_tokens == 2
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == n_prompt
    assert again.usage.cache_read_input_tokens > 0 and 0 < again.usage.input_tokens < n_prompt


def test_message_json_schema_output(claude):
    reply = claude.messages.create(model="test-model", max_tokens=40, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Invent a person."}],
                                   output_config={"format": {"type": "json_schema",
                                                             "schema": Person.model_json_schema()}})
    assert Person.model_validate_json(reply.content[0].text).name


def test_messages_errors_have_anthropics_shape(claude):
    user = [{"role": "user", "content": "Hi"}]
    cases = [(dict(max_tokens=0, messages=user), "max_tokens"),
             (dict(max_tokens=1, messages=[{"role": "system", "content": "Hi"}]), "role"),
             (dict(max_tokens=1, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
              "image"),
             (dict(max_tokens=1, messages=user, tools=[{"type": "bash_20250124", "name": "bash"}]), "server tools")]
    for kwargs, message in cases:
        with pytest.raises(anthropic.BadRequestError, match=message) as err:
            claude.messages.create(model="test-model", **kwargs)
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


BAD_BODIES = [  # (endpoint, body, what the message names)
    ("responses", [], "JSON object"),
    ("responses", {"input": [5]}, r"input\[0\]"),
    ("responses", {"input": [{"type": "function_call", "call_id": 5}]}, "call_id"),
    ("responses", {"input": "x", "include": [{}]}, "include"),
    ("responses", {"input": "x", "text": {"format": {"type": "json_schema"}}}, "schema"),
    ("responses", {"input": "x", "tools": [{"type": "function", "name": ""}]}, r"tools\[0\].name"),
    ("messages", {"max_tokens": 5, "messages": [5]}, "role"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "tool_use_id"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "container": "x"}, "container"),
]


@pytest.mark.parametrize("endpoint, body, names", BAD_BODIES)
def test_malformed_bodies_are_400_in_each_apis_shape(server, endpoint, body, names):
    request = urllib.request.Request(f"{server.url}/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400
    reply = json.loads(err.value.read())
    if endpoint == "messages":
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    else:
        assert reply["error"]["type"] == "invalid_request_error"
    assert re.search(names, reply["error"]["message"])
