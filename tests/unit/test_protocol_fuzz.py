"""Generated requests against the pure protocol layer: a request is either accepted or refused
with the protocol's own 4xx ``ProtocolError`` — never any other exception (which would be a 500).

Four properties at 600 examples each (2,400 in the default suite).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from v1body import parse_v1

from torchkeel.serve.protocol import DTYPES, ProtocolError, TensorSpec, parse_infer, top_k, v1_top_k

# Huge values cast to FP16/FP32 overflow to inf (numpy warns); they are then refused as non-finite.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
EXAMPLES = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = [
    ([TensorSpec("input", "FP32", [-1, 4])], [TensorSpec("output", "FP32", [-1, 3])]),
    (
        [TensorSpec("ids", "INT64", [-1, 2]), TensorSpec("mask", "BOOL", [-1, 2])],
        [TensorSpec("output", "FP32", [-1, 2])],
    ),
    ([TensorSpec("x", "BF16", [-1, 2, 2])], [TensorSpec("y", "FP16", [-1, 1])]),
]
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 1e308, -1e-320]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)
datatypes = st.one_of(st.sampled_from(sorted(DTYPES)), json_values)
shapes = st.one_of(st.lists(st.integers(min_value=-3, max_value=70), max_size=4), json_values)


@st.composite
def data_for(draw, shape):
    """Values that often fit the shape (so the deeper checks run), or anything."""
    if isinstance(shape, list) and all(type(d) is int and 0 <= d <= 70 for d in shape) and draw(st.booleans()):
        count = math.prod(shape)
        if count <= 600:
            flat = draw(st.lists(numbers, min_size=count, max_size=count))
            return flat if draw(st.booleans()) else np.asarray(flat, dtype=object).reshape(shape).tolist()
    return draw(json_values)


@st.composite
def v2_inputs(draw, names):
    shape = draw(shapes)
    tensor = {"name": draw(st.one_of(st.sampled_from(names), json_values)), "datatype": draw(datatypes), "shape": shape}
    choice = draw(st.integers(0, 3))
    if choice < 2:
        tensor["data"] = draw(data_for(shape))
    elif choice == 2:
        tensor["parameters"] = {"binary_data_size": draw(st.one_of(st.integers(-5, 10**12), json_values))}
    else:
        tensor["parameters"] = draw(json_values)
    return draw(st.one_of(st.just(tensor), json_values)) if draw(st.integers(0, 9)) == 0 else tensor


@st.composite
def v2_documents(draw, model):
    inputs, outputs = model
    doc: dict = {}
    if draw(st.booleans()):
        doc["inputs"] = draw(st.lists(v2_inputs([s.name for s in inputs]), max_size=3))
    for key, values in (
        ("id", st.one_of(st.text(max_size=10), json_values)),
        ("parameters", st.one_of(st.fixed_dictionaries({"binary_data_output": json_values}), json_values)),
        (
            "outputs",
            st.one_of(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "name": st.one_of(st.sampled_from([o.name for o in outputs]), json_values),
                            "parameters": st.one_of(st.fixed_dictionaries({"binary_data": json_values}), json_values),
                        }
                    ),
                    max_size=2,
                ),
                json_values,
            ),
        ),
        ("extra", json_values),
    ):
        if draw(st.integers(0, 3)) == 0:
            doc[key] = draw(values)
    return doc


def nested(depth: int, key: str) -> bytes:
    return ('{"%s": ' % key + "[" * depth + "]" * depth + "}").encode()


def accepts_or_refuses(call) -> None:
    try:
        call()
    except ProtocolError as exc:
        assert 400 <= exc.status < 500 and str(exc)


@EXAMPLES
@given(model=st.sampled_from(MODELS), data=st.data())
def test_v2_json_is_parsed_or_refused_with_a_4xx(model, data):
    inputs, outputs = model
    body = data.draw(
        st.one_of(
            v2_documents(model).map(lambda d: json.dumps(d).encode()),
            st.integers(1, 20_000).map(lambda n: nested(n, "inputs")),
            st.binary(max_size=64),
            st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
        )
    )

    def call():
        request = parse_infer(body, None, inputs, outputs, max_batch_size=64)
        for spec in inputs:  # what is accepted matches the model
            array = request.inputs[spec.name]
            assert array.ndim == len(spec.shape) and 1 <= array.shape[0] <= 64
            assert list(array.shape[1:]) == spec.shape[1:]

    accepts_or_refuses(call)


@EXAMPLES
@given(model=st.sampled_from(MODELS), data=st.data())
def test_binary_v2_is_parsed_or_refused_with_a_4xx(model, data):
    inputs, outputs = model
    header = json.dumps(data.draw(v2_documents(model))).encode()
    payload = data.draw(st.binary(max_size=96))
    body = header + payload
    length = data.draw(
        st.one_of(
            st.just(str(len(header))),
            st.integers(-10, len(body) + 10).map(str),
            st.text(max_size=6),
            st.none(),
        )
    )
    if data.draw(st.booleans()):  # truncated or over-long
        body = body[: data.draw(st.integers(0, len(body)))] if data.draw(st.booleans()) else body + b"\0" * 7
    accepts_or_refuses(lambda: parse_infer(body, length, inputs, outputs, max_batch_size=64))


@EXAMPLES
@given(data=st.data())
def test_v1_is_parsed_or_refused_with_a_4xx(data):
    spec = TensorSpec("input", "FP32", [-1, 4])
    instances = data.draw(
        st.one_of(
            st.lists(st.lists(numbers, min_size=4, max_size=4), min_size=1, max_size=3),
            st.lists(st.lists(numbers, max_size=6), max_size=3),
            json_values,
        )
    )
    doc = {
        "instances": instances,
        "parameters": data.draw(
            st.one_of(st.fixed_dictionaries({"top_k": st.one_of(json_values, st.integers(-3, 6))}), json_values)
        ),
    }
    body = data.draw(
        st.one_of(st.just(json.dumps(doc).encode()), st.integers(1, 20_000).map(lambda n: nested(n, "instances")))
    )

    def call():
        batch, parameters = parse_v1(body, spec, max_batch_size=64)
        k = v1_top_k(parameters, None, 3)
        if k is not None:
            assert len(top_k(np.zeros((len(batch), 3), np.float32), None, k)[0]["labels"]) == k

    accepts_or_refuses(call)


@EXAMPLES
@given(top=st.one_of(json_values, st.integers(-(2**70), 2**70)), default=st.one_of(st.none(), st.integers(1, 3)))
def test_top_k_of_every_type(top, default):
    accepts_or_refuses(lambda: v1_top_k({"top_k": top}, default, 3))
