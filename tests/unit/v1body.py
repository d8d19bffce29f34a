"""KServe v1 bodies parsed in one call, as the protocol's tests want them (the server does it in
two steps: ``parse_v1_instances``, then ``v1_tensor`` or ``v1_named_tensors``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchkeel.serve.protocol import TensorSpec, parse_v1_instances, v1_tensor


def parse_v1(
    body: bytes, spec: TensorSpec, max_batch_size: int, allow_nonfinite: bool = False
) -> tuple[np.ndarray, dict[str, Any]]:
    """A KServe v1 ``{"instances": [...]}`` body of tensors → the input batch and the request's parameters
    (what the server does in two steps, in one call for the protocol's tests)."""
    instances, parameters = parse_v1_instances(body, max_batch_size)
    return v1_tensor(instances, spec, allow_nonfinite), parameters
