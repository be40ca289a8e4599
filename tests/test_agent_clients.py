"""Agent clients from PyPI against `sfi-gguf serve` on loopback (real default model, greedy): the OpenAI Agents SDK
over the Responses API (streamed, chained by previous_response_id) and over chat completions, Anthropic's SDK over
the Messages API (a tool round trip, the answer streamed) and a pydantic-ai agent with a typed result over the
Messages API. Each tool returns a long report, so the answer after it decodes with SFI's sparse memory.

The 0.5B model calls its tool reliably only when made to (a forced tool choice runs the call grammar), and left
free after a long result it may call it again; so the first turn forces the call and the tool is offered once
(as agents that look a thing up once per question do), or the answer turn says tool_choice "none"."""
import asyncio

import pytest

from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

agents = pytest.importorskip("agents")
anthropic = pytest.importorskip("anthropic")
pydantic_ai = pytest.importorskip("pydantic_ai")
import openai  # noqa: E402
from pydantic import BaseModel  # noqa: E402

pytestmark = pytest.mark.real_model

REPORT = natural_text(8000)  # ~1,650 tokens
QUESTION = "What is the weather in Paris?"
MAX_TOKENS = 48


def weather_report(city: str) -> str:
    return f"Weather report for {city}: 18 degrees Celsius, light rain.\n\n" + REPORT


# the `llm` fixture's SFILlama keywords (conftest.py): a small k_head and recent window, sparse from a few
# hundred cells on
LLM_ARGS = dict(n_ctx=2560, n_threads=1, sfi=SFIConfig(k_head=64, n_recent=64))


def assert_sparse_after_report(llm):
    """The last answer was generated after the whole report, with SFI's fast (sparse) steps."""
    stats = llm.last_stats
    assert stats.n_prompt > len(llm.tokenize(REPORT)) and stats.mode == "sfi" and stats.sfi.n_fast > 0


def weather_agent(model, calls: list):
    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)  # one lookup per question
    def get_weather(city: str) -> str:
        """The current weather report of a city."""
        calls.append(city)
        return weather_report(city)

    return agents.Agent(name="weather", instructions="Answer with the weather tool's report, in one sentence.",
                        tools=[get_weather], model=model,
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS,
                                                            tool_choice="required"))


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_function_tool(llm, server, api):
    """An Agent's run: the forced call, the tool's long report sent back, a text answer. Over the Responses API
    the run streams and chains its turns by previous_response_id (the second turn sends only the tool's output)."""
    agents.set_tracing_disabled(True)
    calls = []

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        if api == "chat_completions":
            agent = weather_agent(agents.OpenAIChatCompletionsModel("test-model", client), calls)
            return await agents.Runner.run(agent, QUESTION, max_turns=3), None
        agent = weather_agent(agents.OpenAIResponsesModel("test-model", client), calls)
        result = agents.Runner.run_streamed(agent, QUESTION, max_turns=3, auto_previous_response_id=True)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        second = await client.responses.retrieve(result.raw_responses[-1].response_id)
        assert second.previous_response_id == result.raw_responses[0].response_id
        return result, "".join(deltas)

    result, streamed = asyncio.run(run())
    assert calls == ["Paris"]
    outputs = [i.output for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs == [weather_report("Paris")]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    if streamed is not None:
        assert streamed == result.final_output
    assert_sparse_after_report(llm)


def test_anthropic_tool_round_trip_streamed(llm, server):
    """messages.create forces the tool (tool_use block), the long tool_result goes back, and the answer streams
    (tool_choice none: the tools stay in the prompt, so its whole first turn comes from the cache)."""
    client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": "The current weather report of a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    greedy = {"temperature": 0}  # (this SDK's create() has no sampling arguments)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model="test-model", max_tokens=MAX_TOKENS, system="Use the tools.",
                                   messages=messages, tools=tools, tool_choice={"type": "any"}, extra_body=greedy)
    assert first.stop_reason == "tool_use" and first.usage.input_tokens > 50
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": weather_report(call.input["city"])}]}]
    with client.messages.stream(model="test-model", max_tokens=MAX_TOKENS, system="Use the tools.",
                                messages=messages, tools=tools, tool_choice={"type": "none"},
                                extra_body=greedy) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text.strip() and [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.cache_read_input_tokens >= first.usage.input_tokens  # the first turn's prompt was reused
    assert final.usage.input_tokens > len(llm.tokenize(REPORT)) and final.usage.output_tokens > 0
    assert_sparse_after_report(llm)


class Weather(BaseModel):
    city: str
    temperature_celsius: int


def test_pydantic_ai_tool_and_typed_result(llm, server):
    """A pydantic-ai agent over the Messages API: its tool call, then its typed result (pydantic-ai's output tool,
    forced: the call grammar holds the arguments to the result's schema)."""
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    calls = []

    async def once(ctx, tool_def):  # one lookup per question
        return None if calls else tool_def

    provider = AnthropicProvider(base_url=server.url.removesuffix("/v1"), api_key="unused")
    agent = pydantic_ai.Agent(AnthropicModel("test-model", provider=provider), output_type=Weather,
                              instructions="Look the weather up with the tool, then report it.",
                              model_settings={"temperature": 0, "max_tokens": MAX_TOKENS,  # (the API version that
                                              "extra_headers": {"anthropic-version": "2023-06-01"}})  # takes it)

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """The current weather report of a city."""
        calls.append(city)
        return weather_report(city)

    result = agent.run_sync(QUESTION)
    assert calls == ["Paris"]
    assert isinstance(result.output, Weather) and result.output.city == "Paris"
    assert_sparse_after_report(llm)
