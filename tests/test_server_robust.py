"""`sfi-gguf serve` under bad and impolite clients, on loopback only, every wait bounded.

Malformed, truncated, oversized, chunked, wrong-typed and wrong-method requests each get their 4xx
answer in the OpenAI error shape; a client that disconnects ends its generation at the next token
(one model: the next request is served; parallel slots: the slot is free); and a soak of requests
from several threads, some of them giving up half-way, leaves every other request answered as it is
answered alone, the server healthy and its memory flat. A random-weight model keeps it fast.
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.serve.server import SFIServer

BODY_TIMEOUT = 1.0
MAX_BODY = 64 * 1024
WAIT = 30  # seconds any single answer may take here


class Running:
    """An SFIServer on a free loopback port, served from a thread."""

    def __init__(self, llm):
        self.llm = llm
        self.server = SFIServer(llm, "127.0.0.1", 0, model_name="tiny", body_timeout=BODY_TIMEOUT,
                                max_body_bytes=MAX_BODY)
        self.host, self.port = self.server.socket.getsockname()[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(WAIT)
        self.llm.close()

    # -- clients ------------------------------------------------------------------------------
    def raw(self, data: bytes) -> tuple[int, dict, bytes]:
        """Send bytes as they are, keep the connection open; the status, headers and body of the answer
        (a socket timeout fails the test)."""
        with socket.create_connection((self.host, self.port), timeout=WAIT) as s:
            s.sendall(data)
            return _read_response(s)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=WAIT)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if resp.getheader("content-type", "").startswith(
                "application/json") else raw.decode())
        finally:
            conn.close()


def _read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    if "content-length" in headers:
        while len(body) < int(headers["content-length"]):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    else:
        while chunk := s.recv(65536):
            body += chunk
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunked(body)
    return status, headers, body


def _unchunked(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def _request(method: str, path: str, body: bytes = b"", headers: dict | None = None, length: bool = True) -> bytes:
    h = {"Host": "127.0.0.1", "Connection": "close", "Content-Type": "application/json", **(headers or {})}
    if length and "Transfer-Encoding" not in h and "Content-Length" not in h:
        h["Content-Length"] = str(len(body))
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + body


def _chunked(body: bytes, size: int = 7) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _openai_error(status: int, body: bytes, expected: int, match: str = "") -> str:
    assert status == expected, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert match.lower() in error["message"].lower(), error["message"]
    return error["message"]


PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 200, 40)]


@pytest.fixture(scope="module")
def one(tiny_path):
    """One sequence: requests take turns."""
    running = Running(SFILlama(str(tiny_path), n_ctx=8192, n_threads=1))
    yield running
    running.close()


# -- bad requests ----------------------------------------------------------------------------------

GOOD = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("body,match", [
    (b'{"prompt": ', "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "'prompt' is required"),
    (b"\xff\xfe{}", "not valid JSON"), (b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature must be a finite number"),
    (json.dumps({**GOOD, "top_k": 2.5}).encode(), "top_k must be an integer"),
    (json.dumps({**GOOD, "seed": 1.5}).encode(), "seed must be None or an integer"),
    (json.dumps({**GOOD, "stream_options": 5}).encode(), "stream_options must be an object"),
    (json.dumps({**GOOD, "stream": True, "stop": [1, 2]}).encode(), "stop must be"),
    (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream must be true or false"),
    (json.dumps({**GOOD, "max_tokens": "5"}).encode(), "max_tokens must be"),
    (json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature must be"),
    (json.dumps({**GOOD, "prompt": 5}).encode(), "prompt must be"),
    (json.dumps({**GOOD, "prompt": [[1, 2], "a", 3]}).encode(), "prompt must be"),
    (json.dumps({**GOOD, "n": 0}).encode(), "n (the number of choices) must be an integer from 1 to 16"),
    (json.dumps({**GOOD, "n": 2.0}).encode(), "n (the number of choices)"),
    (json.dumps({**GOOD, "best_of": 3}).encode(), "best_of=1"),
    (json.dumps({**GOOD, "logprobs": -1}).encode(), "logprobs"),
    (json.dumps({**GOOD, "prompt": [5] * 9000}).encode(), "n_ctx"),
    (json.dumps({**GOOD, "bogus": 1}).encode(), "unsupported field(s): bogus"),
    (json.dumps({**GOOD, "sfi": {"k_head": "x"}}).encode(), "SFIConfig.k_head"),
    (json.dumps({**GOOD, "grammar": "root ::= undefined-rule"}).encode(), "grammar"),
    (json.dumps({**GOOD, "grammar": 5}).encode(), "grammar must be"),
    (json.dumps({**GOOD, "logit_bias": {"a": 1}}).encode(), "logit_bias must be"),
    (json.dumps({**GOOD, "mirostat_mode": 7}).encode(), "mirostat_mode must be"),
    (json.dumps({**GOOD, "typical_p": 2}).encode(), "typical_p must be"),
    (json.dumps({**GOOD, "stop": ["", "\n"]}).encode(), "stop strings must not be empty"),
    (b'{"prompt": "hi \\ud800", "max_tokens": 1}', "lone surrogate '\\ud800'"),
    pytest.param(b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested too deeply", id="deeply-nested"),
])
def test_bad_completion_bodies_are_400(one, body, match):
    status, _, raw = one.raw(_request("POST", "/v1/completions", body))
    _openai_error(status, raw, 400, match)


@pytest.mark.parametrize("body,match", [
    ({"messages": "hi"}, "messages must be"), ({"messages": []}, "messages must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs must be true or false"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no chat template"),  # (this model has none)
    ({"prompt": "hi"}, "'messages' is required"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not in tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "grammar": 'root ::= "a"',
      "response_format": {"type": "json_object"}}, "both constrain"),
    # as the OpenAI API answers them
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role must be one of system, developer, user"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": None, "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string or an array"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content must be"),
])
def test_bad_chat_bodies_are_400(one, body, match):
    status, _, raw = one.raw(_request("POST", "/v1/chat/completions", json.dumps(body).encode()))
    _openai_error(status, raw, 400, match)


def test_penalties(one):
    for penalty in ({"repeat_penalty": 1.3}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                    {"logit_bias": {"5": 3.0}}, {"typical_p": 0.5, "temperature": 0.8, "seed": 1},
                    {"mirostat_mode": 2, "temperature": 0.8, "seed": 1}):
        status, reply = one.post("/v1/completions", {**GOOD, **penalty})
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply


def test_null_fields_take_their_defaults(one):
    alone = one.post("/v1/completions", GOOD)[1]
    status, reply = one.post("/v1/completions", {**GOOD, "top_p": None, "seed": None, "stop": None, "user": None,
                                                 "stream_options": None})
    assert status == 200 and reply["choices"][0]["text"] == alone["choices"][0]["text"]
    status, _, raw = one.raw(_request("POST", "/v1/completions", json.dumps({**GOOD, "prompt": None}).encode()))
    _openai_error(status, raw, 400, "'prompt' is required")


def test_chunked_bodies_and_query_strings_work(one):
    alone = one.post("/v1/completions", GOOD)[1]["choices"][0]["text"]
    status, _, raw = one.raw(_request("POST", "/v1/completions?api-version=1", _chunked(json.dumps(GOOD).encode()),
                                      {"Transfer-Encoding": "chunked"}))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == alone
    status, _, raw = one.raw(_request("POST", "/v1/completions", _chunked(b'{"prompt": [1, 2'),
                                      {"Transfer-Encoding": "chunked"}))
    _openai_error(status, raw, 400, "not valid JSON")
    status, _, raw = one.raw(_request("GET", "/v1/models?limit=5"))
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "tiny"


def test_oversized_bodies_are_413(one):
    big = json.dumps({**GOOD, "prompt": "x" * (MAX_BODY + 10)}).encode()
    status, _, raw = one.raw(_request("POST", "/v1/completions", big))
    _openai_error(status, raw, 413, "at most")
    status, _, raw = one.raw(_request("POST", "/v1/completions", _chunked(big, 4096), {"Transfer-Encoding": "chunked"}))
    _openai_error(status, raw, 413, "larger than")
    # a Content-Length alone is enough to refuse, before any of the body is sent
    status, _, raw = one.raw(_request("POST", "/v1/completions", headers={"Content-Length": str(10**12)}))
    _openai_error(status, raw, 413, "at most")
    # a client that sends a large body whole before it reads (and asks to close the connection after the answer)
    # reads the 413, not a reset, however the body is framed
    huge = json.dumps({**GOOD, "prompt": "x" * 40_000_000}).encode()
    status, _, raw = one.raw(_request("POST", "/v1/completions", huge))
    _openai_error(status, raw, 413, "at most")
    status, _, raw = one.raw(_request("POST", "/v1/completions", _chunked(huge, 2**20), {"Transfer-Encoding": "chunked"}))
    _openai_error(status, raw, 413, "larger than")


def test_truncated_bodies_time_out_with_408(one):
    """A body shorter than its Content-Length (the client says no more, nor closes): 408 once the
    body timeout passes, not a thread waiting forever."""
    status, _, raw = one.raw(_request("POST", "/v1/completions", b'{"prompt": "hi"', {"Content-Length": "100"}))
    _openai_error(status, raw, 408, "did not arrive")
    status, _, raw = one.raw(_request("POST", "/v1/completions", _chunked(b'{"prompt"')[:-5],
                                      {"Transfer-Encoding": "chunked"}))
    _openai_error(status, raw, 408, "did not arrive")


@pytest.mark.parametrize("length", ["-1", "abc", "1, 2"])
def test_invalid_content_lengths_are_400(one, length):
    """Not HTTP: uvicorn answers 400 (plain text) and closes."""
    status, headers, _ = one.raw(_request("POST", "/v1/completions", b"{}", {"Content-Length": length}))
    assert status == 400 and headers.get("connection") == "close"


def test_garbage_is_400(one):
    status, _, _ = one.raw(b"hello there\r\n\r\n")
    assert status == 400


@pytest.mark.parametrize("method,path,expected", [
    ("PUT", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v1/chat/completions", 405),
    ("PATCH", "/health", 405), ("POST", "/v1/models", 405), ("GET", "/v2/nothing", 404),
    ("POST", "/v1/embeddings", 404),
])
def test_wrong_methods_and_routes(one, method, path, expected):
    status, headers, raw = one.raw(_request(method, path, b"{}"))
    _openai_error(status, raw, expected, path)
    if expected == 405:
        assert headers.get("allow")


def test_prompt_lists_as_langchain_sends_them(one):
    """OpenAI's completions take a list of prompts (LangChain's OpenAI sends one): one choice each."""
    other = [int(t) for t in np.random.default_rng(1).integers(3, 200, 30)]
    alone = [one.post("/v1/completions", {**GOOD, "prompt": p})[1] for p in (PROMPT, other)]
    status, both = one.post("/v1/completions", {**GOOD, "prompt": [PROMPT, other]})
    assert status == 200 and [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert both["usage"]["total_tokens"] == sum(a["usage"]["total_tokens"] for a in alone)
    status, single = one.post("/v1/completions", {**GOOD, "prompt": [one.llm.detokenize(PROMPT)]})
    assert status == 200 and len(single["choices"]) == 1
    status, streamed = one.post("/v1/completions", {**GOOD, "prompt": [PROMPT, other], "stream": True,
                                                    "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert texts == [c["text"] for c in both["choices"]] and streamed.rstrip().endswith("data: [DONE]")
    assert events[-1]["usage"] == both["usage"]


def test_an_error_in_a_stream_ends_with_done(one, monkeypatch):
    """An error after the status line is sent: an error event, then [DONE] (clients stop reading)."""
    real = one.llm.context.decode_one
    calls = []

    def fail_third(token):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("injected")
        real(token)

    monkeypatch.setattr(one.llm.context, "decode_one", fail_third)
    status, text = one.post("/v1/completions", {**GOOD, "max_tokens": 8, "stream": True})
    monkeypatch.undo()
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and "injected" in events[-2] and events[-1] == "data: [DONE]"
    assert one.post("/v1/completions", GOOD)[0] == 200  # and the server goes on


# -- clients that go away --------------------------------------------------------------------------

def _wait_until(condition, what: str, seconds: float = WAIT):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _long(stream: bool) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": 8000, "temperature": 0, "stream": stream,
                       "sfi": False}).encode()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_disconnects_stops_its_generation(one, stream):
    """8000 tokens asked for; the client leaves after a few. The generation ends at its next token (its
    stats say so), and the next request, which waited for the model, is answered."""
    before = one.llm.last_stats
    s = socket.create_connection((one.host, one.port), timeout=WAIT)
    s.sendall(_request("POST", "/v1/completions", _long(stream)))
    _wait_until(lambda: one.llm.last_stats is not before and one.llm.last_stats.n_generated > 20, "the generation")
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    stats = one.llm.last_stats
    s.close()
    status, reply = one.post("/v1/completions", GOOD)  # waits for the model to be free
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
    assert stats.finish_reason == "stop" and not stats.ended_on_eog and stats.n_generated < 2000


@pytest.fixture(scope="module")
def slots(tiny_path):
    running = Running(SFILlama(str(tiny_path), n_ctx=8192, n_parallel=4, n_threads=1))
    yield running
    running.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_disconnects_frees_its_slot(slots, stream):
    decoder = slots.server.slots.decoder
    steps = lambda: sum(decoder.n_decode.values())  # noqa: E731  (sequence-steps decoded so far)
    s = socket.create_connection((slots.host, slots.port), timeout=WAIT)
    start = steps()
    s.sendall(_request("POST", "/v1/completions", _long(stream)))
    _wait_until(lambda: steps() > start + 20, "the generation")
    s.close()
    _wait_until(lambda: slots.server.slots.n_active == 0, "the slot to be freed")
    assert steps() - start < 2000  # of 8000
    status, reply = slots.post("/v1/completions", GOOD)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4


# -- soak ------------------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_soak_with_random_disconnects(slots):
    """64 requests from 8 threads on 4 slots, streamed or not, SFI or dense, a third of them abandoned
    (closed before the answer, or after a few events): every other one gets the answer the same request
    gets alone, and afterwards the server is healthy, its slots are free and its memory did not grow."""
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 200, n)] for n in rng.integers(20, 120, 8)]
    # (one bootstrap row: a request served from its slot's cache re-decodes only its last token, as a dense
    # one does, so it rounds as the first one did)
    sfi = {"k_head": 16, "n_recent": 16, "n_sink": 4, "min_context": 0, "policy": "fixed", "fixed_period": 4,
           "n_prefill_queries": 1}
    bodies = [{"prompt": p, "max_tokens": int(n), "temperature": 0, "sfi": sfi if k % 2 else False}
              for k, (p, n) in enumerate(zip(prompts, rng.integers(4, 24, 8)))]
    expected = [slots.post("/v1/completions", b)[1]["choices"][0]["text"] for b in bodies]
    wrong, done = [], []

    def client(worker: int, n_requests: int):
        r = random.Random(worker)
        for _ in range(n_requests):
            i = r.randrange(len(bodies))
            stream, leave = r.random() < 0.5, r.random() < 1 / 3
            body = json.dumps({**bodies[i], "stream": stream}).encode()
            s = socket.create_connection((slots.host, slots.port), timeout=WAIT)
            try:
                s.sendall(_request("POST", "/v1/completions", body))
                if leave:
                    if stream and r.random() < 0.5:
                        s.recv(r.randrange(1, 600))
                    continue
                status, _, raw = _read_response(s)
                text = raw.decode()
                got = ("".join(json.loads(line[6:])["choices"][0]["text"] for line in text.splitlines()
                               if line.startswith("data: {") and '"choices": []' not in line)
                       if stream else json.loads(raw)["choices"][0]["text"])
                if status != 200 or got != expected[i] or (stream and not text.rstrip().endswith("[DONE]")):
                    wrong.append((i, stream, status, got, expected[i]))
                done.append(i)
            finally:
                s.close()

    def run(rounds: int):
        threads = [threading.Thread(target=client, args=(w, rounds)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)

    run(2)  # warm-up: 16 requests
    rss = _rss()
    run(6)  # 48 more
    assert wrong == [] and len(done) > 20
    _wait_until(lambda: slots.server.slots.n_active == 0, "every slot to be free")
    assert slots.raw(_request("GET", "/health"))[0] == 200
    assert slots.post("/v1/completions", bodies[0])[1]["choices"][0]["text"] == expected[0]
    assert _rss() - rss < 64 * 2**20
