"""An agent loop with OpenAI-style tool calling, in process or against `sfi-gguf serve`.

The tools are declared as JSON schemas (`TOOLS`); the model's calls come back as `tool_calls`, the loop runs
them, appends each result as a `{"role": "tool", ...}` message and calls the model again, until it answers
without a call. A small model tends to call again with the same arguments: the loop then does not run the call
again but asks for the answer with `tool_choice="none"` (as it does on the last step). Every turn extends the same conversation, so each call only prefills the new messages: watch
"new prompt tokens" stay small while the prompt grows.

    python examples/agent_loop.py ["your question"] [-n 128]
    sfi-gguf serve --port 8000 &  python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1
"""
import argparse
import ast
import json
import operator

QUESTION = "A warehouse has 37 shelves with 148 boxes on each. How many boxes is that in total?"

TOOLS = [{"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (numbers, + - * / ** and parentheses)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]

SYSTEM = ("You are a helpful assistant. Call a tool only for a value you do not have yet; once a tool result "
          "answers the question, reply to the user in words, without calling a tool.")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic only (an AST walk, never eval)."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")
    try:
        return str(ev(ast.parse(str(expression), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


FUNCTIONS = {"calculate": calculator}


def run_tool(call: dict) -> str:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        return f"error: arguments are not JSON: {fn['arguments']!r}"
    if fn["name"] not in FUNCTIONS:
        return f"error: unknown tool {fn['name']!r}"
    return FUNCTIONS[fn["name"]](*args.values()) if args else "error: no arguments"


def run_agent(chat, question: str, max_steps: int = 4) -> str:
    """`chat(messages, tools, tool_choice)` -> (the reply's message as a dict, its "sfi_stats")."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    results = {}  # (name, arguments) -> result: a call the model repeats is not run again
    choice = "auto"
    for step in range(max_steps):
        if step == max_steps - 1:
            choice = "none"
        message, stats = chat(messages, TOOLS, choice)
        print(f"[step {step}: prompt {stats['n_prompt']} tokens, {stats['n_prompt_decoded']} new prompt tokens]")
        if not message.get("tool_calls"):
            messages.append(message)
            print(f"assistant: {message['content']}")
            return message["content"]
        repeated = [c for c in message["tool_calls"] if (c["function"]["name"], c["function"]["arguments"]) in results]
        if repeated:  # (small models do): the result is known, ask for the answer with no more calls
            fn = repeated[0]["function"]
            messages.append({"role": "user", "content": f"{fn['name']} returned {results[fn['name'], fn['arguments']]}. "
                                                        "Answer my question in words."})
            choice = "none"
            continue
        messages.append(message)
        for call in message["tool_calls"]:
            result = run_tool(call)
            results[call["function"]["name"], call["function"]["arguments"]] = result
            print(f"tool {call['function']['name']}({call['function']['arguments']}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages[-1].get("content") or ""


def in_process(model: str | None, threads: int | None, max_tokens: int):
    from sfi_gguf import SFILlama

    llm = SFILlama(model, n_ctx=4096, n_threads=threads)

    def chat(messages, tools, tool_choice):
        reply = llm.create_chat_completion(messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
                                           max_tokens=max_tokens, temperature=0)
        return reply["choices"][0]["message"], reply["sfi_stats"]
    return chat


def over_http(base_url: str, max_tokens: int):
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")

    def chat(messages, tools, tool_choice):
        reply = client.chat.completions.create(model="any", messages=messages, tools=tools, tool_choice=tool_choice,
                                               parallel_tool_calls=False, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.model_dump(exclude_none=True), reply.model_extra["sfi_stats"]
    return chat


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible server (sfi-gguf serve) instead")
    args = parser.parse_args()
    chat = over_http(args.base_url, args.max_tokens) if args.base_url else in_process(args.model, args.threads,
                                                                                     args.max_tokens)
    print(f"user: {args.question}")
    answer = run_agent(chat, args.question)
    print(f"\nfinal answer: {answer}  (expected {37 * 148} for the default question)")
