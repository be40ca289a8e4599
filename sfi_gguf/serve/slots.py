"""Parallel server slots: concurrent requests decode together in one `BatchedDecoder`.

One thread owns the model and loops: admit waiting requests into free slots (prefill), run one batched
step for every active slot, repeat; it sleeps while nothing is active. Each admission and step runs
under the model's lock (`SFILlama` serialises its calls), so a `close()` from another thread waits for
the step in progress. A request thread talks to it through a `SlotClient`, which looks like an
`SFILlama` to `openai_api` (same `generate`, `prompt_tokens`, `last_stats` ...), so the OpenAI-compatible
shaping is shared with the one-request-at-a-time server. A request whose `cancel` event is set (its
client went away, or its stream was closed) ends at the next step and frees its slot.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

from ..core.context import ContextError

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

    @property
    def n_active(self) -> int:
        """Slots decoding a request now."""
        return len(self.decoder.active)

    def client(self, cancel: threading.Event | None = None) -> "SlotClient":
        return SlotClient(self, cancel)

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
            # sleep (without the model's lock) until a request arrives, unless some are decoding
            first = self._waiting.get() if not self.decoder.active else None
            if self._stop.is_set():
                break
            with self.llm._lock:
                if self.llm.closed:  # every request fails, now and later
                    self._fail(live, first, ContextError("the model was closed (SFILlama.close())"))
                    continue
                try:
                    self._admit(live, first)
                    if self.decoder.active:  # (a request that ended when admitted is handed back by the step)
                        for request in self.decoder.step():
                            live.pop(id(request)).put(_DONE)
                except Exception as exc:  # noqa: BLE001  (the requests in flight get it; the server keeps serving)
                    for pieces in live.values():
                        pieces.put(exc)
                    live.clear()
                    self.decoder.reset()
        self._fail(live, None, ContextError("the server is shutting down"))

    def _admit(self, live: dict, item) -> None:
        """Prefill waiting requests into the free slots: `item` first, then what the queue holds."""
        while self.decoder.free_slot() is not None:
            if item is None:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    return
                if item is None:  # close()
                    return
            request, pieces = item
            item = None
            if request.cancel is not None and request.cancel.is_set():  # its client left while it waited
                request.stats.finish_reason = "stop"
                request.sampler.close()
                pieces.put(_DONE)
                continue
            try:
                self.decoder.add(request)
            except Exception as exc:  # noqa: BLE001  (refused or failed prefill: only this request)
                self.decoder.drop(request)
                pieces.put(exc)
                continue
            live[id(request)] = pieces

    def _fail(self, live: dict, item, exc: Exception) -> None:
        """Hand `exc` to the requests in flight, to `item` and to every waiting request."""
        for pieces in live.values():
            pieces.put(exc)
        live.clear()
        while item is not None or not self._waiting.empty():
            if item is None:
                item = self._waiting.get_nowait()
            if item is not None:
                item[1].put(exc)
            item = None


class SlotClient:
    """What `openai_api` needs of a model, for one request served by a `SlotScheduler`.

    `cancel` (a threading.Event, e.g. set by the server when the client disconnects) ends the request
    at the next step; closing its stream early sets it too.
    """

    def __init__(self, scheduler: SlotScheduler, cancel: threading.Event | None = None):
        self.scheduler = scheduler
        self.llm = scheduler.llm
        self.cancel = cancel if cancel is not None else threading.Event()
        self.last_stats = None

    def __getattr__(self, name):  # prompt_tokens, detokenize, n_ctx, model_path, context ...
        return getattr(self.llm, name)

    def generate(self, prompt, max_tokens: int = 256, stream: bool = False, logprobs: int | None = None, **kwargs):
        if logprobs is not None and stream:  # before the request: its sampler would be left open
            raise NotImplementedError("logprobs with stream=True is not supported")
        request = self.llm.batch_request(prompt, max_tokens=max_tokens, logprobs=logprobs, cancel=self.cancel,
                                         **kwargs)
        self.last_stats = request.stats
        pieces = self.scheduler.submit(request)
        if stream:
            return _stream(request, pieces)
        for _ in _stream(request, pieces):
            pass
        return request.completion()


def _stream(request, pieces: queue.Queue) -> Iterator[str]:
    """The request's text pieces; closing it early (the client went away) ends the request at the next step."""
    ended = False
    try:
        while True:
            item = pieces.get()
            ended = item is _DONE or isinstance(item, BaseException)
            if item is _DONE:
                return
            if ended:
                raise item
            yield item
    finally:
        if not ended:
            request.cancel.set()
