"""`sfi-gguf serve`: an OpenAI-compatible HTTP server for one `SFILlama`.

Standard library only (`http.server`): a model with one sequence runs requests one at a time under a
lock; a model created with n_parallel sequences (`serve --parallel N`) decodes up to N requests
together in one batch (`sfi_gguf.slots`), each with its own SFI state. An async framework would add
dependencies without adding throughput. llama-cpp-python's own server is built around `llama_cpp.Llama` objects it creates
itself, so it cannot serve an `SFILlama`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as server-sent
events when "stream" is true). Every response carries the request's SFI statistics in "sfi_stats".
"""
from __future__ import annotations

import contextlib
import inspect
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import openai_api

# request fields that only exist for Python callers of llama-cpp-python
_PYTHON_ONLY = {"stopping_criteria", "logits_processor"}
# OpenAI request fields we accept without a llama-cpp-python argument of the same name
_EXTRA = {"n", "user", "stream_options", "max_completion_tokens"}


def _accepted(fn) -> set[str]:
    return {p for p in inspect.signature(fn).parameters if p != "llm"} - _PYTHON_ONLY - {"messages", "prompt"}


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


class SFIServer(ThreadingHTTPServer):
    """Serves one model: requests take turns (`lock`), or share its parallel slots (`slots`)."""

    daemon_threads = True

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None):
        self.llm = llm
        self.model_name = model_name or llm.model_path.stem
        self.lock = threading.Lock()
        self.slots = None
        if llm.context.n_seq_max > 1:
            from .slots import SlotScheduler

            self.slots = SlotScheduler(llm)
        self.created = int(time.time())
        super().__init__((host, port), _Handler)

    def server_close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        super().server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def _kwargs(body: dict[str, Any], fn, main: str, model_name: str) -> dict[str, Any]:
    """Request JSON -> arguments of openai_api.create_(chat_)completion; unknown fields are refused."""
    if main not in body:
        raise RequestError(f"'{main}' is required")
    unknown = set(body) - _accepted(fn) - _EXTRA - {main}
    if unknown:
        raise RequestError(f"unsupported field(s): {', '.join(sorted(unknown))}")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported")
    kwargs = {k: v for k, v in body.items() if k not in _EXTRA}
    if "max_completion_tokens" in body:
        kwargs["max_tokens"] = body["max_completion_tokens"]
    kwargs["model"] = model_name  # the served model answers whatever name the client used
    return kwargs


class _Handler(BaseHTTPRequestHandler):
    server: SFIServer
    protocol_version = "HTTP/1.0"  # one request per connection: an SSE stream ends when the socket closes

    def log_message(self, fmt, *args):  # quiet unless asked for: one line per request on stderr
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)

    # -- routing ----------------------------------------------------------------------------------
    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": self.server.created,
                 "owned_by": "sfi-gguf"}]})
        elif self.path.rstrip("/") in ("", "/health"):
            self._json(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self):
        routes = {"/v1/completions": (openai_api.create_completion, "prompt"),
                  "/v1/chat/completions": (openai_api.create_chat_completion, "messages")}
        route = routes.get(self.path.rstrip("/"))
        if route is None:
            return self._error(404, f"no route {self.path}")
        fn, main = route
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            kwargs = _kwargs(body, fn, main, self.server.model_name)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        except (ValueError, RequestError) as exc:
            return self._error(400, str(exc))
        slots = self.server.slots
        with self.server.lock if slots is None else contextlib.nullcontext():
            try:
                result = fn(self.server.llm if slots is None else slots.client(), kwargs.pop(main), **kwargs)
            except (ValueError, TypeError, NotImplementedError) as exc:
                return self._error(400, str(exc))
            except Exception as exc:  # noqa: BLE001  (the server keeps serving)
                return self._error(500, f"{type(exc).__name__}: {exc}")
            if kwargs.get("stream"):
                self._stream(result, include_usage)
            else:
                self._json(200, result)

    # -- responses --------------------------------------------------------------------------------
    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

    def _stream(self, chunks, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        last = None
        try:
            for chunk in chunks:
                self._event(chunk)
                last = chunk
            if include_usage and last is not None:
                self._event({**{k: last[k] for k in ("id", "object", "created", "model")}, "choices": [],
                             "usage": openai_api.usage(last["sfi_stats"])})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: stop generating
        except Exception as exc:  # noqa: BLE001  (headers are sent: report in the stream)
            self._event({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}})
        finally:
            close = getattr(chunks, "close", None)
            if close:
                close()

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def serve(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          verbose: bool = False) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = SFIServer(llm, host, port, model_name)
    server.verbose = verbose
    slots = f", {server.slots.n_slots} parallel slots" if server.slots else ""
    print(f"sfi-gguf serve: {server.url} (model '{server.model_name}'{slots}); Ctrl-C stops", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
