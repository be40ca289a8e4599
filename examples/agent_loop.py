"""An agent loop with a tool call, on top of `create_chat_completion`.

The model asks for a tool with one line of JSON, {"tool": "calculator", "input": "12 * 7"}; the loop
parses it, runs the tool, appends the result to the conversation and lets the model continue, until
it answers without a tool call. Every turn extends the same conversation, so each call only prefills
the new messages: watch "new prompt tokens" stay small while the prompt grows.

    python examples/agent_loop.py ["your question"] [--max-tokens 96]
"""
import argparse
import ast
import json
import operator
import re

from sfi_gguf import SFILlama

SYSTEM = """You are an assistant that can use one tool.
calculator: evaluates an arithmetic expression (numbers, + - * / ** and parentheses).
To use it, reply with exactly one line of JSON and nothing else, for example:
{"tool": "calculator", "input": "(3 + 4) * 12"}
The next message gives you the result. When you know the answer, reply in plain text without JSON."""

QUESTION = "A warehouse has 37 shelves with 148 boxes on each. How many boxes is that in total?"

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
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


TOOLS = {"calculator": calculator}


def parse_tool_call(text: str):
    """The first {"tool": ..., "input": ...} object in the reply, or None (a final answer)."""
    for match in re.finditer(r"\{[^{}]*\}", text):
        try:
            call = json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and "tool" in call:
            return str(call["tool"]), str(call.get("input", ""))
    return None


def run_agent(llm, question: str, max_tokens: int = 96, max_steps: int = 4) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for step in range(max_steps):
        reply = llm.create_chat_completion(messages, max_tokens=max_tokens, temperature=0)
        text = reply["choices"][0]["message"]["content"].strip()
        stats = reply["sfi_stats"]
        print(f"[step {step}: prompt {stats['n_prompt']} tokens, {stats['n_prompt_decoded']} new prompt tokens]")
        print(f"assistant: {text}")
        messages.append({"role": "assistant", "content": text})
        call = parse_tool_call(text)
        if call is None:
            return text
        name, argument = call
        result = TOOLS[name](argument) if name in TOOLS else f"error: unknown tool {name!r}"
        print(f"tool {name}({argument!r}) -> {result}")
        messages.append({"role": "user", "content": f"{name} result: {result}\n"
                                                    "If this answers my question, reply with the answer in words."})
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    args = parser.parse_args()
    llm = SFILlama(args.model, n_ctx=4096, n_threads=args.threads)
    print(f"user: {args.question}")
    answer = run_agent(llm, args.question, max_tokens=args.max_tokens)
    print(f"\nfinal answer: {answer}  (expected {37 * 148} for the default question)")
    llm.close()
