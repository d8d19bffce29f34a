"""Text generation behind the server: one engine per language model, on a thread of its own.

Requests that arrive together decode together, and a request that arrives while others decode
joins them at the next step when the decoder can take new rows (an export without a cache
recomputes its rows every step, so a new row costs one prompt pass); otherwise it starts with the
next batch. A request whose client went away leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.lm.decoding import Decoder, Sequence, Tokenizer, sequences
from torchkeel.lm.sampling import SamplingParams, next_tokens

_STOP = object()


@dataclass
class Update:
    """What one step gave one row of a request: new text, and why it ended (``None``: going on)."""

    index: int
    text: str
    finish_reason: str | None


@dataclass
class GenerationRequest:
    """One client's request: its rows (``n`` of them), and the steps' updates as they come."""

    rows: list[Sequence]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_at: float = 0.0
    abandoned: bool = False
    error: BaseException | None = None
    """The engine's error, once ``updates`` has raised it."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.rows[0].prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Each step's updates until every row has ended; the engine's error is raised here."""
        done = 0
        try:
            while done < len(self.rows):
                item = await self.events.get()
                if isinstance(item, BaseException):
                    self.error = item
                    raise item
                done += sum(u.finish_reason is not None for u in item)
                yield item
        finally:
            if done < len(self.rows):  # the client went away, or its handler was cancelled
                self.abandoned = True

    async def finished(self) -> list[Sequence]:
        async for _ in self.updates():
            pass
        return self.rows

    def _post(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class GenerationEngine:
    """Decodes the requests given to ``submit`` in batches of at most ``max_rows`` rows."""

    def __init__(
        self, decoder: Decoder, tokenizer: Tokenizer, max_rows: int = 64, gather_ms: float = 0.0, metrics: Any = None
    ) -> None:
        self.decoder, self.tokenizer, self.max_rows = decoder, tokenizer, max(1, max_rows)
        self.gather_s, self.metrics = gather_ms / 1000, metrics
        self.max_length = decoder.max_length
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="torchkeel-generate", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is being decoded and queued, then end the thread."""
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout_s)
            self._thread = None

    def submit(self, prompt: list[int], params: SamplingParams, n: int = 1) -> GenerationRequest:
        """Queue one request (called on the event loop); its ``updates`` stream the text."""
        request = GenerationRequest(sequences(self.tokenizer, [prompt], params, n), asyncio.get_running_loop())
        self._inbox.put(request)
        return request

    def _take(self, block: bool, room: int) -> list[GenerationRequest] | object:
        """Requests to start now, up to ``room`` rows (``_STOP`` once asked to stop and idle)."""
        taken: list[GenerationRequest] = []
        rows = 0
        while self._waiting and (rows + len(self._waiting[0].rows) <= room or (block and not taken)):
            taken.append(self._waiting.popleft())
            rows += len(taken[-1].rows)
        deadline = None
        while True:
            try:
                if block and not taken:
                    item = self._inbox.get()
                    deadline = time.perf_counter() + self.gather_s
                elif deadline is not None and time.perf_counter() < deadline:
                    item = self._inbox.get(timeout=max(deadline - time.perf_counter(), 0))
                else:
                    item = self._inbox.get_nowait()
            except queue.Empty:
                return taken
            if item is _STOP:
                self._inbox.put(_STOP)  # seen again once the work in hand is done
                return taken if taken or not block else _STOP
            if item.abandoned:
                continue
            too_many = rows + len(item.rows) > room and (taken or not block)  # alone, a request always starts
            if too_many or (not block and not getattr(self.decoder, "can_join", False)):
                self._waiting.append(item)
                if not block:
                    return taken
                continue
            taken.append(item)
            rows += len(item.rows)

    def _serve(self) -> None:
        active: list[tuple[GenerationRequest, Sequence]] = []
        logits = torch.empty(0)
        while True:
            incoming = self._take(block=not active, room=self.max_rows - len(active))
            if incoming is _STOP:
                return
            assert isinstance(incoming, list)
            try:
                if incoming:
                    rows = [(request, row) for request in incoming for row in request.rows]
                    prompts = [row.prompt for _, row in rows]
                    new = self.decoder.start(prompts) if not active else self.decoder.join(prompts)
                    logits = new if not active else torch.cat([logits, new])
                    active += rows
                    if self.metrics is not None:
                        self.metrics.prompt_tokens(sum(len(p) for p in prompts))
                        self.metrics.running(len(active))
                chosen = next_tokens(logits, [row.params for _, row in active], [row.generator for _, row in active])
                self._deliver(active, chosen)
                going = [
                    i for i, (request, row) in enumerate(active) if row.finish_reason is None and not request.abandoned
                ]
                for request, row in active:
                    if row.finish_reason is None and request.abandoned:
                        row.finish_reason = "abandoned"
                if len(going) < len(active):
                    active = [active[i] for i in going]
                    if active:
                        self.decoder.keep(going)
                    if self.metrics is not None:
                        self.metrics.running(len(active))
                if active:
                    logits = self.decoder.step([row.tokens[-1] for _, row in active])
            except Exception as exc:  # noqa: BLE001 - every request in hand gets the model's error
                failed = {id(request): request for request, _ in active}
                failed.update({id(request): request for request in incoming})
                for request in failed.values():
                    request._post(exc)
                active = []
                if self.metrics is not None:
                    self.metrics.running(0)

    def _deliver(self, active: list[tuple[GenerationRequest, Sequence]], chosen: list[int]) -> None:
        now = time.perf_counter()
        by_request: dict[int, tuple[GenerationRequest, list[Update]]] = {}
        for (request, row), token in zip(active, chosen):
            if row.finish_reason is not None:
                continue
            text = row.add(token)
            index = request.rows.index(row)
            by_request.setdefault(id(request), (request, []))[1].append(Update(index, text, row.finish_reason))
        for request, updates in by_request.values():
            if request.first_token_s is None:
                request.first_token_s = now - request.submitted
                if self.metrics is not None:
                    self.metrics.first_token(request.first_token_s)
            elif self.metrics is not None:
                self.metrics.output_token(now - request.last_token_at)
            request.last_token_at = now
            request._post(updates)
        if self.metrics is not None:
            self.metrics.tokens(len(chosen))
