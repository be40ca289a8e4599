"""Parallel server slots: concurrent requests decode together in one `BatchedDecoder`.

One thread owns the model and loops: admit waiting requests into free slots (prefill), run one batched
step for every active slot, repeat; it sleeps while nothing is active. A request thread (an HTTP
handler) talks to it through a `SlotClient`, which looks like an `SFILlama` to `openai_api` (same
`generate`, `prompt_tokens`, `last_stats` ...), so the OpenAI-compatible shaping is shared with the
one-request-at-a-time server.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

_DONE = object()  # end of a request's piece stream


class SlotScheduler:
    """The decoding thread of a model created with n_parallel sequences."""

    def __init__(self, llm):
        if llm.context.n_seq_max < 2:
            raise ValueError("parallel slots need an SFILlama created with n_parallel >= 2")
        self.llm = llm
        self.decoder = llm.batched_decoder()
        self._waiting: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sfi-slots", daemon=True)
        self._thread.start()

    @property
    def n_slots(self) -> int:
        return len(self.decoder.slots)

    def client(self) -> "SlotClient":
        return SlotClient(self)

    def submit(self, request) -> queue.Queue:
        """Queue a `batched.Request`; its text pieces, then `_DONE` (or an exception), arrive on the returned queue."""
        pieces: queue.Queue = queue.Queue()
        request.on_piece = pieces.put
        self._waiting.put((request, pieces))
        return pieces

    def close(self) -> None:
        self._stop.set()
        self._waiting.put(None)
        self._thread.join(timeout=30)

    # -- the decoding thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        live: dict[int, queue.Queue] = {}  # id(request) -> its piece queue
        while not self._stop.is_set():
            try:
                self._admit(live, block=not self.decoder.active)
                if self.decoder.active:  # (a request that ended when admitted is handed back by the step)
                    for request in self.decoder.step():
                        live.pop(id(request)).put(_DONE)
            except Exception as exc:  # noqa: BLE001  (the requests in flight get it; the server keeps serving)
                for pieces in live.values():
                    pieces.put(exc)
                live.clear()
                self.decoder.reset()

    def _admit(self, live: dict, block: bool) -> None:
        while self.decoder.free_slot() is not None:
            try:
                item = self._waiting.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return
            if item is None:  # close()
                return
            request, pieces = item
            block = False
            try:
                self.decoder.add(request)
            except Exception as exc:  # noqa: BLE001  (refused or failed prefill: only this request)
                self.decoder.drop(request)
                pieces.put(exc)
                continue
            live[id(request)] = pieces


class SlotClient:
    """What `openai_api` needs of a model, for one request served by a `SlotScheduler`."""

    def __init__(self, scheduler: SlotScheduler):
        self.scheduler = scheduler
        self.llm = scheduler.llm
        self.last_stats = None

    def __getattr__(self, name):  # prompt_tokens, detokenize, n_ctx, model_path, context ...
        return getattr(self.llm, name)

    def generate(self, prompt, max_tokens: int = 256, stream: bool = False, logprobs: int | None = None, **kwargs):
        if logprobs is not None and stream:  # before the request: its sampler would be left open
            raise NotImplementedError("logprobs with stream=True is not supported")
        request = self.llm.batch_request(prompt, max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        self.last_stats = request.stats
        pieces = self.scheduler.submit(request)
        if stream:
            return _stream(request, pieces)
        for _ in _stream(request, pieces):
            pass
        return request.completion()


def _stream(request, pieces: queue.Queue) -> Iterator[str]:
    """The request's text pieces; closing it early (the client went away) ends the request at the next step."""
    try:
        while True:
            item = pieces.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if not request.done:
            request.stats.finish_reason = "stop"
            request.done = True
