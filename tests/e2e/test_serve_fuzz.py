"""A live ``keel serve`` under generated HTTP traffic: random methods, paths, headers and bodies
(valid, mutated, truncated, deeply nested, oversized), and for its image model encoded images that
are valid, corrupted, truncated, of formats it does not take, or decompression bombs. Every answer
is below 500, no connection is reset, nothing hangs, and afterwards the server still answers correctly.

500 requests in the default suite, 5,000 behind the ``slow`` marker.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import random

import numpy as np
import pytest
from serveproc import Server, eager_rows, exported, image_exported  # noqa: F401 - fixtures

from imagedata import encode, image_pixels

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
INFER = ["/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer", "/v1/models/tiny:predict"]
IMAGE_INFER = ["/v1/models/colours:predict", "/v2/models/colours/infer"]
PATHS = [
    *INFER,
    "/v2/models/tiny",
    "/v2/models/tiny/ready",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2",
    "/metrics",
    "/v1/models/tiny",
    "/v2/models/nope/infer",
    "/v2/models/tiny/versions/9/infer",
    "/v1/models/tiny:explain",
    "/",
    "/v3/x",
    "/v2/models//infer",
    "/v2/models/tiny/infer/extra",
    "/v1/models/%00:predict",
    "/v2/models/t%C3%AFny/infer",
]


def valid_body(rng: random.Random, path: str) -> tuple[bytes, dict[str, str]]:
    n = rng.randint(1, 4)
    rows = np.random.default_rng(rng.randrange(2**32)).normal(size=(n, 32)).astype(np.float32)
    if "/v1/" in path:
        doc = {
            "instances": rows.tolist(),
            **({"parameters": {"top_k": rng.choice([1, 2, 0, "2", None])}} if rng.random() < 0.3 else {}),
        }
        return json.dumps(doc).encode(), {}
    tensor = {"name": "input", "shape": [n, 32], "datatype": "FP32"}
    if rng.random() < 0.5:
        header = json.dumps(
            {
                "inputs": [{**tensor, "parameters": {"binary_data_size": rows.nbytes}}],
                "parameters": {"binary_data_output": rng.random() < 0.5},
            }
        ).encode()
        length = rng.choice([len(header), len(header), rng.randint(-5, len(header) + rows.nbytes + 5), "x"])
        return header + rows.tobytes(), {"Inference-Header-Content-Length": str(length)}
    return json.dumps({"inputs": [{**tensor, "data": rows.reshape(-1).tolist()}], "id": "r"}).encode(), {}


@functools.lru_cache(maxsize=None)
def _bomb(size: tuple[int, int]) -> bytes:
    """A PNG of tens of megapixels in tens of kilobytes (encoded once: that takes a while)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", size).save(buffer, "PNG")
    return buffer.getvalue()


def _image_bytes(rng: random.Random) -> bytes:
    """An encoded image, often broken: corrupted, truncated, another format, a bomb, or noise."""
    kind = rng.randrange(7)
    pixels = image_pixels(rng.randrange(3), rng.randrange(2**31), (rng.randint(8, 48), rng.randint(8, 48)))
    data = encode(pixels, rng.choice(["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF"]))
    if kind == 0:
        return data[: rng.randrange(len(data))]
    if kind == 1:
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 20)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return bytes(flipped)
    if kind == 2:
        return encode(pixels, rng.choice(["ICO", "PPM", "TGA", "PCX"]))
    if kind == 3:
        return _bomb(rng.choice([(6400, 9000), (9000, 7000)]))
    if kind == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    return data


def valid_image_body(rng: random.Random, path: str) -> tuple[bytes, dict[str, str]]:
    import base64

    blobs = [_image_bytes(rng) for _ in range(rng.randint(1, 3))]
    texts = [base64.b64encode(b).decode() for b in blobs]
    if rng.random() < 0.1:
        texts[0] = rng.choice(["***", "", "QUJD=", texts[0][:-3]])
    if "/v1/" in path:
        return json.dumps({"instances": [{"image_bytes": {"b64": t}} for t in texts]}).encode(), {}
    if rng.random() < 0.5:
        raw = b"".join(len(b).to_bytes(4, "little") + b for b in blobs)
        if rng.random() < 0.2:
            raw = raw[: rng.randrange(len(raw) + 1)]
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "image",
                        "shape": [len(blobs)],
                        "datatype": "BYTES",
                        "parameters": {"binary_data_size": len(raw)},
                    }
                ]
            }
        ).encode()
        return header + raw, {"Inference-Header-Content-Length": str(len(header))}
    return json.dumps(
        {"inputs": [{"name": "image", "shape": [len(blobs)], "datatype": "BYTES", "data": texts}]}
    ).encode(), {}


def mutate(rng: random.Random, body: bytes) -> bytes:
    kind = rng.randrange(8)
    if kind == 0 and body:
        return body[: rng.randrange(len(body))]
    if kind == 1 and body:
        data = bytearray(body)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 2:
        depth = rng.randint(100, 50_000)
        return ('{"%s": ' % rng.choice(["inputs", "instances", "id"]) + "[" * depth + "]" * depth + "}").encode()
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if kind == 4:
        return body.replace(b"32", str(rng.choice([-1, 0, 33, 2**63, 10**30])).encode(), 1)
    if kind == 5:
        return body.replace(b'"FP32"', json.dumps(rng.choice(["INT8", "BYTES", 3, None, "fp32"])).encode(), 1)
    if kind == 6 and rng.random() < 0.3:
        return b" " * rng.randint(2**20 + 1, 3 * 2**20)  # over the 1 MB limit
    return body


def fuzz(server: Server, exported_dir, eager, count: int, seed: int) -> tuple[dict[int, int], dict[int, int]]:
    """Statuses of all requests, and of those that carried images."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    image_statuses: dict[int, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    for i in range(count):
        # Most requests are inferences (where the parsing is); the rest go anywhere.
        method, path = ("POST", rng.choice(INFER)) if rng.random() < 0.6 else (rng.choice(METHODS), rng.choice(PATHS))
        if rng.random() < 0.2:
            method, path = "POST", rng.choice(IMAGE_INFER)
        image = path in IMAGE_INFER
        body, headers = valid_image_body(rng, path) if image else valid_body(rng, path)
        if rng.random() < (0.2 if image else 0.7):
            body = mutate(rng, body)
        if rng.random() < 0.2:
            headers["Content-Type"] = rng.choice(["text/plain", "application/octet-stream", "\u00ff/\u00ff"])
        try:
            conn.request(method, path, body=None if method in ("GET", "HEAD") else body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except (ConnectionError, TimeoutError, http.client.HTTPException) as exc:
            pytest.fail(f"request {i} ({method} {path}, {len(body)} bytes, seed {seed}): {type(exc).__name__}: {exc}")
        assert response.status < 500, f"request {i} ({method} {path}, seed {seed}): {response.status} {payload[:300]!r}"
        if response.status >= 400 and method != "HEAD":
            assert json.loads(payload)["error"], payload
        statuses[response.status] = statuses.get(response.status, 0) + 1
        if image:
            image_statuses[response.status] = image_statuses.get(response.status, 0) + 1
        if response.getheader("Connection", "").lower() == "close":
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    conn.close()
    rows = np.random.default_rng(seed).normal(size=(3, 32)).astype(np.float32)
    status, payload, _ = server.request("POST", "/v1/models/tiny:predict", json.dumps({"instances": rows.tolist()}))
    assert status == 200
    np.testing.assert_allclose(np.asarray(json.loads(payload)["predictions"]), eager_rows(eager, rows), atol=1e-5)
    return statuses, image_statuses


@pytest.fixture(scope="module")
def fuzz_server(exported, image_exported):
    srv = Server([exported[0], image_exported[0]], "--max-body-mb", "1")
    yield srv
    assert srv.stop() == 0


def test_live_fuzz_500_requests(fuzz_server, exported):
    statuses, images = fuzz(fuzz_server, *exported, count=500, seed=1)
    assert sum(statuses.values()) == 500 and statuses.get(200, 0) > 20 and 413 in statuses and 400 in statuses
    assert images.get(200, 0) >= 5 and images.get(400, 0) >= 20


@pytest.mark.slow
def test_live_fuzz_5000_requests(fuzz_server, exported):
    statuses, _ = fuzz(fuzz_server, *exported, count=5000, seed=2)
    assert sum(statuses.values()) == 5000
