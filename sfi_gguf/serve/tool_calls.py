"""Tool calling for the chat API: the request's tools and tool choice, the model's calls as OpenAI tool_calls.

The tools reach the model through the GGUF's own chat template (its `tools` variable, as transformers and
llama-cpp-python render it); the model answers in its template's call format, read by `tool_formats` (Hermes
`<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`). Streamed, a call goes out as llama-server and OpenAI send
it: its id and name once they are known, then its arguments piece by piece as the model writes them.

`tool_choice` "required" or a named function is enforced with llama.cpp's grammar sampler: the grammar
(llama-cpp-python's JSON-schema converter, on a schema of the call object) admits only calls in the format
whose name is one of the tools (or the named one) and whose arguments follow its parameters.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

from . import tool_formats


@dataclass
class ToolRequest:
    """What a chat request asked about tools: `tools` (OpenAI tool dicts, None for no tools), `choice`
    ("auto", "none", "required" or a function name), `parallel` (several calls in one answer allowed),
    `legacy` (the request used the old `functions` / `function_call` fields), `format` (the tool-call format
    of the model, see `tool_formats`)."""

    tools: list[dict] | None = None
    choice: str = "auto"
    parallel: bool = True
    legacy: bool = False
    names: list[str] = field(default_factory=list)
    format: object = field(default_factory=tool_formats.Hermes)

    @property
    def active(self) -> bool:
        """The model may (or must) call tools in this answer."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"


def tool_request(tools=None, tool_choice=None, functions=None, function_call=None,
                 parallel_tool_calls=None, template: str | None = None) -> ToolRequest:
    """The request's tool fields, checked (ValueError naming the field), legacy `functions` as tools; the call
    format is the one of the chat template `template` (its Jinja source)."""
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
                       names=names, format=tool_formats.for_template(template))


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
    """GBNF for a forced choice: one call (several when parallel and not named) in the model's format."""
    return request.format.grammar(request)


def parse(text: str, request: ToolRequest) -> tuple[str, list[dict]]:
    """The model's whole answer -> (its text outside the calls, stripped; OpenAI tool_calls)."""
    scan = request.format.scan(text, request.names, final=True)
    calls = [{"id": request.format.new_id(), "type": "function",
              "function": {"name": c.name, "arguments": c.final_arguments()}} for c in scan.calls]
    return scan.content.strip(), calls


def message(text: str, finish: str, request: ToolRequest) -> tuple[dict, str]:
    """An answer's text -> (the OpenAI assistant message, finish_reason): its calls as `tool_calls`
    ("tool_calls"; the legacy form: `function_call`, "function_call"), or the text as it is."""
    content, calls = parse(text, request)
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
    """Streamed text -> the `delta` dicts of chat.completion.chunk objects, as llama-server sends them: text outside
    the calls as `content` once it is settled (a tail that may begin a call is held back), each call as a first
    `tool_calls` delta with its index, id and name once they are known, then deltas of its `arguments` text as
    the model writes it. The legacy `functions` form gets `function_call` deltas the same way."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""
        self.n_content = 0          # characters of the settled content already sent
        self.sent: list[str] = []   # per call sent: its arguments text sent so far
        self.content_seen = False

    @property
    def n_calls(self) -> int:
        return len(self.sent)

    def deltas(self, piece: str | None) -> Iterator[dict]:
        """The deltas of the next piece of text (None: the end of the answer)."""
        final = piece is None
        self.text += piece or ""
        scan = self.request.format.scan(self.text, self.request.names, final=final)
        content = scan.content[self.n_content:]
        self.n_content = len(scan.content)
        if final and scan.calls:  # (the text after the last call)
            content = content.rstrip()
        if not self.content_seen:
            content = content.lstrip()
        if content and not (self.sent and not content.strip()):  # (not the newlines between calls)
            self.content_seen = True
            yield {"content": content}
        limit = None if self.request.parallel else 1
        for i, call in enumerate(scan.calls[:limit]):
            if not (call.streamable or call.complete):
                continue
            arguments = call.arguments if call.streamable else call.final_arguments()
            if i == len(self.sent):
                self.sent.append("")
                yield self._delta(i, {"name": call.name, "arguments": ""}, self.request.format.new_id())
            if len(arguments) > len(self.sent[i]) and arguments.startswith(self.sent[i]):
                yield self._delta(i, {"arguments": arguments[len(self.sent[i]):]})
                self.sent[i] = arguments

    def _delta(self, index: int, function: dict, call_id: str | None = None) -> dict:
        if self.request.legacy:
            return {"function_call": function}
        head = {"id": call_id, "type": "function"} if call_id is not None else {}
        return {"tool_calls": [{"index": index, **head, "function": function}]}

    def finish_reason(self, finish: str) -> str:
        if not self.n_calls:
            return finish
        return "function_call" if self.request.legacy else "tool_calls"
