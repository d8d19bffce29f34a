"""The KServe v2 / Triton gRPC service (``inference.GRPCInferenceService``) on the REST server's models.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, with tensors
as typed ``contents`` or ``raw_input_contents`` (answers always raw, as Triton's). It shares the
HTTP server's models: the same batcher and queue, the same input checks (``protocol.InputSet``),
metrics (``protocol="grpc"``) and shutdown. A client mistake is ``INVALID_ARGUMENT`` with the
field named; an unknown model ``NOT_FOUND``; a full queue, or a model that failed to load,
``UNAVAILABLE``; a failing model ``INTERNAL``.

grpcio's asyncio server (``grpc.aio``) on the HTTP server's event loop: a ModelInfer call awaits
the batcher directly (images are preprocessed on the image threads, as REST's), and a call
waiting for its request message holds no thread, only its stream. Every method is served as a
stream of requests of which the first is read against ``read_timeout_s`` (the HTTP bound): a
call whose message has not arrived in full by then ends ``DEADLINE_EXCEEDED``; a connection
that does not complete its HTTP/2 handshake within it, or has no call in progress for as long,
is closed. (The threaded server cost about as much CPU per call, and batched concurrent calls
better, but waited for each request message on one of its threads.)

The message classes come from ``proto/predict_v2.binpb`` (compiled from ``predict_v2.proto``)
in a descriptor pool of their own: the same ``inference.*`` messages of tritonclient, or of any
other library, may live in the same process without a clash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from torchkeel._version import __version__
from torchkeel.errors import ConfigError
from torchkeel.serve.model import ServedModel
from torchkeel.serve.protocol import EXTENSIONS, InferRequest, InputSet, checked_classification, checked_output
from torchkeel.serve.tensors import DTYPES, NUMPY_TO_V2, ProtocolError, array_from_bytes, length_prefixed

if TYPE_CHECKING:
    from torchkeel.serve.server import Server

SERVICE = "inference.GRPCInferenceService"
DESCRIPTOR_SET = Path(__file__).parent / "proto" / "predict_v2.binpb"
STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    500: grpc.StatusCode.INTERNAL,
}
# The typed field of InferTensorContents for each datatype (FP16 and BF16 travel raw only).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
MESSAGES = (
    "ServerLiveRequest",
    "ServerLiveResponse",
    "ServerReadyRequest",
    "ServerReadyResponse",
    "ModelReadyRequest",
    "ModelReadyResponse",
    "ServerMetadataRequest",
    "ServerMetadataResponse",
    "ModelMetadataRequest",
    "ModelMetadataResponse",
    "ModelInferRequest",
    "ModelInferResponse",
)


def messages() -> SimpleNamespace:
    """The protocol's message classes, built from the descriptor set in a private pool."""
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes()).file:
        pool.Add(file)
    return SimpleNamespace(
        **{name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{name}")) for name in MESSAGES}
    )


pb = messages()


async def start_grpc(server: Server) -> grpc.aio.Server:
    """Listen on ``options.grpc_host:grpc_port`` and serve ``server``'s models (their batchers
    started), on the running event loop.

    Raises:
        ConfigError: the port cannot be bound.
    """
    options = server.options
    bound_ms = max(1, round(options.read_timeout_s * 1000))
    service = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", int(options.max_body_mb * 2**20)),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", bound_ms),
            ("grpc.max_connection_idle_ms", bound_ms),
        ],
    )
    service.add_registered_method_handlers(SERVICE, _Service(server).handlers())
    host = f"[{options.grpc_host}]" if ":" in options.grpc_host else options.grpc_host
    address = f"{host}:{options.grpc_port}"
    try:
        bound = service.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise ConfigError(f"--grpc-port {options.grpc_port}: cannot listen on {address}; choose another port")
    await service.start()
    return service


class _Service:
    def __init__(self, server: Server) -> None:
        self.repository, self.options = server.repository, server.options
        self.reads = BoundedReads(server.options.read_timeout_s)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        calls = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
        }
        return {
            name: grpc.stream_unary_rpc_method_handler(
                self._bounded(call), request_deserializer=request.FromString, response_serializer=_serialize
            )
            for name, (call, request) in calls.items()
        }

    def _bounded(self, call: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Any:
        """``call`` as a stream-unary handler whose request must arrive within ``read_timeout_s``
        (a unary client's call is the same on the wire; grpc would read a unary request before
        the handler runs, with no bound)."""
        reads = self.reads

        async def handle(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await reads.read(context)
            if request is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
            return await call(request, context)

        return handle

    async def _model(self, name: str, version: str, context: grpc.aio.ServicerContext) -> ServedModel:
        try:
            return self.repository.get(name, version)
        except ProtocolError as exc:
            await context.abort(STATUS[exc.status], str(exc))
            raise  # abort raises; never reached

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.repository.ready)

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = await self._model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.repository.model_ready(model))

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(name="torchkeel", version=__version__, extensions=EXTENSIONS)

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        meta = (await self._model(request.name, request.version, context)).metadata()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = await self._model(request.model_name, request.model_version, context)

        async def work() -> Any:
            parsed = infer_request(request, model, self.options.max_batch_size, self.options.allow_nonfinite)
            return infer_response(model, parsed, await model.infer(parsed))

        try:
            return await model.counted("grpc", work)
        except ProtocolError as exc:
            await context.abort(STATUS.get(exc.status, grpc.StatusCode.UNKNOWN), str(exc))


class BoundedReads:
    """Reads each call's request message; a call whose message is not in full ``seconds`` after
    its start ends ``DEADLINE_EXCEEDED``.

    One timer for all the calls waiting (a timer per call costs more than the rest of the
    bookkeeping): it runs every ``seconds / 8`` while a call waits, so a late call ends within
    ``1.125 × seconds`` of its start (``seconds`` at least).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.waiting: dict[asyncio.Task[Any], float] = {}  # deadlines, in the order the calls came
        self.sweeping = False
        self.late = (
            f"the request message did not arrive in full within {seconds:g} s (--read-timeout-s); "
            "send it with the call, or raise the bound"
        )

    async def read(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's first request message, or ``grpc.aio.EOF`` when the client sent none."""
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        self.waiting[task] = loop.time() + self.seconds
        if not self.sweeping:
            self.sweeping = True
            loop.call_later(self.seconds / 8, self._sweep, loop)
        try:
            return await context.read()
        except asyncio.CancelledError:
            if task in self.waiting:  # cancelled by grpc (the client left or stopped), not late
                raise
            task.uncancel()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.late)
        finally:
            self.waiting.pop(task, None)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now, late = loop.time(), []
        for task, deadline in self.waiting.items():
            if deadline > now:
                break
            late.append(task)
        for task in late:
            del self.waiting[task]
            task.cancel()
        self.sweeping = bool(self.waiting)
        if self.sweeping:
            loop.call_later(self.seconds / 8, self._sweep, loop)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def infer_request(request: Any, model: ServedModel, max_batch_size: int, allow_nonfinite: bool) -> InferRequest:
    """A ``ModelInferRequest`` → the same parsed request as REST's, with the same checks."""
    collected = InputSet(model.inputs, max_batch_size, allow_nonfinite, one_of=model.is_image_model)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            400,
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; send one per input, in order",
        )
    if not request.inputs:
        raise ProtocolError(400, "'inputs' must be a non-empty list of tensors")
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}]"
        spec, shape = collected.header(where, tensor.name, tensor.datatype, list(tensor.shape))
        count = int(np.prod(shape))
        if raw:
            array = array_from_bytes(raw[i], spec.datatype, count, where)
        elif tensor.HasField("contents"):
            array = _from_contents(tensor.contents, spec.datatype, count, where)
        else:
            raise ProtocolError(400, f"{where} has neither contents nor raw_input_contents")
        collected.add(where, spec, array.reshape(shape))
    requested: dict[str, bool] | None = None
    classes: dict[str, int] = {}
    if request.outputs:
        requested = {}
        for j, output in enumerate(request.outputs):
            name = checked_output(output.name, f"outputs[{j}]", model.outputs)
            requested[name] = True
            if "classification" in output.parameters:
                k = _parameter(output.parameters["classification"])
                classes[name] = checked_classification(k, f"outputs[{j}]", model.outputs)
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    return InferRequest(request.id or None, collected.finish(), requested, True, parameters, classes)


def infer_response(model: ServedModel, request: InferRequest, results: dict[str, np.ndarray]) -> Any:
    """The outputs asked for (all by default), as raw contents."""
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id or "")
    for name in request.outputs if request.outputs is not None else results:
        array = np.ascontiguousarray(results[name])
        is_bytes = array.dtype == object
        response.outputs.add(name=name, datatype="BYTES" if is_bytes else _datatype(array), shape=list(array.shape))
        response.raw_output_contents.append(length_prefixed(array) if is_bytes else array.tobytes())
    return response


def _from_contents(contents: Any, datatype: str, count: int, where: str) -> np.ndarray:
    field = CONTENTS.get(datatype)
    if field is None:
        raise ProtocolError(400, f"{where}: {datatype} tensors must be sent as raw_input_contents")
    values = getattr(contents, field)
    if len(values) != count:
        raise ProtocolError(400, f"{where}.contents.{field} has {len(values)} values; the shape needs {count}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    dtype = np.dtype(DTYPES[datatype])
    wide = np.asarray(values)
    array = wide.astype(dtype)
    if dtype.kind in "iu" and not np.array_equal(array, wide):
        raise ProtocolError(400, f"{where}.contents.{field} holds values outside the range of {datatype}")
    return array


def _parameter(value: Any) -> Any:
    which = value.WhichOneof("parameter_choice")
    return getattr(value, which) if which else None


def _datatype(array: np.ndarray) -> str:
    return NUMPY_TO_V2[array.dtype]
