"""The gRPC service's messages and conversions: the descriptor set is what the proto compiles to,
its messages are wire-compatible with tritonclient's own definition, and requests built by
tritonclient convert to the same arrays as over REST, in every datatype."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
from tritonclient.grpc import service_pb2 as triton_pb2
from tritonclient.grpc._utils import _get_inference_request

from torchkeel.serve.grpc import DESCRIPTOR_SET, MESSAGES, SERVICE, infer_request, infer_response, pb
from torchkeel.serve.protocol import ProtocolError, TensorSpec, classification

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_descriptor_set_is_what_the_proto_compiles_to(tmp_path):
    out = tmp_path / "predict_v2.binpb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{SRC}",
            f"--descriptor_set_out={out}",
            str(SRC / "torchkeel" / "serve" / "proto" / "predict_v2.proto"),
        ],
        check=True,
    )
    assert out.read_bytes() == DESCRIPTOR_SET.read_bytes(), "regenerate predict_v2.binpb (see predict_v2.proto)"


def _fields(descriptor) -> dict:
    return {
        f.name: (
            f.number,
            f.type,
            f.is_repeated if hasattr(f, "is_repeated") else f.label,
            f.message_type.full_name if f.message_type else None,
        )
        for f in descriptor.fields
    }


def _all(descriptor):
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _all(nested)


def test_every_message_and_method_matches_tritons_definition_on_the_wire():
    checked = 0
    for name in MESSAGES + ("InferParameter", "InferTensorContents"):
        ours_top = pb.ModelInferRequest.DESCRIPTOR.file.message_types_by_name[name]
        for ours in _all(ours_top):
            theirs = triton_pb2.DESCRIPTOR.pool.FindMessageTypeByName(ours.full_name)
            mine, triton = _fields(ours), _fields(theirs)
            for field, shape in mine.items():
                assert triton.get(field) == shape, (
                    f"{ours.full_name}.{field}: ours {shape}, Triton's {triton.get(field)}"
                )
                checked += 1
    ours_service = pb.ModelInferRequest.DESCRIPTOR.file.services_by_name["GRPCInferenceService"]
    theirs_service = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours_service.full_name == SERVICE
    for method in ours_service.methods:
        triton = theirs_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            triton.input_type.full_name,
            triton.output_type.full_name,
        )
    assert checked > 50 and len(ours_service.methods) == 6


def _model(datatype: str, shape: list[int], image: bool = False):
    spec = TensorSpec("input", datatype, shape)
    return SimpleNamespace(inputs=[spec], outputs=[TensorSpec("output", "FP32", [-1, 4])], is_image_model=image)


def _convert(triton_request, model, max_batch_size: int = 64):
    return infer_request(
        pb.ModelInferRequest.FromString(triton_request.SerializeToString()), model, max_batch_size, False
    )


DATATYPES = [
    ("BOOL", np.bool_),
    ("INT8", np.int8),
    ("INT16", np.int16),
    ("INT32", np.int32),
    ("INT64", np.int64),
    ("UINT8", np.uint8),
    ("FP16", np.float16),
    ("FP32", np.float32),
    ("FP64", np.float64),
]


@pytest.mark.parametrize("datatype,dtype", DATATYPES, ids=[d for d, _ in DATATYPES])
def test_raw_inputs_from_tritonclient_convert_in_every_datatype(datatype, dtype):
    x = (np.random.default_rng(0).normal(size=(3, 5)) * 20).astype(dtype)
    tensor = tritongrpc.InferInput("input", [3, 5], datatype)
    tensor.set_data_from_numpy(x)
    request = _get_inference_request("m", [tensor], "", "r7", None, 0, False, False, 0, None, None)
    parsed = _convert(request, _model(datatype, [-1, 5]))
    assert parsed.id == "r7" and parsed.inputs["input"].dtype == dtype
    np.testing.assert_array_equal(parsed.inputs["input"], x)


@pytest.mark.parametrize(
    "datatype,field,values,dtype",
    [
        ("BOOL", "bool_contents", [True, False], np.bool_),
        ("INT8", "int_contents", [-128, 127], np.int8),
        ("INT32", "int_contents", [-5, 7], np.int32),
        ("INT64", "int64_contents", [-(2**40), 3], np.int64),
        ("UINT8", "uint_contents", [0, 255], np.uint8),
        ("FP32", "fp32_contents", [0.5, -1.25], np.float32),
        ("FP64", "fp64_contents", [1e-300, 2.0], np.float64),
        ("BYTES", "bytes_contents", [b"a", b"\x00\xff"], object),
    ],
)
def test_typed_contents_convert(datatype, field, values, dtype):
    request = triton_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="input", datatype=datatype, shape=[2] if datatype == "BYTES" else [1, 2])
    getattr(tensor.contents, field).extend(values)
    model = _model(datatype, [-1] if datatype == "BYTES" else [-1, 2])
    array = _convert(request, model).inputs["input"]
    assert array.dtype == dtype and array.reshape(-1).tolist() == values


@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda r: r.inputs.add(name="input", datatype="INT8", shape=[1, 2]).contents.int_contents.extend([1, 300]),
            "inputs[0].contents.int_contents holds values outside the range of INT8",
        ),
        (
            lambda r: r.inputs.add(name="input", datatype="INT8", shape=[2, 2]).contents.int_contents.extend([1, 2]),
            "inputs[0].contents.int_contents has 2 values; the shape needs 4",
        ),
        (
            lambda r: r.inputs.add(name="input", datatype="INT8", shape=[1, 2]),
            "inputs[0] has neither contents nor raw_input_contents",
        ),
        (
            lambda r: (
                r.inputs.add(name="input", datatype="INT8", shape=[1, 2]),
                r.raw_input_contents.extend([b"\0", b"\0"]),
            ),
            "raw_input_contents has 2 entries for 1 inputs",
        ),
        (
            lambda r: (r.inputs.add(name="input", datatype="INT8", shape=[1, 2]), r.raw_input_contents.append(b"\0")),
            "inputs[0]: 1 binary bytes for 2 INT8 values",
        ),
        (
            lambda r: r.inputs.add(name="input", datatype="INT8", shape=[65, 2]),
            "inputs[0].shape[0] is 65; send between 1 and 64 samples",
        ),
        (lambda r: None, "'inputs' must be a non-empty list"),
    ],
    ids=["range", "count", "no-data", "raw-entries", "raw-size", "batch", "no-inputs"],
)
def test_bad_requests_name_the_field(build, message):
    request = triton_pb2.ModelInferRequest(model_name="m")
    build(request)
    with pytest.raises(ProtocolError) as caught:
        _convert(request, _model("INT8", [-1, 2]))
    assert caught.value.status == 400 and message in str(caught.value)


def test_fp16_and_bf16_travel_raw_only():
    request = triton_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="input", datatype="FP16", shape=[1, 1]).contents.fp32_contents.append(1.0)
    with pytest.raises(ProtocolError, match="FP16 tensors must be sent as raw_input_contents"):
        _convert(request, _model("FP16", [-1, 1]))
    import torch

    x = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    request = triton_pb2.ModelInferRequest(model_name="m", raw_input_contents=[x.view(torch.int16).numpy().tobytes()])
    request.inputs.add(name="input", datatype="BF16", shape=[1, 2])
    np.testing.assert_array_equal(_convert(request, _model("BF16", [-1, 2])).inputs["input"], [[1.5, -2.0]])


def test_responses_read_back_with_tritonclient_including_classifications():
    model = SimpleNamespace(name="m", version="1", outputs=[TensorSpec("output", "FP32", [-1, 3])])
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]], np.float32)
    request = SimpleNamespace(id="abc", outputs=None)
    ours = infer_response(model, request, {"output": logits})
    result = tritongrpc.InferResult(triton_pb2.ModelInferResponse.FromString(ours.SerializeToString()))
    np.testing.assert_array_equal(result.as_numpy("output"), logits)
    assert result.get_response().id == "abc" and result.get_response().model_name == "m"
    labelled = infer_response(model, request, {"output": classification(logits, ["a", "b", "c"], 2)})
    result = tritongrpc.InferResult(triton_pb2.ModelInferResponse.FromString(labelled.SerializeToString()))
    assert result.as_numpy("output").tolist() == [
        [b"2.000000:1:b", b"0.100000:0:a"],
        [b"3.000000:0:a", b"1.000000:2:c"],
    ]


def test_bounded_reads_end_late_calls_and_forget_the_ones_their_client_left():
    """A message in time is read; one that never comes ends DEADLINE_EXCEEDED within the bound
    (+ one sweep); a call its client cancels while its message is owed leaves nothing waiting."""
    import asyncio

    import grpc
    import grpc.aio

    from torchkeel.serve.grpc import BoundedReads

    bound_s = 0.4
    reads = BoundedReads(bound_s)

    async def echo(requests, context):
        request = await reads.read(context)
        return b"eof" if request is grpc.aio.EOF else request

    async def scenario() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.S", {"Echo": grpc.stream_unary_rpc_method_handler(echo)}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        release = asyncio.Event()

        async def late(delay_s: float):
            await asyncio.sleep(delay_s)
            yield b"hi"

        async def never():
            await release.wait()
            yield b"too late"

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_unary("/t.S/Echo")
                assert await call(late(bound_s / 3), timeout=10) == b"hi"
                start = asyncio.get_running_loop().time()
                with pytest.raises(grpc.aio.AioRpcError) as stalled:
                    await call(never(), timeout=10)
                waited = asyncio.get_running_loop().time() - start
                assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "--read-timeout-s" in stalled.value.details()
                assert bound_s <= waited < bound_s * 1.125 + 2.0, waited
                left = call(never(), timeout=10)
                await asyncio.sleep(bound_s / 4)
                assert len(reads.waiting) == 1
                left.cancel()
                for _ in range(100):  # the server sees the cancel
                    if not reads.waiting:
                        break
                    await asyncio.sleep(0.01)
                assert reads.waiting == {}
                await asyncio.sleep(bound_s)  # the sweep found nothing late and stopped
                assert not reads.sweeping
        finally:
            release.set()
            await server.stop(None)

    asyncio.run(scenario())
