"""Anthropic's Messages API (POST /v1/messages) on the chat completion machinery of `openai_api`.

A request becomes a chat completion: `system` a system message first; a user message's text blocks a user message
and its `tool_result` blocks tool messages (before the text, as Anthropic orders them; a result with `is_error`
reads "Error: ..."); an assistant message's text blocks its content and its `tool_use` blocks its tool calls;
`tools` (name, description, input_schema), `tool_choice` (auto / any / tool / none, disable_parallel_tool_use),
`stop_sequences` and `output_config.format` (a JSON schema) the chat API's tools, tool choice, stop strings and
response_format (so tool formats, call parsing and grammars are the chat API's). The answer comes back as content
blocks (text, then one tool_use block per call) with stop_reason "end_turn", "tool_use", "max_tokens" or
"stop_sequence" (and the stop sequence); streamed, as Anthropic's events (message_start, content_block_start,
content_block_delta with text_delta / input_json_delta, content_block_stop, message_delta, message_stop).
`usage.input_tokens` counts the prompt tokens that were decoded, `cache_read_input_tokens` those reused from the
model's cache (the prefix shared with the request before: a conversation's earlier turns). Errors have Anthropic's
shape ({"type": "error", "error": {"type": "invalid_request_error", "message": ...}}).

Refused with a clear error: images and documents, server tools (bash, text editor, web search ... typed tools),
`container`, `mcp_servers`. Accepted without effect: `thinking` (the model writes no thinking blocks; thinking
blocks in the history are skipped), `cache_control` (the prefix cache is automatic), `metadata`, `service_tier`,
output_config's `effort`. Extensions of llama.cpp's server: `seed`, `min_p`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty`, and `sfi` (this request's SFI settings, as for chat completions); "sfi_stats" rides along.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

from . import openai_api

_EXTENSIONS = ("seed", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "sfi")
_IGNORED = ("metadata", "thinking", "service_tier", "cache_control")
_FIELDS = {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "stream",
           "temperature", "top_p", "top_k", "output_config", *_IGNORED, *_EXTENSIONS}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


class MessagesAPI:
    """The /v1/messages endpoint: request checks and the translation (it keeps no state)."""

    @staticmethod
    def parse(body: Any, model_name: str) -> dict:
        """A request body, checked (ValueError says what is wrong) -> what `create` runs."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        unknown = set(body) - _FIELDS
        if unknown:
            raise ValueError(f"unsupported field(s): {', '.join(sorted(unknown))}")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens (required) must be a positive integer, got {max_tokens!r}")
        if body.get("stream") not in (None, True, False):
            raise ValueError(f"stream must be true or false, got {body['stream']!r}")
        stop = body.get("stop_sequences")
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop_sequences must be a list of non-empty strings, got {stop!r}")
        system = body.get("system")
        system = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
        tool_choice, parallel = chat_tool_choice(body.get("tool_choice"))
        chat = {"tools": chat_tools(body.get("tools")), "tool_choice": tool_choice, "parallel_tool_calls": parallel,
                "response_format": chat_response_format(body.get("output_config")), "max_tokens": max_tokens,
                "stop": stop or None, "stream": bool(body.get("stream")), "model": model_name,
                **{k: body[k] for k in ("temperature", "top_p", "top_k", *_EXTENSIONS) if body.get(k) is not None}}
        return {"messages": system + chat_messages(body.get("messages")), "chat": chat, "model": model_name,
                "stream": chat["stream"]}

    @staticmethod
    def create(llm, request: dict):
        """The message (a dict), or its events as (name, payload) pairs when streamed."""
        chat = openai_api.create_chat_completion(llm, request["messages"], **request["chat"])
        if request["chat"]["stream"]:
            return _events(request["model"], chat, llm)
        choice = chat["choices"][0]
        stats = chat["sfi_stats"]
        message = _message(request["model"], content_blocks(choice["message"]), usage(stats))
        message.update(_stop(choice["finish_reason"], stats))
        message["sfi_stats"] = stats
        return message

    @staticmethod
    def error(status: int, message: str) -> dict:
        kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    @staticmethod
    def stream_error(exc: Exception) -> tuple[str, dict]:
        return "error", MessagesAPI.error(500, f"{type(exc).__name__}: {exc}")


def usage(sfi_stats: dict) -> dict:
    """Anthropic usage: prompt tokens decoded (input) and reused from the cache (cache read); output tokens."""
    u = openai_api.usage(sfi_stats)
    return {"input_tokens": sfi_stats["n_prompt_decoded"],
            "cache_read_input_tokens": sfi_stats["n_prompt"] - sfi_stats["n_prompt_decoded"],
            "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]}


def _message(model: str, content: list[dict], usage: dict) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": None, "stop_sequence": None, "usage": usage}


def _stop(finish: str, sfi_stats: dict) -> dict:
    """stop_reason and stop_sequence of a chat finish_reason."""
    if finish == "stop" and sfi_stats.get("stop_string") is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": sfi_stats["stop_string"]}
    return {"stop_reason": _STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _events(model: str, chunks: Iterator[dict], llm) -> Iterator[tuple[str, dict]]:
    """The chat chunks as Anthropic events: a block starts when its first piece arrives (a text block, or a
    tool_use block with its id and name), its pieces follow as deltas, and it stops when the next one starts or
    the answer ends."""
    blocks: list[str] = []  # the type of each block started
    open_block = False

    def event(kind: str, **payload) -> tuple[str, dict]:
        return kind, {"type": kind, **payload}

    def stop() -> Iterator[tuple[str, dict]]:
        nonlocal open_block
        if open_block:
            open_block = False
            yield event("content_block_stop", index=len(blocks) - 1)

    def start(block: dict) -> Iterator[tuple[str, dict]]:
        nonlocal open_block
        yield from stop()
        blocks.append(block["type"])
        open_block = True
        yield event("content_block_start", index=len(blocks) - 1, content_block=block)

    try:
        for i, chunk in enumerate(chunks):
            if i == 0:  # after the prefill (its errors are the request's HTTP status), which counted the prompt
                stats = llm.last_stats
                start_usage = {"input_tokens": stats.n_prompt_decoded,
                               "cache_read_input_tokens": stats.n_prompt - stats.n_prompt_decoded,
                               "cache_creation_input_tokens": 0, "output_tokens": 0}
                yield event("message_start", message=_message(model, [], start_usage))
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if delta.get("content"):
                if not open_block or blocks[-1] != "text":
                    yield from start({"type": "text", "text": ""})
                yield event("content_block_delta", index=len(blocks) - 1,
                            delta={"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    yield from start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                      "input": {}})
                if call["function"].get("arguments"):
                    yield event("content_block_delta", index=len(blocks) - 1,
                                delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
            if choice["finish_reason"] is None:
                continue
            yield from stop()
            stats = chunk["sfi_stats"]
            yield event("message_delta", delta=_stop(choice["finish_reason"], stats),
                        usage={"output_tokens": usage(stats)["output_tokens"]}, sfi_stats=stats)
            yield event("message_stop")
    finally:
        chunks.close()


# -- requests -> chat completion arguments ------------------------------------------------------------
def chat_messages(messages) -> list[dict]:
    """Anthropic messages -> chat messages."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages (required) must be a non-empty list of {'role': 'user' | 'assistant', "
                         "'content': ...} objects")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role must be 'user' or 'assistant' (the system prompt is the 'system' "
                             f"field), got {role!r}")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ValueError(f"{where}.content must be a string or a list of content blocks, got {content!r}")
        texts, calls = [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(openai_api.required_string(block, "text", at))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("input"), dict):
                    raise ValueError(f"{at}.input must be an object, got {block.get('input')!r}")
                calls.append({"id": openai_api.required_string(block, "id", at), "type": "function",
                              "function": {"name": openai_api.required_string(block, "name", at),
                                           "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content", ""), f"{at}.content")
                out.append({"role": "tool", "tool_call_id": openai_api.required_string(block, "tool_use_id", at),
                            "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # (this model writes none; another model's thinking is not shown to it)
            else:
                raise ValueError(f"{at}: a {kind or block!r} block is not supported in a {role} message (this server "
                                 "takes text, tool_use (assistant) and tool_result (user) blocks)")
        if texts or not blocks:
            out.append({"role": role, "content": "\n".join(texts)})
        if calls:
            if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1]["tool_calls"] = calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": calls})
    return out


def _text(content, where: str) -> str:
    """Text or a list of text blocks (system, tool_result content) as text; blocks are joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks, got {content!r}")
    texts = []
    for block in content:
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise ValueError(f"{where}: only text blocks are supported, got {block!r}")
        texts.append(block["text"])
    return "\n".join(texts)


def chat_tools(tools) -> list[dict] | None:
    """Anthropic tools ({"name", "description", "input_schema"}) -> chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {tools!r}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise ValueError(f"tools[{i}]: only client tools ({{'name', 'description', 'input_schema'}}) are "
                             f"supported, not server tools, got {tool!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}].name must be a non-empty string, got {tool.get('name')!r}")
        if not isinstance(tool.get("input_schema"), dict):
            raise ValueError(f"tools[{i}].input_schema must be a JSON schema object, got {tool.get('input_schema')!r}")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice) -> tuple[Any, bool | None]:
    """{"type": "auto" | "any" | "tool" | "none", ...} -> (the chat API's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}, "
                     f"got {choice!r}")


def chat_response_format(config) -> dict | None:
    """output_config ({"format": {"type": "json_schema", "schema": {...}}, "effort": ...}) -> response_format."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"output_config must be an object, got {config!r}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValueError(f"output_config.format must be {{'type': 'json_schema', 'schema': {{...}}}}, got {fmt!r}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def content_blocks(message: dict) -> list[dict]:
    """An assistant chat message -> content blocks: its text (if any), then a tool_use block per call."""
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # (a call the model left unfinished: max_tokens)
            arguments = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    return blocks
