"""Dynamic batching: concurrent requests stacked into one forward, each answered with its own rows.

The model runs on one worker thread; the batching loop runs on the event loop. When the model
is idle a request is dispatched at once with whatever else is already queued — a fixed wait
would only slow a lone client down. The loop waits up to ``max_queue_delay_ms`` for more only
when other requests were queued with this one (there is concurrency to fill a batch). While
the model is busy, requests pile up and the next batch takes them together.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np


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


@dataclass
class _Item:
    inputs: np.ndarray
    future: asyncio.Future
    enqueued: float


class DynamicBatcher:
    """Queue → batches of up to ``max_batch_size`` samples → ``run_batch`` on a worker thread."""

    def __init__(
        self,
        run_batch: Callable[[np.ndarray], np.ndarray],
        *,
        max_batch_size: int = 64,
        max_queue_delay_ms: float = 2.0,
        max_queue: int = 1024,
        queue_timeout_ms: float = 10_000.0,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_ms / 1000
        self.on_batch = on_batch
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchkeel-model")
        self._items: deque[_Item] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.in_flight = 0  # requests taken from the queue, not yet answered

    @property
    def pending(self) -> int:
        """Requests queued or being computed."""
        return len(self._items) + self.in_flight

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="torchkeel-batcher")

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

    async def submit(self, inputs: np.ndarray) -> np.ndarray:
        """The model's output rows for ``inputs`` (a batch of one or more samples)."""
        if self._task is None:
            raise RuntimeError("start() the batcher first")
        if len(self._items) >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} requests")
        future = asyncio.get_running_loop().create_future()
        self._items.append(_Item(inputs, future, time.perf_counter()))
        self._ready.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wait_for_items(None)
            items: list[_Item] = []
            size = self._take(items, 0)
            if len(items) > 1 and size < self.max_batch_size and self.max_queue_delay_s > 0:
                deadline = time.perf_counter() + self.max_queue_delay_s
                while size < self.max_batch_size and (left := deadline - time.perf_counter()) > 0:
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
        """Move queued requests into the batch while they fit; return the batch's samples."""
        while self._items and (not items or size + len(self._items[0].inputs) <= self.max_batch_size):
            item = self._items.popleft()
            items.append(item)
            size += len(item.inputs)
        return size

    async def _run(self, items: list[_Item]) -> None:
        now = time.perf_counter()
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
            batch = live[0].inputs if len(live) == 1 else np.concatenate([i.inputs for i in live])
            start = time.perf_counter()
            try:
                outputs = await asyncio.get_running_loop().run_in_executor(self.executor, self.run_batch, batch)
            except Exception as exc:  # noqa: BLE001 - the model's failure goes to each waiting request
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(exc)
                return
            compute_s = time.perf_counter() - start
            row = 0
            for item in live:
                n = len(item.inputs)
                if not item.future.done():
                    item.future.set_result(outputs[row: row + n])
                row += n
            if self.on_batch is not None:
                self.on_batch(BatchStats(len(batch), len(live), compute_s, [start - i.enqueued for i in live]))
        finally:
            self.in_flight -= len(live)
