"""KServe v1 prediction: ``{"instances": [...]}`` in, ``{"predictions": [...]}`` out.

The route (``app``) reads the body and answers; what an instance is (an image, a tensor, a dict
of named inputs) and what the answer holds (scores, or the top-k labels) is decided here.
"""

from __future__ import annotations

from typing import Any

from torchkeel.serve.model import ServedModel, ServeOptions
from torchkeel.serve.protocol import (
    label_scores,
    parse_v1_instances,
    top_k,
    v1_has_images,
    v1_images,
    v1_named_tensors,
    v1_tensor,
    v1_top_k,
)
from torchkeel.serve.tensors import ProtocolError

IMAGE_TOP_K = 5  # v1 image predictions: the 5 best labels unless the request or --top-k says otherwise


async def v1_predict(model: ServedModel, body: bytes, options: ServeOptions) -> dict[str, Any]:
    """The predictions for a v1 request ``body``; a client mistake is a ``ProtocolError`` (4xx)."""
    instances, parameters = parse_v1_instances(body, options.max_batch_size)
    num_classes = model.outputs[0].shape[-1]
    if v1_has_images(instances):  # a tensor model answers that it takes no images
        blobs, wheres = v1_images(instances)
        outputs = await model.predict(await model.images(blobs, wheres))
        k = v1_top_k(parameters, options.top_k or min(IMAGE_TOP_K, num_classes), num_classes)
        return {"predictions": label_scores(outputs, model.labels, k)}
    if model.has_named_inputs or isinstance(instances[0], dict):  # {input name: values} each
        batch = model.feed(v1_named_tensors(instances, model.tensors, options.allow_nonfinite))
    else:
        batch = v1_tensor(instances, model.tensor, options.allow_nonfinite)
    outputs = await model.predict(batch)
    k = v1_top_k(parameters, options.top_k if outputs.ndim == 2 else None, num_classes)
    if k is not None and outputs.ndim != 2:
        raise ProtocolError(
            400,
            f"parameters.top_k needs one score per class; the model answers {list(outputs.shape[1:])} per instance",
        )
    if k is not None:
        return {"predictions": top_k(outputs, model.labels, k)}
    return {"predictions": outputs.tolist()}
