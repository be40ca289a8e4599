"""An agent framework from PyPI (LangChain's `ChatOpenAI`) against `sfi-gguf serve` on loopback (real default model,
greedy): a two-tool loop to its final answer, with one tool result long enough that SFI decodes sparsely, and
`with_structured_output` by JSON schema and by function calling."""
import pytest

from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

pytestmark = pytest.mark.real_model


@tool
def get_weather(city: str) -> str:
    """The current weather report of a city."""
    # long: the answer after it decodes with SFI's sparse memory
    return f"Weather report for {city}: 18 degrees Celsius, light rain.\n\n" + natural_text(3000)


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


TOOLS = {"get_weather": get_weather, "add": add}


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=4096, n_threads=1, sfi=SFIConfig(k_head=64, n_recent=64))


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(base_url=server.url, api_key="unused", model="test-model", temperature=0,
                                       max_tokens=64, max_retries=0, timeout=300)


def test_two_tool_loop_reaches_a_final_answer(llm, chat):
    """The loop of a LangChain agent: the model's tool calls run and answered with ToolMessages until it answers.
    The model picks its first tool itself; the controller then asks for the tool it has not used yet (a named
    tool_choice), and for the final answer once both ran (tool_choice "none")."""
    messages = [HumanMessage("What is 2 plus 3? And what is the weather in Paris?")]
    used = []
    for _ in range(4):
        todo = [name for name in TOOLS if name not in used]
        model = chat.bind_tools(list(TOOLS.values()), tool_choice=todo[0] if used and todo else
                                ("none" if not todo else "auto"))
        reply = model.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            assert call["id"] and call["name"] in TOOLS
            used.append(call["name"])
            messages.append(ToolMessage(str(TOOLS[call["name"]].invoke(call["args"])), tool_call_id=call["id"]))
    assert set(used) == set(TOOLS)
    results = [m.content for m in messages if isinstance(m, ToolMessage)]
    assert any(r.startswith("Weather report for") for r in results)
    assert any(r.replace(".", "", 1).lstrip("-").isdigit() for r in results)  # add ran on the numbers it was given
    final = messages[-1]
    assert not final.tool_calls and final.content.strip()
    stats = llm.last_stats
    assert stats.n_prompt > 800 and stats.sfi.n_fast > 0  # the final answer, after the long report, was sparse


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(chat, method):
    person = chat.with_structured_output(Person, method=method).invoke("Invent a person.")
    assert isinstance(person, Person) and person.name and person.age >= 0
