"""Tool calling for the chat API: the request's tools and tool choice, the model's calls as OpenAI tool_calls.

The tools reach the model through the GGUF's own chat template (its `tools` variable, as transformers and
llama-cpp-python render it); the model answers in the template's call format. The format read here is
the Hermes one that Qwen2.5 / Qwen3 (the default model), Hermes and many fine-tunes use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As llama.cpp's own parser for this format (common/chat.cpp, which llama-server uses) does, a call may also come
without the tags: a JSON object {"name": ..., "arguments": ...} on its own lines, bare or in a ```json fence,
whose name is one of the request's tools (small models often answer so).

`tool_choice` "required" or a named function is enforced with llama.cpp's grammar sampler: the grammar
(llama-cpp-python's JSON-schema converter, on a schema of the call object) admits only calls in that
format whose name is one of the tools (or the named one) and whose arguments follow its parameters.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass
class ToolRequest:
    """What a chat request asked about tools: `tools` (OpenAI tool dicts, None for no tools), `choice`
    ("auto", "none", "required" or a function name), `parallel` (several calls in one answer allowed),
    `legacy` (the request used the old `functions` / `function_call` fields)."""

    tools: list[dict] | None = None
    choice: str = "auto"
    parallel: bool = True
    legacy: bool = False
    names: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        """The model may (or must) call tools in this answer."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"


def tool_request(tools=None, tool_choice=None, functions=None, function_call=None,
                 parallel_tool_calls=None) -> ToolRequest:
    """The request's tool fields, checked (ValueError naming the field), legacy `functions` as tools."""
    legacy = functions is not None or function_call is not None
    if functions is not None:
        if tools is not None:
            raise ValueError("give tools or functions (the legacy form), not both")
        if not isinstance(functions, list):
            raise ValueError(f"functions must be a list of function objects, got {functions!r}")
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None:
        if tool_choice is not None:
            raise ValueError("give tool_choice or function_call (the legacy form), not both")
        if isinstance(function_call, dict):
            tool_choice = {"type": "function", "function": {"name": function_call.get("name")}}
        else:
            tool_choice = function_call
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise ValueError("tools must be a list of {'type': 'function', 'function': {'name': ..., "
                             f"'parameters': {{...}}}} objects, got {tools!r}")
        tools = tools or None
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("auto", "none", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        choice = tool_choice["function"]["name"]
        if choice not in names:
            raise ValueError(f"tool_choice names the function {choice!r}, which is not in tools ({names})")
    else:
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r}")
    if choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    if parallel_tool_calls not in (None, True, False):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
    return ToolRequest(tools=tools, choice=choice, parallel=parallel_tool_calls is not False, legacy=legacy,
                       names=names)


def _is_tool(t) -> bool:
    return (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] != ""
            and isinstance(t["function"].get("parameters", {}), dict))


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool_calls carry their arguments as objects
    (OpenAI sends them as JSON text; the templates write them with `tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ValueError(f"tool call arguments are not JSON: {args!r}") from None
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed}
        elif isinstance(m, dict) and m.get("function_call"):  # the legacy form of one call
            fn = dict(m["function_call"])
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            m = {**m, "tool_calls": [{"type": "function", "function": fn}]}
        if isinstance(m, dict) and m.get("role") == "function":  # legacy tool result
            m = {**m, "role": "tool"}
        out.append(m)
    return out


def grammar(request: ToolRequest) -> str:
    """GBNF for a forced choice: one call (several when parallel and not named) in the Hermes format."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    tools = [t for t in request.tools if request.choice == "required" or t["function"]["name"] == request.choice]
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"oneOf": calls}
    rules = re.sub(r"^root ::=", "tool-call-object ::=", json_schema_to_gbnf(json.dumps(schema)), flags=re.M)
    block = '"<tool_call>\\n" tool-call-object "\\n</tool_call>"'
    many = request.parallel and request.choice == "required"
    root = f"root ::= {block}" + (f' ("\\n" {block})*' if many else "")
    return root + "\n" + rules


def parse(text: str, names=()) -> tuple[str, list[dict]]:
    """The model's answer -> (its text outside the calls, stripped; OpenAI tool_calls). A block that is not a
    call (not JSON, no name) stays in the text. Without tagged calls, JSON objects that call one of `names`
    (bare, at the start of a line, or in a code fence) are the calls."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    if not calls and names:
        return _untagged(text, set(names))
    return "".join(kept).strip(), calls


_FENCE = re.compile(r"```[a-zA-Z]*[ \t]*\n?\s*```|```[a-zA-Z]*\s*$")


def _untagged(text: str, names: set) -> tuple[str, list[dict]]:
    decoder = json.JSONDecoder()
    calls, kept, pos, i = [], [], 0, 0
    while i < len(text):
        j = text.find("{", i)
        if j < 0:
            break
        line_start = text.rfind("\n", 0, j) + 1
        if text[line_start:j].strip() not in ("", "```json", "```"):
            i = j + 1
            continue
        try:
            obj, end = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        call = _call(json.dumps(obj)) if isinstance(obj, dict) and obj.get("name") in names else None
        if call is None:
            i = end
            continue
        kept.append(text[pos:j])
        calls.append(call)
        pos = i = end
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:  # the fences that held the calls are empty now
        content = _FENCE.sub("", content.replace("```json\n", "```\n"))
    return content.strip(), calls


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ("arguments", "parameters", "args") if k in obj), {})  # (what small models write)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def message(text: str, finish: str, request: ToolRequest) -> tuple[dict, str]:
    """An answer's text -> (the OpenAI assistant message, finish_reason): its calls as `tool_calls`
    ("tool_calls"; the legacy form: `function_call`, "function_call"), or the text as it is."""
    content, calls = parse(text, request.names)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    if not request.parallel:
        calls = calls[:1]
    out = {"role": "assistant", "content": content or None, "tool_calls": calls}
    if request.legacy:
        out["function_call"] = calls[0]["function"]
        return out, "function_call"
    return out, "tool_calls"


class CallStream:
    """Streamed text -> ("content", text) and ("tool_call", call) events: text outside the calls streams as it
    comes (a tail that may be the start of `<tool_call>` is held back), a call once its block is closed.
    `deltas` gives them as the `delta` dicts of chat.completion.chunk objects."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.buffer = ""
        self.n_calls = 0
        self.content_seen = False
        self.names = tuple(request.names)
        self.holding = None  # an answer that starts like an untagged call: held whole, parsed at the end

    def deltas(self, piece: str | None) -> Iterator[dict]:
        """The deltas of the next piece of text (None: the end of the answer)."""
        for kind, value in (self.flush() if piece is None else self.push(piece)):
            if kind == "content":
                yield {"content": value}
            elif self.request.parallel or self.n_calls == 1:  # without parallel_tool_calls: the first call only
                if self.request.legacy:
                    yield {"function_call": value["function"]}
                else:
                    yield {"tool_calls": [{"index": self.n_calls - 1, **value}]}

    def finish_reason(self, finish: str) -> str:
        if not self.n_calls:
            return finish
        return "function_call" if self.request.legacy else "tool_calls"

    def push(self, piece: str) -> Iterator[tuple[str, Any]]:
        self.buffer += piece
        if self.holding is None and not self.content_seen and not self.n_calls and self.names:
            head = self.buffer.lstrip()
            if head and not (OPEN.startswith(head[:len(OPEN)]) or head.startswith(OPEN)):
                self.holding = head.startswith("{") or head.startswith("`")
        if self.holding:
            return
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                yield from self._content(text)
                return
            yield from self._content(self.buffer[:start])
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                return
            block = self.buffer[start:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                yield from self._content(block)
            else:
                self.n_calls += 1
                yield "tool_call", call

    def flush(self) -> Iterator[tuple[str, Any]]:
        text, self.buffer = self.buffer, ""
        if self.holding:
            content, calls = parse(text, self.names)
            yield from self._content(content)
            for call in calls:
                self.n_calls += 1
                yield "tool_call", call
            return
        yield from self._content(text)

    def _content(self, text: str) -> Iterator[tuple[str, Any]]:
        if not self.content_seen:
            text = text.lstrip()
        if self.n_calls and not text.strip():
            return  # the newlines between calls
        if text:
            self.content_seen = True
            yield "content", text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
