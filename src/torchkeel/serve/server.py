"""What the HTTP and gRPC front ends share: the models, their metrics, the image threads, the options."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchkeel.serve.grpc import start_grpc
from torchkeel.serve.metrics import ServerMetrics
from torchkeel.serve.model import ServedModel, ServeOptions
from torchkeel.serve.repository import ModelRepository


class Server:
    """What both front ends share: the models, their metrics, the image threads, the options."""

    def __init__(self, export_dirs: Sequence[str | Path], options: ServeOptions) -> None:
        self.options = options
        self.metrics = ServerMetrics()
        self.images = ThreadPoolExecutor(
            max_workers=max(1, options.image_threads), thread_name_prefix="torchkeel-image"
        )
        self.repository = ModelRepository(export_dirs, options, self.metrics, self.images)
        self.grpc: Any = None
        self.warmed: dict[str, Any] = {}
        """What ``warm`` answered for each model (the HTTP app's: a ``Warmed``)."""

    async def start(self, warm: Callable[[ServedModel], Awaitable[object]] | None = None) -> None:
        """Load and warm the models, then start gRPC. ``warm(model)`` runs for each ready model
        before anything else can reach it (the HTTP app's request warm-up)."""
        await self.repository.start()
        if warm is not None and self.options.warmup_sizes():
            for model in self.repository.models.values():
                self.warmed[model.name] = await warm(model)
        if self.options.grpc_port:
            self.grpc = await start_grpc(self)

    async def stop(self) -> None:
        """gRPC stops accepting and finishes its calls, then every queued request is answered."""
        if self.grpc is not None:  # its calls in flight await the batchers, on this loop
            await self.grpc.stop(grace=self.options.queue_timeout_ms / 1000)
        await self.repository.stop()
        self.images.shutdown(wait=True)
