"""`sfi-gguf serve`: an OpenAI-compatible HTTP server for one `SFILlama` (uvicorn + starlette).

A model with one sequence runs requests one at a time (an async lock, so waiting requests hold no
thread); a model created with n_parallel sequences (`serve --parallel N`) decodes up to N requests
together in one batch (`sfi_gguf.serve.slots`), each with its own SFI state. Generation runs in worker
threads; the event loop only reads requests, watches for clients that go away and writes responses.
uvicorn parses HTTP (chunked bodies, framing errors, disconnect events), which `http.server` would
leave to hand-written code; llama-cpp-python's own server uses the same stack, but it is built around
`llama_cpp.Llama` objects it creates itself, so it cannot serve an `SFILlama`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as server-sent
events when "stream" is true), GET /health; POST /v1/responses (OpenAI's Responses API, `responses_api`;
GET / DELETE /v1/responses/{id} for a stored response) and POST /v1/messages (Anthropic's Messages API,
`messages_api`), both translated to and from the chat completion machinery. Every response carries the
request's SFI statistics in "sfi_stats". Every error is a JSON body of the OpenAI shape ({"error":
{"message", "type", ...}}; Anthropic's shape on /v1/messages), except for bytes that are not HTTP at all,
which uvicorn answers with a plain 400 and a closed connection. A request body must arrive within
`body_timeout` seconds of silence and hold at most `max_body_bytes`; a client that disconnects ends its
generation before the next token. A request asks for at most `max_n` choices ("n"; they decode one after
the other, see `openai_api`).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import socket
import sys
import threading
import time
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import messages_api, openai_api, responses_api
from ..core.sampling import is_int

# request fields that only exist for Python callers of llama-cpp-python
_PYTHON_ONLY = {"stopping_criteria", "logits_processor"}
# OpenAI request fields we accept without a llama-cpp-python argument of the same name
_EXTRA = {"best_of", "user", "stream_options", "max_completion_tokens"}

MAX_BODY_BYTES = 16 * 2**20  # a 128K-token prompt is well under 1 MiB of text or token ids
BODY_TIMEOUT_S = 30.0        # silence allowed while a request body arrives
MAX_N = 16                   # choices of one request: they decode one after the other, each max_tokens long
DRAIN_MAX_BYTES = 256 * 2**20  # of an oversized body, read and dropped before its 413 (see `_drain`)
DRAIN_SILENCE_S = 1.0          # ... until the client sends nothing for this long
# a chat message's roles in the OpenAI API
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _accepted(fn) -> set[str]:
    return {p for p in inspect.signature(fn).parameters if p != "llm"} - _PYTHON_ONLY - {"messages", "prompt"}


class RequestError(ValueError):
    """A request the server refuses, with its HTTP status (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class _ClientGone(Exception):
    """The client disconnected before its request was read."""


class SFIServer:
    """Serves one model on a socket bound at construction (port 0 picks a free one, see `url`).

    `serve_forever()` runs uvicorn until `shutdown()` (from another thread) or Ctrl-C;
    `server_close()` stops the parallel slots and closes the socket (the model stays open).
    """

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 verbose: bool = False, body_timeout: float = BODY_TIMEOUT_S, max_body_bytes: int = MAX_BODY_BYTES,
                 max_n: int = MAX_N):
        self.llm = llm
        self.model_name = model_name or llm.model_path.stem
        self.verbose = verbose
        self.body_timeout = body_timeout
        self.max_body_bytes = max_body_bytes
        self.max_n = max_n
        self.created = int(time.time())
        self.slots = None
        if llm.context.n_seq_max > 1:
            from .slots import SlotScheduler

            self.slots = SlotScheduler(llm)
        self._turn_lock: anyio.Lock | None = None  # created in the server's event loop
        self.responses = responses_api.ResponsesAPI()  # holds the stored responses (previous_response_id)
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.app = self._app()
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, lifespan="off", log_config=uvicorn.config.LOGGING_CONFIG if verbose else None,
            log_level="info" if verbose else "warning", access_log=verbose, timeout_graceful_shutdown=5))
        self._stopped = threading.Event()
        self._cancels: set[threading.Event] = set()  # one per request in progress

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    def serve_forever(self) -> None:
        self._stopped.clear()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever (running in another thread) and wait for it; generations in progress end
        at their next token."""
        for cancel in list(self._cancels):
            cancel.set()
        self._uvicorn.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        self.socket.close()

    # -- the application --------------------------------------------------------------------------
    def _app(self) -> Starlette:
        generate = lambda fn, main: _Generate(self, fn, main)  # noqa: E731
        routes = [Route("/v1/models", self._models, methods=["GET"]),
                  Route("/health", self._health, methods=["GET"]), Route("/", self._health, methods=["GET"]),
                  Route("/v1/completions", generate(openai_api.create_completion, "prompt"), methods=["POST"]),
                  Route("/v1/chat/completions", generate(openai_api.create_chat_completion, "messages"),
                        methods=["POST"]),
                  Route("/v1/responses", _Translated(self, self.responses), methods=["POST"]),
                  Route("/v1/responses/{response_id}", self._stored_response, methods=["GET", "DELETE"]),
                  Route("/v1/messages", _Translated(self, messages_api.MessagesAPI()), methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "sfi-gguf"}]})

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def _stored_response(self, request: Request) -> JSONResponse:
        """GET (read back) or DELETE a stored response of /v1/responses."""
        response_id = request.path_params["response_id"]
        found = (self.responses.delete if request.method == "DELETE" else self.responses.get)(response_id)
        if found is None:
            return _error(404, f"no stored response with id {response_id!r}")
        return JSONResponse(found)

    @contextlib.asynccontextmanager
    async def turn(self):
        """A model with one sequence serves one request at a time; parallel slots queue requests themselves."""
        if self.slots is not None:
            yield
            return
        if self._turn_lock is None:
            self._turn_lock = anyio.Lock()
        async with self._turn_lock:
            yield

    def model_for(self, cancel: threading.Event):
        """What openai_api drives for one request: generation ends once `cancel` is set."""
        return self.slots.client(cancel) if self.slots is not None else _Turn(self.llm, cancel)


class _Turn:
    """The model for one request of the one-at-a-time server: generate() stops when the client has gone."""

    def __init__(self, llm, cancel: threading.Event):
        self.llm, self.cancel = llm, cancel

    def __getattr__(self, name):  # prompt_tokens, n_ctx, last_stats ...
        return getattr(self.llm, name)

    def generate(self, *args, **kwargs):
        return self.llm.generate(*args, cancel=self.cancel, **kwargs)


class _Generate:
    """POST /v1/completions and /v1/chat/completions, as an ASGI app: reading the body, generating and
    answering (streamed or not) all watch the connection."""

    def __init__(self, server: SFIServer, fn, main: str):
        self.server, self.fn, self.main = server, fn, main

    async def __call__(self, scope, receive, send) -> None:
        srv = self.server
        try:
            body = await _read_body(scope, receive, srv.max_body_bytes, srv.body_timeout)
            kwargs, include_usage = self._request(_json(body))
        except RequestError as exc:
            return await self._error(exc.status, str(exc))(scope, receive, send)
        except _ClientGone:
            return
        cancel = threading.Event()
        srv._cancels.add(cancel)
        async with anyio.create_task_group() as watch:
            watch.start_soon(_watch_disconnect, receive, cancel)
            try:
                async with srv.turn():
                    if not cancel.is_set():  # (the client may have left while the request waited)
                        await self._answer(scope, send, kwargs, include_usage, cancel)
            finally:
                watch.cancel_scope.cancel()
                srv._cancels.discard(cancel)

    def _request(self, body: Any) -> tuple[dict, Any]:
        """The request's arguments for `_run`, and what `_stream` needs besides (refusals: RequestError)."""
        return _kwargs(body, self.fn, self.main, self.server.model_name, self.server.max_n)

    def _run(self, model, kwargs: dict):
        return self.fn(model, kwargs.pop(self.main), **kwargs)

    def _error(self, status: int, message: str) -> JSONResponse:
        return _error(status, message)

    async def _stream(self, send, result, first, kwargs: dict, include_usage) -> None:
        await _send_events(send, result, first, include_usage, kwargs.get("n", 1))

    async def _answer(self, scope, send, kwargs: dict, include_usage, cancel: threading.Event) -> None:
        model = self.server.model_for(cancel)
        stream = kwargs.get("stream")
        try:
            result = await anyio.to_thread.run_sync(lambda: self._run(model, kwargs))
            # a stream's first chunk holds the prefill: its errors are still an HTTP status
            first = await anyio.to_thread.run_sync(next, result, None) if stream else None
        except (ValueError, TypeError, NotImplementedError) as exc:
            return await self._error(400, str(exc))(scope, None, send)
        except Exception as exc:  # noqa: BLE001  (the server keeps serving)
            return await self._error(500, f"{type(exc).__name__}: {exc}")(scope, None, send)
        if not stream:
            return await JSONResponse(result)(scope, None, send)
        await self._stream(send, result, first, kwargs, include_usage)


class _Translated(_Generate):
    """POST /v1/responses and /v1/messages: another API's requests, answered by the chat completion machinery
    through `api` (`responses_api.ResponsesAPI`, `messages_api.MessagesAPI`): its request checks, its response
    and error shapes, its named server-sent events."""

    def __init__(self, server: SFIServer, api):
        super().__init__(server, None, "")
        self.api = api

    def _request(self, body: Any) -> tuple[dict, None]:
        try:
            return self.api.parse(body, self.server.model_name), None
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc)) from None

    def _run(self, model, kwargs: dict):
        return self.api.create(model, kwargs)

    def _error(self, status: int, message: str) -> JSONResponse:
        return JSONResponse(self.api.error(status, message), status)

    async def _stream(self, send, result, first, kwargs: dict, _) -> None:
        await _send_named_events(send, result, first, self.api.stream_error)


async def _read_body(scope, receive, limit: int, timeout: float) -> bytes:
    """The request body, refused when larger than `limit` (413) or silent for `timeout` seconds (408)."""
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is not None and int(length) > limit:  # (h11 has refused a Content-Length that is not a number)
        await _drain(headers, receive, min(timeout, DRAIN_SILENCE_S))
        raise RequestError(f"the request body has {int(length)} bytes, the server accepts at most {limit}", 413)
    chunks, size = [], 0
    while True:
        with anyio.move_on_after(timeout) as waited:
            message = await receive()
        if waited.cancelled_caught:
            raise RequestError(f"the request body did not arrive (nothing for {timeout:g} s)", 408)
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            if message.get("more_body"):
                await _drain(headers, receive, min(timeout, DRAIN_SILENCE_S))
            raise RequestError(f"the request body is larger than {limit} bytes", 413)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _drain(headers: dict, receive, silence: float) -> None:
    """Read and drop the rest of an oversized body (at most DRAIN_MAX_BYTES, until `silence` seconds without any)
    before the 413 is sent: a client reads no answer while it is still sending, and a connection closed with bytes
    unread (uvicorn closes it after the answer to a "Connection: close" request) is reset, so it would see a reset,
    not the 413. A client waiting for "100 Continue" sends no body: answered at once (a read would invite it)."""
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return
    dropped = 0
    while dropped <= DRAIN_MAX_BYTES:
        with anyio.move_on_after(silence) as waited:
            message = await receive()
        if waited.cancelled_caught or message["type"] == "http.disconnect":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body"):
            return


def _json(body: bytes) -> Any:
    def no_constant(name):
        raise ValueError(f"{name} is not a JSON value")

    try:
        return json.loads(body or b"{}", parse_constant=no_constant)
    except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit
        raise RequestError("the request body is nested too deeply to be read as JSON") from None


def _kwargs(body: Any, fn, main: str, model_name: str, max_n: int = MAX_N) -> tuple[dict[str, Any], bool]:
    """Request JSON -> (arguments of openai_api.create_(chat_)completion, include_usage); refuses what
    it does not understand, before anything is generated."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get(main) is None:
        raise RequestError(f"'{main}' is required")
    unknown = set(body) - _accepted(fn) - _EXTRA - {main}
    if unknown:
        raise RequestError(f"unsupported field(s): {', '.join(sorted(unknown))}")
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= max_n):
        raise RequestError(f"n (the number of choices) must be an integer from 1 to {max_n}, got {n!r}")
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != (n or 1)):  # best_of = n: every sample returned
        raise RequestError(f"only best_of=1 (or best_of equal to n) is supported, got {best_of!r}")
    if body.get("stream") not in (None, True, False):
        raise RequestError(f"stream must be true or false, got {body['stream']!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {options!r}")
    include_usage = (options or {}).get("include_usage")
    if include_usage not in (None, True, False):
        raise RequestError(f"stream_options.include_usage must be true or false, got {include_usage!r}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {body['user']!r}")
    if main == "messages":
        _check_messages(body["messages"])
    kwargs = {k: v for k, v in body.items() if k not in _EXTRA and v is not None}  # null: the default
    if body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"] = body["max_completion_tokens"]
    kwargs["stream"] = bool(body.get("stream"))
    kwargs["model"] = model_name  # the served model answers whatever name the client used
    return kwargs, bool(include_usage)


def _check_messages(messages: Any) -> None:
    """Each chat message's role and content type, as the OpenAI API checks them (the Python API passes any role and
    content to the chat template, as llama-cpp-python does)."""
    if not isinstance(messages, list):
        return  # (create_chat_completion refuses it by name)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if not (content is None or isinstance(content, str)
                or isinstance(content, list) and all(isinstance(p, dict) for p in content)):
            raise RequestError(f"messages[{i}].content must be a string or an array of content parts, got "
                               f"{content!r:.80}")


async def _watch_disconnect(receive, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (the body was read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def _send_events(send, chunks, first, include_usage: bool, n: int) -> None:
    """The chunks as server-sent events, then the usage chunk (if asked for; `n` choices per prompt) and [DONE].
    An error after the first chunk is reported as an error event (the status line is sent)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    event = lambda payload: send({"type": "http.response.body", "more_body": True,  # noqa: E731
                                  "body": b"data: " + json.dumps(payload).encode() + b"\n\n"})
    totals = None
    try:
        chunk, last = first, None
        while chunk is not None:
            await event(chunk)
            last = chunk
            if "sfi_stats" in chunk:  # the last chunk of a choice: count its usage
                index = chunk["choices"][0]["index"]
                totals = openai_api.add_usage(totals, openai_api.choice_usage(chunk["sfi_stats"], index, n))
            chunk = await anyio.to_thread.run_sync(next, chunks, None)
        if include_usage and last is not None and totals is not None:
            await event({**{k: last[k] for k in ("id", "object", "created", "model")}, "choices": [],
                         "usage": totals})
    except Exception as exc:  # noqa: BLE001  (the status line is sent: report in the stream)
        kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
        await event({"error": {"message": f"{type(exc).__name__}: {exc}", "type": kind, "param": None,
                               "code": None}})
    finally:
        with anyio.CancelScope(shield=True):  # the generation ends (and frees the model) however we leave
            await anyio.to_thread.run_sync(chunks.close)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _send_named_events(send, events, first, stream_error) -> None:
    """(name, payload) events as server-sent events with an `event:` line (the Responses and Messages APIs; no
    [DONE]). An error after the first event is reported as the API's error event, `stream_error(exc)`."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    event = lambda item: send({"type": "http.response.body", "more_body": True,  # noqa: E731
                               "body": f"event: {item[0]}\ndata: {json.dumps(item[1])}\n\n".encode()})
    try:
        item = first
        while item is not None:
            await event(item)
            item = await anyio.to_thread.run_sync(next, events, None)
    except Exception as exc:  # noqa: BLE001  (the status line is sent: report in the stream)
        await event(stream_error(exc))
    finally:
        with anyio.CancelScope(shield=True):  # the generation ends (and frees the model) however we leave
            await anyio.to_thread.run_sync(events.close)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status,
                        headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """starlette's routing errors (404, 405) in the OpenAI shape."""
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {exc.headers.get('Allow')})"
    else:
        message = str(exc.detail)
    return _error(exc.status_code, message, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(500, f"{type(exc).__name__}: {exc}")


def serve(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          verbose: bool = False) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = SFIServer(llm, host, port, model_name, verbose=verbose)
    slots = f", {server.slots.n_slots} parallel slots" if server.slots else ""
    print(f"sfi-gguf serve: {server.url} (model '{server.model_name}'{slots}); Ctrl-C stops", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
