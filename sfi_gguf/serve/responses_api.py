"""OpenAI's Responses API (POST /v1/responses) on the chat completion machinery of `openai_api`.

A request becomes a chat completion: `instructions` a system message first, the `input` items chat messages (a
`message` item by its role, "developer" as "system"; `function_call` items the tool calls of an assistant
message; a `function_call_output` a tool message), function `tools`, `tool_choice` and `text.format` the chat
API's tools, tool choice and response_format (so tool formats, call parsing and grammars are the chat API's).
The answer comes back as output items: a `message` with its `output_text`, then one `function_call` item per
call; streamed, as the Responses events (response.created, response.output_item.added, response.output_text.delta,
response.function_call_arguments.delta, ..., response.completed, or response.incomplete when max_output_tokens
cut the answer).

`previous_response_id` continues a stored response: the conversation it ended (its input and its output; its
instructions are not carried over, as in OpenAI's API) comes before the new input, so the prompt begins with the
tokens the model's cache holds from that response and only the new items are prefilled (usage's `cached_tokens`
counts the tokens reused). Responses are kept in memory, the last `max_stored` (`store: false` keeps one out);
GET / DELETE /v1/responses/{id} read back or delete one.

Refused with a clear error: built-in tools (web search, file search, computer use, MCP ...), images, files and
audio as input, `background`, `conversation`, `prompt` templates, logprobs, truncation "auto". Accepted without
effect: `reasoning` (the model writes no separate reasoning; reasoning items in the input are skipped), `include`
of reasoning content, `metadata` (echoed), `user`, `service_tier`, `prompt_cache_key`, `safety_identifier`.
Extensions of llama.cpp's server: `seed`, `top_k`, `min_p`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty`, and `sfi` (this request's SFI settings, as for chat completions); "sfi_stats" rides along.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from typing import Any, Iterator

from . import openai_api

MAX_STORED = 256  # responses kept for previous_response_id, oldest dropped first

_EXTENSIONS = ("seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "sfi")
_NO_EFFECT = ("reasoning", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier",
              "stream_options", "prompt_cache_retention")  # (metadata, user and reasoning are echoed)
_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
           "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id", "store", "include",
           "truncation", *_NO_EFFECT, *_EXTENSIONS}
_REFUSED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
            "prompt": "prompt templates", "top_logprobs": "logprobs", "max_tool_calls": "limits on tool calls"}
_IGNORED_INCLUDES = {"reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
                     "computer_call_output.output.image_url"}  # data of things this server never produces


class ResponsesAPI:
    """The /v1/responses endpoint of one server: request checks, the translation, and the stored responses."""

    def __init__(self, max_stored: int = MAX_STORED):
        self.max_stored = max_stored
        # response id -> (the response, its conversation as chat messages without instructions)
        self._stored: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests run in several threads

    # -- stored responses ---------------------------------------------------------------------------
    def get(self, response_id: str) -> dict | None:
        with self._lock:
            found = self._stored.get(response_id)
        return found[0] if found else None

    def delete(self, response_id: str) -> dict | None:
        with self._lock:
            found = self._stored.pop(response_id, None)
        return {"id": response_id, "object": "response.deleted", "deleted": True} if found else None

    def _store(self, request: dict, response: dict, assistant: dict) -> None:
        if not request["store"]:
            return
        with self._lock:
            self._stored[response["id"]] = (response, request["conversation"] + [assistant])
            while len(self._stored) > self.max_stored:
                self._stored.popitem(last=False)

    def _conversation(self, response_id) -> list[dict]:
        if not isinstance(response_id, str):
            raise ValueError(f"previous_response_id must be a string, got {response_id!r}")
        with self._lock:
            found = self._stored.get(response_id)
            if found is not None:
                self._stored.move_to_end(response_id)  # a conversation in use is kept longest
        if found is None:
            raise ValueError(f"previous response {response_id!r} not found (this server keeps the last "
                             f"{self.max_stored} stored responses in memory)")
        return found[1]

    # -- the endpoint -------------------------------------------------------------------------------
    def parse(self, body: Any, model_name: str) -> dict:
        """A request body, checked (ValueError says what is wrong) -> what `create` runs."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        unknown = set(body) - _FIELDS - set(_REFUSED)
        if unknown:
            raise ValueError(f"unsupported field(s): {', '.join(sorted(unknown))}")
        for name, what in _REFUSED.items():
            if body.get(name) not in (None, False, 0):
                raise ValueError(f"{name}: {what} are not supported by this server")
        if body.get("input") is None:
            raise ValueError("'input' is required")
        if body.get("stream") not in (None, True, False):
            raise ValueError(f"stream must be true or false, got {body['stream']!r}")
        if body.get("store") not in (None, True, False):
            raise ValueError(f"store must be true or false, got {body['store']!r}")
        if body.get("truncation") not in (None, "disabled"):
            raise ValueError(f"truncation {body['truncation']!r} is not supported (only 'disabled': a conversation "
                             "longer than the context is refused)")
        include = body.get("include") or []
        if not isinstance(include, list) or not all(isinstance(i, str) and i in _IGNORED_INCLUDES for i in include):
            raise ValueError(f"include: {include!r} is not supported (logprobs are not; the others name data of "
                             "tools this server does not have)")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError(f"instructions must be a string, got {instructions!r}")
        max_output = body.get("max_output_tokens")
        if max_output is not None and (not isinstance(max_output, int) or isinstance(max_output, bool)
                                       or max_output < 1):
            raise ValueError(f"max_output_tokens must be a positive integer, got {max_output!r}")
        previous = body.get("previous_response_id")
        conversation = (self._conversation(previous) if previous is not None else []) + input_messages(body["input"])
        system = [{"role": "system", "content": instructions}] if instructions else []
        tools = body.get("tools") or None
        chat = {"tools": chat_tools(tools), "tool_choice": chat_tool_choice(body.get("tool_choice")),
                "parallel_tool_calls": body.get("parallel_tool_calls"),
                "response_format": chat_response_format(body.get("text")),
                "max_tokens": max_output, "stream": bool(body.get("stream")), "model": model_name,
                **{k: body[k] for k in ("temperature", "top_p", *_EXTENSIONS) if body.get(k) is not None}}
        return {"messages": system + conversation, "conversation": conversation, "chat": chat, "body": body,
                "store": body.get("store") is not False, "model": model_name, "stream": chat["stream"]}

    def create(self, llm, request: dict):
        """The response (a dict), or its events as (name, payload) pairs when streamed."""
        chat = openai_api.create_chat_completion(llm, request["messages"], **request["chat"])
        shape = _Shape(request)
        if request["chat"]["stream"]:
            return self._events(request, shape, chat)
        message, finish = chat["choices"][0]["message"], chat["choices"][0]["finish_reason"]
        response = shape.response(output_items(message, finish), finish, chat["sfi_stats"])
        self._store(request, response, message)
        return response

    def _events(self, request: dict, shape: "_Shape", chunks: Iterator[dict]) -> Iterator[tuple[str, dict]]:
        """The chat chunks as Responses events: an item is added when its first piece arrives, its pieces follow
        as deltas, and it is done when the next item starts or the answer ends."""
        numbers = itertools.count()

        def event(kind: str, **payload) -> tuple[str, dict]:
            return kind, {"type": kind, "sequence_number": next(numbers), **payload}

        output: list[dict] = []  # the items so far, the last one possibly still open
        open_item: dict | None = None

        def close(status: str = "completed") -> Iterator[tuple[str, dict]]:
            nonlocal open_item
            if open_item is None:
                return
            item, index, open_item = open_item, len(output) - 1, None
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **ids, part=part)
            else:
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)

        def start(item: dict) -> Iterator[tuple[str, dict]]:
            nonlocal open_item
            yield from close()
            output.append(item)
            open_item = item
            yield event("response.output_item.added", output_index=len(output) - 1, item=_in_progress(item))
            if item["type"] == "message":
                yield event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})

        try:
            for i, chunk in enumerate(chunks):
                if i == 0:  # after the prefill (its errors are the request's HTTP status)
                    yield event("response.created", response=shape.response([], None))
                    yield event("response.in_progress", response=shape.response([], None))
                choice = chunk["choices"][0]
                delta = choice["delta"]
                if delta.get("content"):
                    if open_item is None or open_item["type"] != "message":
                        yield from start(_message_item(""))
                    open_item["content"][0]["text"] += delta["content"]
                    yield event("response.output_text.delta", item_id=open_item["id"], output_index=len(output) - 1,
                                content_index=0, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or []:
                    if call.get("id"):  # a new call: its id and name
                        yield from start(_call_item(call["id"], call["function"]["name"], ""))
                    piece = call["function"].get("arguments")
                    if piece:
                        open_item["arguments"] += piece
                        yield event("response.function_call_arguments.delta", item_id=open_item["id"],
                                    output_index=len(output) - 1, delta=piece)
                finish = choice["finish_reason"]
                if finish is None:
                    continue
                if not output:  # an empty answer is an empty message
                    yield from start(_message_item(""))
                yield from close("incomplete" if finish == "length" else "completed")
                response = shape.response(output, finish, chunk.get("sfi_stats"))
                self._store(request, response, assistant_message(output))
                yield event("response.incomplete" if finish == "length" else "response.completed",
                            response=response)
        finally:
            chunks.close()

    @staticmethod
    def error(status: int, message: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": None, "code": None}}

    @staticmethod
    def stream_error(exc: Exception) -> tuple[str, dict]:
        return "error", {"type": "error", "sequence_number": 0, "code": "server_error", "param": None,
                         "message": f"{type(exc).__name__}: {exc}"}


class _Shape:
    """The response object of one request, at any stage."""

    def __init__(self, request: dict):
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, output: list[dict], finish: str | None, sfi_stats: dict | None = None) -> dict:
        body = self.request["body"]
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
               "model": self.request["model"], "output": output,
               "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
               "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
               "store": self.request["store"], "temperature": body.get("temperature"),
               "text": body.get("text") or {"format": {"type": "text"}},
               "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
               "top_p": body.get("top_p"), "truncation": "disabled", "usage": None, "user": body.get("user"),
               "metadata": body.get("metadata") or {}}
        if sfi_stats is not None:
            out["usage"] = usage(sfi_stats)
            out["sfi_stats"] = sfi_stats
        return out


def usage(sfi_stats: dict) -> dict:
    """Responses usage: input tokens, of which were in the cache already; output tokens."""
    u = openai_api.usage(sfi_stats)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": sfi_stats["n_prompt"] - sfi_stats["n_prompt_decoded"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


# -- requests -> chat completion arguments ------------------------------------------------------------
def input_messages(items) -> list[dict]:
    """`input` (text, or a list of items) -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ValueError(f"input must be a string or a list of items, got {items!r}")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": openai_api.required_string(item, "call_id", where), "type": "function",
                    "function": {"name": openai_api.required_string(item, "name", where),
                                 "arguments": openai_api.required_string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # the calls of one answer are one assistant message
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": openai_api.required_string(item, "call_id", where),
                        "content": content_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":  # (the model writes none; another model's reasoning is not shown to it)
            continue
        else:
            raise ValueError(f"{where} has type {kind!r}; this server takes 'message', 'function_call', "
                             "'function_call_output' (and skips 'reasoning') items")
    return out


def content_text(content, where: str) -> str:
    """Message content (text or a list of text parts) as text; parts are joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts, got {content!r}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise ValueError(f"{where}: content part {kind or part!r} is not supported (the model reads text: "
                             "input_text / output_text parts)")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: a {kind} part needs its text as a string, got {part!r}")
        texts.append(text)
    return "\n".join(texts)


def chat_tools(tools) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) -> chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {tools!r}")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported (type 'function'), got "
                             f"{kind or tool!r}; built-in tools (web search, file search, computer use, MCP ...) "
                             "are not")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}].name must be a non-empty string, got {tool.get('name')!r}")
        if not isinstance(tool.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].parameters must be a JSON schema object, got {tool['parameters']!r}")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    """"auto" / "none" / "required" / {"type": "function", "name": ...} -> the chat API's tool_choice."""
    if choice is None or isinstance(choice, str):
        return choice  # (the chat API names what is wrong with a string)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}, got "
                     f"{choice!r}")


def chat_response_format(text):
    """`text` ({"format": {"type": "text" | "json_object" | "json_schema", ...}}) -> the chat API's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ValueError(f"text must be {{'format': {{...}}}}, got {text!r}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"text.format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {fmt!r}")
    if kind != "json_schema":
        return {"type": kind}
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError(f"text.format json_schema needs its 'schema' (a JSON schema object), got {fmt!r}")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}


# -- chat completion -> response ----------------------------------------------------------------------
def output_items(message: dict, finish: str) -> list[dict]:
    """An assistant chat message -> output items: its text as a message item (if any, or if there is nothing
    else), each tool call as a function_call item."""
    calls = message.get("tool_calls") or []
    items = [_message_item(message.get("content") or "")] if message.get("content") or not calls else []
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if finish == "length":
        items[-1]["status"] = "incomplete"
    return items


def assistant_message(output: list[dict]) -> dict:
    """Output items -> the assistant chat message they stand for (a stored conversation's last message)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _in_progress(item: dict) -> dict:
    """An item as it is announced: in progress, no text yet."""
    out = {**item, "status": "in_progress"}
    if item["type"] == "message":
        out["content"] = []
    return out
