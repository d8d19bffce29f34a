"""Dynamic batching: concurrent requests stacked into one forward, each answered with its own rows.

Greedy: the model never sits idle while requests wait. A request that finds the model idle
runs at once, with whatever else is queued; requests that arrive while the model is busy form
the next batch, which starts the moment the model is free. ``max_queue_delay_ms`` (default 0,
as in Triton) is an opt-in upper bound for filling an *idle* model from a burst that arrived
together; it is never a wait in front of a busy one, and a lone request never waits.

Where the model runs: while the fastest of the last 16 forwards took less than
``inline_max_ms``, forwards run on the event loop itself, as an unbatched endpoint would: the
hand-off to a thread and back costs more than a small forward. Slower models run on one worker
thread, so that the event loop keeps reading and parsing requests during the forward.

A request is one array, or arrays by input name (a model of several inputs). Requests are
joined only with those of the same shapes past the batch axis: padded sequences of another
length wait for the next batch, in their turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

PROBE_EVERY = 16

Batch = Union[np.ndarray, dict[str, np.ndarray]]


def batch_size(batch: Batch) -> int:
    """Samples in a request or batch."""
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)


def shapes(batch: Batch) -> tuple[Any, ...]:
    """What must agree for requests to join one batch: the shapes past the batch axis."""
    if isinstance(batch, dict):
        return tuple((name, a.shape[1:]) for name, a in batch.items())
    return batch.shape[1:]


def join(batches: list[Batch]) -> Batch:
    """One batch of several requests' rows, in order."""
    if isinstance(batches[0], dict):
        return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    return np.concatenate(batches)


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


class QueueTimeout(Exception):
    """A request waited in the queue longer than its timeout."""


@dataclass
class BatchStats:
    """What one forward did, for the metrics."""

    batch_size: int
    num_requests: int
    compute_s: float
    queue_s: list[float] = field(default_factory=list)


@dataclass(eq=False)  # found in the queue by identity: comparing arrays is ambiguous
class _Item:
    inputs: Batch
    future: asyncio.Future | concurrent.futures.Future  # the same done/set_result/set_exception
    enqueued: float
    size: int = 0
    shapes: Any = None

    def __post_init__(self) -> None:
        self.size, self.shapes = batch_size(self.inputs), shapes(self.inputs)


class DynamicBatcher:
    """Queue → batches of up to ``max_batch_size`` samples → ``run_batch`` on a worker thread."""

    def __init__(
        self,
        run_batch: Callable[[Batch], np.ndarray],
        *,
        max_batch_size: int = 64,
        max_queue_delay_ms: float = 0.0,
        max_queue: int = 1024,
        queue_timeout_ms: float = 10_000.0,
        inline_max_ms: float = 10.0,
        on_batch: Callable[[BatchStats, Batch], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000
        self.inline_max_s = inline_max_ms / 1000
        self._recent_s: deque[float] = deque(maxlen=16)  # the last forwards' durations
        self._idle_since = 0.0
        self._arrivals = 0
        self._company = 1.0  # moving share of idle-model arrivals that found others arriving with them
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_ms / 1000
        self.on_batch = on_batch
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchkeel-model")
        self._items: deque[_Item] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque[_Item] = deque()  # submitted from other threads, moved to the queue on the loop
        self._inbox_scheduled = threading.Lock()  # held while a move is scheduled: one wake-up per burst
        self.in_flight = 0  # requests taken from the queue, not yet answered

    @property
    def pending(self) -> int:
        """Requests queued or being computed."""
        return len(self._items) + len(self._inbox) + self.in_flight

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._batches(), name="torchkeel-batcher")

    async def stop(self) -> None:
        """Answer everything already queued, then stop."""
        while self.pending:
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=True)

    async def submit(self, inputs: Batch) -> np.ndarray:
        """The model's output rows for ``inputs`` (a batch of one or more samples)."""
        if self._task is None:
            raise RuntimeError("start() the batcher first")
        if len(self._items) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} requests")
        if not self._items and not self.in_flight and self._is_inline():
            # The model is idle and fast: a lone request runs right here, with no task switch.
            # Whether it is alone is learnt by letting the requests that arrived with it queue
            # up (one turn of the event loop) — always while recent turns found company, and on
            # every PROBE_EVERY-th request otherwise, so that a single client pays for it rarely.
            self._arrivals += 1
            if self._company > 0.1 or self._arrivals % PROBE_EVERY == 0:
                future = asyncio.get_running_loop().create_future()
                item = _Item(inputs, future, self.clock())
                self._items.append(item)
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:  # the client went away: take its request back
                    if item in self._items:
                        self._items.remove(item)
                    raise
                alone = len(self._items) == 1 and self._items[0] is item and not self.in_flight
                self._company = 0.8 * self._company + (0.0 if alone else 0.2)
                if not alone:
                    if item in self._items:
                        self._ready.set()
                    return await future
                self._items.popleft()
            return self._run_now(inputs)
        future = asyncio.get_running_loop().create_future()
        self._items.append(_Item(inputs, future, self.clock()))
        self._ready.set()
        return await future

    def submit_threadsafe(self, inputs: Batch) -> concurrent.futures.Future:
        """From another thread (gRPC's): queue ``inputs`` and return a future of their output rows.

        Requests from threads join the same queue and batches as the event loop's; a burst of
        them wakes the loop once.
        """
        if self._loop is None:
            raise RuntimeError("start() the batcher first")
        if len(self._items) + len(self._inbox) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} requests")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(_Item(inputs, future, self.clock()))
        if self._inbox_scheduled.acquire(blocking=False):
            self._loop.call_soon_threadsafe(self._take_inbox)
        return future

    def _take_inbox(self) -> None:
        self._inbox_scheduled.release()  # before emptying it: a later arrival schedules another move
        while self._inbox:
            self._items.append(self._inbox.popleft())
        self._ready.set()

    def _is_inline(self) -> bool:
        # The fastest of the recent forwards: robust to a slow first call and to forwards on the
        # worker thread that were stretched by the event loop sharing their core.
        return bool(self._recent_s) and min(self._recent_s) < self.inline_max_s

    def _run_now(self, inputs: Batch) -> np.ndarray:
        outputs, compute_s = self._timed(inputs)
        self._measured(BatchStats(batch_size(inputs), 1, compute_s, [0.0]), inputs)
        return outputs

    def _timed(self, batch: Batch) -> tuple[np.ndarray, float]:
        """The forward and its own duration (on the worker thread: without the hand-off back)."""
        start = self.clock()
        outputs = self.run_batch(batch)
        return outputs, self.clock() - start

    def _measured(self, stats: BatchStats, batch: Batch) -> None:
        """Record a forward: the model's idle mark, its duration, ``on_batch``."""
        self._idle_since = self.clock()
        self._recent_s.append(stats.compute_s)
        if self.on_batch is not None:
            self.on_batch(stats, batch)

    async def _batches(self) -> None:
        while True:
            await self._wait_for_items(None)
            items: list[_Item] = []
            size = self._take(items, 0)
            burst_at_idle = len(items) > 1 and items[0].enqueued >= self._idle_since
            if burst_at_idle and size < self.max_batch_size and self.max_queue_delay_s > 0:
                deadline = items[0].enqueued + self.max_queue_delay_s
                while size < self.max_batch_size and (left := deadline - self.clock()) > 0:
                    if not await self._wait_for_items(left):
                        break
                    taken = self._take(items, size)
                    if taken == size:  # the next request does not fit: this batch is full
                        break
                    size = taken
            await self._run(items)

    async def _wait_for_items(self, timeout_s: float | None) -> bool:
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    def _take(self, items: list[_Item], size: int) -> int:
        """Move queued requests into the batch while they fit (and have its shapes); return the batch's samples."""
        while self._items and (
            not items
            or (size + self._items[0].size <= self.max_batch_size and self._items[0].shapes == items[0].shapes)
        ):
            item = self._items.popleft()
            items.append(item)
            size += item.size
        return size

    async def _alone(self, items: list[_Item], error: Exception) -> None:
        """A batch failed: each request runs alone, so that one client's bad values fail its
        own request only, not those it was batched with."""
        if len(items) == 1:
            if not items[0].future.done():
                items[0].future.set_exception(error)
            return
        loop = asyncio.get_running_loop()
        for item in items:
            try:
                outputs, _ = await loop.run_in_executor(self.executor, self._timed, item.inputs)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                if not item.future.done():
                    item.future.set_exception(exc)
                continue
            if not item.future.done():
                item.future.set_result(outputs)

    async def _run(self, items: list[_Item]) -> None:
        now = self.clock()
        live = []
        for item in items:
            if item.future.done():  # the client went away
                continue
            if now - item.enqueued > self.queue_timeout_s:
                item.future.set_exception(QueueTimeout(f"waited {now - item.enqueued:.3f} s in the queue"))
                continue
            live.append(item)
        if not live:
            return
        self.in_flight += len(live)
        try:
            batch = live[0].inputs if len(live) == 1 else join([i.inputs for i in live])
            start = self.clock()
            try:
                if self._is_inline():
                    outputs, compute_s = self._timed(batch)  # blocks the loop for less than inline_max_ms
                else:
                    outputs, compute_s = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self._timed, batch
                    )
            except Exception as exc:  # noqa: BLE001 - the model's failure goes to the requests that cause it
                await self._alone(live, exc)
                return
            self._measured(
                BatchStats(sum(i.size for i in live), len(live), compute_s, [start - i.enqueued for i in live]), batch
            )
            row = 0
            for item in live:
                n = item.size
                if not item.future.done():
                    item.future.set_result(outputs[row : row + n])
                row += n
        finally:
            self.in_flight -= len(live)
