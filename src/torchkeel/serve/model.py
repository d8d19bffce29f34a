"""One exported model behind its own dynamic batcher, with its metadata, drift and metrics.

Both front ends (REST in ``app``, gRPC in ``grpc``) call the same three things: ``counted``
(metrics and the mapping of failures to statuses), ``infer`` (v2 requests, parsed) and
``images`` + ``predict`` (KServe v1). An image model — its ``model.json`` records a
``preprocess`` — takes encoded images (input ``image``, BYTES) or the preprocessed tensor; the
images are decoded and preprocessed on a thread pool, off the event loop, by the same code that
prepared the training samples, then batched like any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from torchkeel.data.images import MAX_PIXELS, ImageError, ImagePreprocess
from torchkeel.errors import ConfigError
from torchkeel.export.formats import load_exported, read_model_json
from torchkeel.lm.decoding import CachedDecoder, RecomputeDecoder
from torchkeel.lm.tokenizer import export_tokenizer
from torchkeel.serve.batcher import (
    Batch,
    BatchStats,
    DynamicBatcher,
    QueueFull,
    QueueTimeout,
)
from torchkeel.serve.drift import DriftMonitor
from torchkeel.serve.generation import GenerationEngine
from torchkeel.serve.metrics import ServerMetrics
from torchkeel.serve.protocol import InferRequest, TensorSpec, classification
from torchkeel.serve.tensors import DTYPES, ProtocolError

VERSION = "1"
IMAGE_INPUT = "image"
PLATFORMS = {
    "torchscript": "pytorch_libtorch",
    "onnx": "onnxruntime_onnx",
    "torch-export": "pytorch_torch_export",
    "hf": "pytorch_transformers",
}
T = TypeVar("T")


@dataclass
class ServeOptions:
    max_batch_size: int = 64
    max_queue_delay_ms: float = 0.0
    inline_max_ms: float = 10.0
    max_queue: int = 1024
    queue_timeout_ms: float = 10_000.0
    max_body_mb: float = 16.0
    allow_nonfinite: bool = False
    top_k: int | None = None  # v1: tensor models answer top-k labels and scores when set; image models default to 5
    max_image_pixels: int = MAX_PIXELS
    image_threads: int = 2  # threads decoding and preprocessing images (shared by the models)
    grpc_port: int = 0  # 0: no gRPC; `keel serve` defaults to 8001
    grpc_host: str = "127.0.0.1"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    """Where the HTTP server listens, set by ``serve``: once it listens, the server warms its
    request path over this socket before it reports ready (0: not known, no such warm-up)."""
    warmup_batch_sizes: tuple[int, ...] | None = None
    """Batch sizes run once before a model is ready (Triton's ``model_warmup``); ``None``: 1, 2,
    4, ... up to ``max_batch_size``; ``()``: no warm-up."""
    model_name: str | None = None
    """Serve the one export under this name (KServe's ``--model_name``)."""
    read_timeout_s: float = 30.0
    """Each HTTP request must arrive in full (headers and body) within this many seconds of its
    first byte, else a 408 and the connection is closed (``serve.transport``); each gRPC call's
    request message likewise, else ``DEADLINE_EXCEEDED`` (``serve.grpc.BoundedReads``); inference
    and the response are not bounded by it."""

    def warmup_sizes(self) -> list[int]:
        if self.warmup_batch_sizes is not None:
            return sorted({min(max(1, n), self.max_batch_size) for n in self.warmup_batch_sizes})
        sizes, n = [], 1
        while n < self.max_batch_size:
            sizes.append(n)
            n *= 2
        return [*sizes, self.max_batch_size]


class ServedModel:
    """An export, loaded, with its batcher, drift monitor and metrics."""

    def __init__(self, export_dir: str | Path, options: ServeOptions, metrics: ServerMetrics, images: Executor) -> None:
        self.meta = read_model_json(export_dir)
        if not self.meta.get("parity", {}).get("passed"):
            raise ConfigError(f"the export in '{export_dir}' failed its parity check; it is not served")
        self.path, self.options, self._images = Path(export_dir), options, images
        self.name, self.version = options.model_name or self.meta["name"], VERSION
        self.tensors = [
            TensorSpec(t["name"], t["datatype"], t["shape"], t.get("dims"), t.get("range"), t.get("max_shape"))
            for t in self.meta["inputs"]
        ]
        self.tensor = self.tensors[0]
        self.outputs = [TensorSpec(t["name"], t["datatype"], t["shape"]) for t in self.meta["outputs"]]
        self.labels: list[str] | None = self.meta.get("labels")
        spec = self.meta.get("preprocess")
        self.preprocess = ImagePreprocess.from_spec(spec, f"'{self.path / 'model.json'}' preprocess") if spec else None
        self.inputs = [TensorSpec(IMAGE_INPUT, "BYTES", [-1]), self.tensor] if self.preprocess else list(self.tensors)
        self.run = load_exported(
            self.meta["format"], self.path / self.meta["file"], [t.name for t in self.tensors], self.outputs[0].name
        )
        reference = self.meta.get("reference")
        self.drift = DriftMonitor(reference) if reference else None
        self._drift_input = (reference or {}).get("input", self.tensor.name)
        self.batcher = DynamicBatcher(
            self.run,
            max_batch_size=options.max_batch_size,
            max_queue_delay_ms=options.max_queue_delay_ms,
            max_queue=options.max_queue,
            queue_timeout_ms=options.queue_timeout_ms,
            inline_max_ms=options.inline_max_ms,
            on_batch=self._on_batch,
        )
        self.metrics = metrics.model(self.name, self.version, self.drift, pending=lambda: self.batcher.pending)
        self.ready = False
        self.generation = self._generation_engine()

    def _generation_engine(self) -> GenerationEngine | None:
        """A causal LM's text generation (``model.json`` records its task and tokenizer), or ``None``."""
        tokenizer = export_tokenizer(self.path, self.meta) if self.meta.get("task") == "causal-lm" else None
        names = [t.name for t in self.tensors]
        if tokenizer is None or "input_ids" not in names or not set(names) <= {"input_ids", "attention_mask"}:
            return None
        model = getattr(self.run, "model", None)  # a --format hf export: decoded with its cache
        decoder = (
            CachedDecoder(model)
            if CachedDecoder.fits(model)
            else RecomputeDecoder(self.run, names, self.meta.get("max_length"))
        )
        return GenerationEngine(
            decoder,
            tokenizer,
            max_rows=self.options.max_batch_size,
            gather_ms=self.options.max_queue_delay_ms,
            metrics=self.metrics.generation(),
        )

    @property
    def is_image_model(self) -> bool:
        return self.preprocess is not None

    @property
    def has_named_inputs(self) -> bool:
        """Several inputs (a dict batch's keys): v1 instances are objects of them."""
        return len(self.tensors) > 1

    def metadata(self) -> dict[str, Any]:
        """v2 model metadata: an image model advertises its ``image`` input (it also takes the tensor)."""
        shown = self.inputs[:1] if self.preprocess else self.inputs
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORMS[self.meta["format"]],
            "inputs": [spec_dict(t) for t in shown],
            "outputs": [spec_dict(t) for t in self.outputs],
        }

    def warm_up(self) -> list[int]:
        """Run one batch of every warm-up size (zeros, or the lowest id an integer input allows),
        so that the first requests after ready do not pay for first-call allocation or planning."""
        sizes = self.options.warmup_sizes()
        for size in sizes:
            self.run(self.feed(warmup_arrays(self.tensors, size)))
        return sizes

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Requests and batches in this block are counted in scratch metrics and seen by a
        scratch drift monitor, both dropped at its end: the server's own warm-up requests
        (``serve.warmup``) run all the code a client's request runs, counting included, so that
        it is warm too, and leave the figures as they were."""
        kept = self.metrics, self.drift
        self.drift = DriftMonitor(self.meta["reference"]) if self.drift is not None else None
        self.metrics = ServerMetrics().model(self.name, self.version, self.drift, pending=lambda: self.batcher.pending)
        try:
            yield
        finally:
            self.metrics, self.drift = kept

    def _on_batch(self, stats: BatchStats, inputs: Batch) -> None:
        self.metrics.batch_done(stats.batch_size, stats.num_requests, stats.compute_s, sum(stats.queue_s))
        if self.drift is not None:  # once per batch, not per request; on the preprocessed tensors
            self.drift.observe(inputs[self._drift_input] if isinstance(inputs, dict) else inputs)

    async def counted(self, protocol: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run one request's ``work``, counted in the metrics; every failure leaves as a ProtocolError."""
        with _Counting(self.metrics, protocol):  # the warm-up's scratch metrics while it lasts
            return await work()

    async def predict(self, batch: Batch) -> np.ndarray:
        """The model's output rows for a batch of (preprocessed) inputs: one array, or the
        arrays by input name for a model of several inputs."""
        if not self.ready:
            raise QueueFull("the model is not ready")
        return await self.batcher.submit(batch)

    async def images(self, blobs: list[bytes], wheres: list[str]) -> np.ndarray:
        """Encoded images → the model's input batch, decoded and preprocessed off the event loop.

        Raises:
            ProtocolError: 400 naming the image (``wheres[i]``) that cannot be decoded, is of a
                format not accepted, is over ``max_image_pixels`` or ends up of the wrong shape;
                or 400 when the model takes no images.
        """
        if self.preprocess is None:
            raise ProtocolError(
                400,
                f"model '{self.name}' takes {self.tensor.datatype} tensors of shape "
                f"{self.tensor.shape}, not images: its export records no preprocess "
                f"(keel export --image-mode ...)",
            )
        return await asyncio.get_running_loop().run_in_executor(self._images, self._preprocessed, blobs, wheres)

    def _preprocessed(self, blobs: list[bytes], wheres: list[str]) -> np.ndarray:
        assert self.preprocess is not None
        shape = self.tensor.shape[1:]
        batch = np.empty((len(blobs), *shape), dtype=np.float32)
        for i, (blob, where) in enumerate(zip(blobs, wheres)):
            try:
                array = self.preprocess.array(blob, self.options.max_image_pixels)
            except ImageError as exc:
                raise ProtocolError(400, f"{where}: {exc}") from None
            if list(array.shape) != shape:
                raise ProtocolError(
                    400, f"{where}: the image is {list(array.shape)} after preprocessing; the model takes {shape}"
                )
            batch[i] = array
        return batch

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        """A parsed v2 request (REST) → its outputs by name, classifications applied."""
        images = self._images_of(request)
        batch = await self.images(*images) if images is not None else self.feed(request.inputs)
        return self._results(request, await self.predict(batch))

    def feed(self, arrays: dict[str, np.ndarray]) -> Batch:
        """What the batcher takes: the one input's array, or every input's by name."""
        return {t.name: arrays[t.name] for t in self.tensors} if self.has_named_inputs else arrays[self.tensor.name]

    def _images_of(self, request: InferRequest) -> tuple[list[bytes], list[str]] | None:
        if IMAGE_INPUT not in request.inputs or self.preprocess is None:
            return None
        items = request.inputs[IMAGE_INPUT]
        return list(items), [f"input '{IMAGE_INPUT}' item {i}" for i in range(len(items))]

    def _results(self, request: InferRequest, outputs: np.ndarray) -> dict[str, np.ndarray]:
        results = {self.outputs[0].name: outputs}
        for name, k in request.classification.items():
            results[name] = classification(results[name], self.labels, k)
        return results


class _Counting:
    """One request in ``metrics``: started on entry; on exit done, with Triton's failure reason,
    and a failure other than a ``ProtocolError`` replaced by the one the client gets. (A class,
    not a generator context manager: this runs on every request.)"""

    __slots__ = ("metrics", "protocol", "start")

    def __init__(self, metrics: Any, protocol: str) -> None:
        self.metrics, self.protocol = metrics, protocol

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        self.metrics.request_started()

    def __exit__(self, kind: type | None, exc: BaseException | None, traceback: Any) -> None:
        failure = error = None
        if isinstance(exc, asyncio.CancelledError):
            failure = "CANCELED"
        elif isinstance(exc, Exception):
            failure, error = _failed(exc)
        self.metrics.request_done(self.protocol, time.perf_counter() - self.start, failure)
        if error is not None and error is not exc:
            raise error from None


def _failed(exc: Exception) -> tuple[str, ProtocolError]:
    """Triton's failure reason for ``exc``, and the error the client gets."""
    if isinstance(exc, ProtocolError):
        return "OTHER", exc
    if isinstance(exc, QueueFull):
        return "REJECTED", ProtocolError(503, f"server busy: {exc}; retry later", {"Retry-After": "1"})
    if isinstance(exc, QueueTimeout):
        return "REJECTED", ProtocolError(503, f"request timed out in the queue: {exc}", {"Retry-After": "1"})
    return "BACKEND", ProtocolError(500, f"model execution failed: {type(exc).__name__}: {exc}")


def spec_dict(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": t.shape}


WARMUP_LENGTH = 16
"""The length of a dynamic axis other than the batch in a warm-up batch."""


def warmup_arrays(specs: list[TensorSpec], batch_size: int) -> dict[str, np.ndarray]:
    """A warm-up batch by input name: zeros, or the lowest id an integer input allows."""
    return {spec.name: _sample(spec, batch_size) for spec in specs}


def _sample(spec: TensorSpec, batch_size: int) -> np.ndarray:
    shape = [batch_size, *(WARMUP_LENGTH if d == -1 else d for d in spec.shape[1:])]
    value = spec.range[0] if spec.range else 0
    return np.full(shape, value, dtype=DTYPES[spec.datatype])
