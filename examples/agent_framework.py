"""A LangChain agent driving `sfi-gguf serve`: two tools, the loop run to its final answer, then a structured reply.

LangChain's `ChatOpenAI` talks to the server as it talks to OpenAI: `bind_tools` sends the tools as JSON schemas,
the model's calls come back as `tool_calls`, each result goes back as a `ToolMessage`, and the server reuses the
conversation's KV cache every turn. The model picks its first tool; the loop then asks for the tool not used yet
(a named `tool_choice`) and, once both ran, for the answer. `with_structured_output` returns a pydantic object
(the server enforces its JSON schema with llama.cpp's grammar sampler).

    pip install langchain-openai
    sfi-gguf serve --port 8000 &
    python examples/agent_framework.py [--base-url http://127.0.0.1:8000/v1] ["your question"]
"""
import argparse

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

QUESTION = "What is 37 times 148? And what is the weather in Paris?"


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool
def get_weather(city: str) -> str:
    """The current weather of a city."""
    return f"{city}: 18 degrees Celsius, light rain, wind 10 km/h."


TOOLS = {t.name: t for t in (multiply, get_weather)}


class Summary(BaseModel):
    product: float
    weather: str


def run(chat: ChatOpenAI, question: str, max_steps: int = 4) -> list:
    messages, used = [HumanMessage(question)], []
    for step in range(max_steps):
        todo = [name for name in TOOLS if name not in used]
        choice = "none" if not todo or step == max_steps - 1 else (todo[0] if used else "auto")
        reply = chat.bind_tools(list(TOOLS.values()), tool_choice=choice).invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            print(f"assistant: {reply.content}")
            return messages
        for call in reply.tool_calls:
            result = TOOLS[call["name"]].invoke(call["args"]) if call["name"] in TOOLS else "unknown tool"
            used.append(call["name"])
            print(f"tool {call['name']}({call['args']}) -> {result}")
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    return messages


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the sfi-gguf serve address")
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    args = parser.parse_args()
    chat = ChatOpenAI(base_url=args.base_url, api_key="none", model="any", temperature=0, max_tokens=args.max_tokens)
    print(f"user: {args.question}")
    conversation = run(chat, args.question)
    summary = chat.with_structured_output(Summary, method="json_schema").invoke(
        conversation + [HumanMessage("Summarise the results.")])
    print(f"structured: {summary!r}")
