"""Serving throughput, latency and CPU on loopback: ``keel serve`` (dynamic batching) against an
unbatched baseline (a plain ASGI endpoint calling the same model once per request), and keel's
gRPC against its own REST.

Not a test: it prints figures. Each server process is pinned to core 0, the load generator to
core 1 (on a machine with fewer than 2 cores nothing is pinned). TorchScript models, each
exported with parity checked:

- "small" (MLP 64→256→256→10, where HTTP overhead dominates) and "wide" (MLP 64→4096→4096→10,
  whose batch-1 forward is slow next to the HTTP overhead, so batching matters): single-sample
  KServe v1 requests against the baseline;
- "image" (a small CNN on 3×224×224, exported with its preprocess): one 224×224 JPEG per KServe
  v1 ``image_bytes`` request, top-5 labels back, against a plain endpoint that decodes,
  normalizes and runs the same model per request on its event loop;
- "grpc": the small MLP through keel's gRPC (``ModelInfer``, raw contents, one channel) against
  keel's REST v2 with binary tensors, one sample per request.

Bounded load at concurrency 1, 8 and 64, a fixed number each, the two servers (or protocols) in
alternating rounds. Server CPU per request is read from /proc/PID/stat around each round.

- "fastapi-async" and "fastapi": the small MLP against FastAPI baselines as users write them: an
  ``async def`` endpoint that parses the JSON itself and runs the model inline, and a pydantic
  body with a plain ``def`` endpoint (``pip install fastapi``; "fastapi" is not run by default).

Goals: keel / baseline req/s ≥ 1.0 at concurrency 1, 8 and 64 on the small model and against
the FastAPI endpoints (≥ 1.5 at 64), ≥ 4 at 64 on the wide model, ≥ 1.0 at 1 and ≥ 2 at 64 on
images; server CPU per request at concurrency 1 ≤ 1.1× the baseline's; gRPC / REST binary
req/s ≥ 1.0 at every concurrency. Each ratio line also gives the ratio of every round (the two
servers measured back to back), which shows how much a shared machine moved the figures.

    python bench/serve.py [--requests 1500] [--rounds 2] [--models small,fastapi-async,wide,image,grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
THREADS = 1  # both servers run the model on one thread, on their one core
SERVER_CORE, LOAD_CORE = 0, 1
CONCURRENCY = (1, 8, 64)


class SmallMLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


class BigMLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))


class SmallCNN(nn.Sequential):
    """A VGG-style small CNN (6.5M parameters): three strided convolutions, then a fully connected
    head. On a CPU the convolutions cost the same per image at any batch size; the head is
    memory-bound at batch 1 (it reads its 26 MB of weights per call) and cheap per image in a batch."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 16, 4, stride=4),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 14 * 14, 1024),
            nn.ReLU(),
            nn.Linear(1024, 10),
        )


MODELS = {
    "small": "SmallMLP",
    "wide": "BigMLP",
    "image": "SmallCNN",
    "grpc": "SmallMLP",
    "fastapi": "SmallMLP",
    "fastapi-async": "SmallMLP",
}
PREPROCESS = {"mode": "RGB", "resize": 224, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
LABELS = [f"class-{i}" for i in range(10)]


def make_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:64], y[:64])


def jpeg(seed: int) -> bytes:
    """A 224×224 photo-like JPEG: smooth gradients and a little noise (about 10 kB)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:224, 0:224]
    channels = [np.sin(xx / rng.uniform(8, 40) + rng.uniform(0, 6)) + np.cos(yy / rng.uniform(8, 40)) for _ in range(3)]
    pixels = np.stack(channels, -1) * 60 + 128 + rng.normal(0, 6, (224, 224, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


class _Jpegs(torch.utils.data.Dataset):
    classes = LABELS

    def __init__(self, n: int) -> None:
        self.items = [(jpeg(i), i % 10) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def make_images():
    return _Jpegs(16), _Jpegs(8)


def baseline_app(export_dir: str):
    """The unbatched baseline: Starlette + uvicorn, one forward per KServe v1 request, on the event loop."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    model = torch.jit.load(str(Path(export_dir) / "model.pt")).eval()

    async def predict(request: Request) -> JSONResponse:
        doc = json.loads(await request.body())
        x = torch.tensor(doc["instances"], dtype=torch.float32)
        with torch.inference_mode():
            out = model(x)
        return JSONResponse({"predictions": out.tolist()})

    return Starlette(
        routes=[
            Route("/v1/models/bench:predict", predict, methods=["POST"]),
            Route("/v2/health/ready", lambda r: JSONResponse({})),
        ]
    )


def fastapi_baseline_app(export_dir: str):
    """The unbatched baseline as a FastAPI user writes it: a pydantic body, a plain ``def``
    endpoint (run on FastAPI's thread pool), one forward per request. Needs ``pip install fastapi``."""
    from fastapi import FastAPI
    from pydantic import BaseModel

    model = torch.jit.load(str(Path(export_dir) / "model.pt")).eval()
    app = FastAPI()

    class Instances(BaseModel):
        instances: list[list[float]]

    def predict(body: Instances) -> dict:
        with torch.inference_mode():
            out = model(torch.tensor(body.instances, dtype=torch.float32))
        return {"predictions": out.tolist()}

    predict.__annotations__["body"] = Instances  # this module's annotations are strings; FastAPI needs the class
    app.post("/v1/models/bench:predict")(predict)

    @app.get("/v2/health/ready")
    def ready() -> dict:
        return {}

    return app


def fastapi_async_baseline_app(export_dir: str):
    """The unbatched baseline as a FastAPI user writes it for speed: an ``async def`` endpoint that
    parses the JSON body itself and runs the model inline, on the event loop. Needs ``pip install fastapi``."""
    from fastapi import FastAPI, Request

    model = torch.jit.load(str(Path(export_dir) / "model.pt")).eval()
    app = FastAPI()

    async def predict(request: Request) -> dict:
        doc = json.loads(await request.body())
        x = torch.tensor(doc["instances"], dtype=torch.float32)
        with torch.inference_mode():
            out = model(x)
        return {"predictions": out.tolist()}

    predict.__annotations__["request"] = Request  # this module's annotations are strings; FastAPI needs the class
    app.post("/v1/models/bench:predict")(predict)

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {}

    return app


def image_baseline_app(export_dir: str):
    """The plain image endpoint: per request, decode the JPEG with Pillow, normalize it with numpy
    as torchvision's ToTensor + Normalize, run the model, answer the top-5 labels; on the event loop."""
    import base64
    import io

    from PIL import Image
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    model = torch.jit.load(str(Path(export_dir) / "model.pt")).eval()
    mean = np.asarray(PREPROCESS["mean"], np.float32)
    std = np.asarray(PREPROCESS["std"], np.float32)

    async def predict(request: Request) -> JSONResponse:
        doc = json.loads(await request.body())
        predictions = []
        for instance in doc["instances"]:
            image = Image.open(io.BytesIO(base64.b64decode(instance["image_bytes"]["b64"]))).convert("RGB")
            x = (np.asarray(image, dtype=np.float32) / 255.0 - mean) / std
            with torch.inference_mode():
                logits = model(torch.from_numpy(x.transpose(2, 0, 1).copy())[None])[0]
            probs = torch.softmax(logits.double(), 0)
            top = torch.topk(probs, 5)
            predictions.append([{"label": LABELS[i], "score": float(p)} for p, i in zip(top.values, top.indices)])
        return JSONResponse({"predictions": predictions})

    return Starlette(
        routes=[
            Route("/v1/models/bench:predict", predict, methods=["POST"]),
            Route("/v2/health/ready", lambda r: JSONResponse({})),
        ]
    )


BASELINES = {"image": image_baseline_app, "fastapi": fastapi_baseline_app, "fastapi-async": fastapi_async_baseline_app}
"""The baseline server of each case (the others: ``baseline_app``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PINNED = hasattr(os, "sched_setaffinity") and {SERVER_CORE, LOAD_CORE} <= os.sched_getaffinity(0)


def launch(args: list[str], port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(THREADS),
    }
    pin = (lambda: os.sched_setaffinity(0, {SERVER_CORE})) if PINNED else None
    proc = subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=pin
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(proc.stderr.read().decode())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def http_request(path: str, body: bytes, **headers: str) -> bytes:
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def v1_requests() -> list[bytes]:
    return [
        http_request(
            "/v1/models/bench:predict",
            json.dumps({"instances": [np.random.default_rng(i).normal(size=64).tolist()]}).encode(),
        )
        for i in range(64)
    ]


def image_requests() -> list[bytes]:
    import base64

    return [
        http_request(
            "/v1/models/bench:predict",
            json.dumps({"instances": [{"image_bytes": {"b64": base64.b64encode(jpeg(1000 + i)).decode()}}]}).encode(),
        )
        for i in range(64)
    ]


def v2_binary_requests() -> list[bytes]:
    out = []
    for i in range(64):
        x = np.random.default_rng(i).normal(size=(1, 64)).astype(np.float32).tobytes()
        header = json.dumps(
            {
                "inputs": [
                    {"name": "input", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": len(x)}}
                ],
                "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
            }
        ).encode()
        out.append(http_request("/v2/models/bench/infer", header + x, Inference_Header_Content_Length=str(len(header))))
    return out


def grpc_requests() -> list[bytes]:
    from torchkeel.serve.grpc import pb

    out = []
    for i in range(64):
        request = pb.ModelInferRequest(model_name="bench")
        request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
        request.raw_input_contents.append(np.random.default_rng(i).normal(size=(1, 64)).astype(np.float32).tobytes())
        out.append(request.SerializeToString())
    return out


def load(port: int, concurrency: int, total: int, requests: list[bytes], grpc: bool = False) -> dict[str, float]:
    """``total`` requests from ``concurrency`` keep-alive connections (gRPC: calls on one channel);
    latency percentiles.

    The load generator is a small asyncio HTTP/1.1 client with pre-encoded requests (gRPC: grpc.aio
    with pre-serialized messages), so that it takes as little CPU as it can.
    """
    return asyncio.run((_load_grpc if grpc else _load)(port, concurrency, total, requests))


async def _load_grpc(port: int, concurrency: int, total: int, requests: list[bytes]) -> dict[str, float]:
    import grpc

    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out

        async def client(i: int) -> None:
            for j in range(total // concurrency):
                start = time.perf_counter()
                await call(requests[(i + j) % 64], timeout=60)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": len(latencies) / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
        "errors": 0,
        "n": len(latencies),
    }


async def _load(port: int, concurrency: int, total: int, requests: list[bytes]) -> dict[str, float]:
    latencies: list[float] = []
    errors: list[int] = []

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for j in range(total // concurrency):
            start = time.perf_counter()
            writer.write(requests[(i + j) % 64])
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            if b" 200 " not in status_line:
                errors.append(int(status_line.split()[1]))
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": len(latencies) / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
        "errors": len(errors),
        "n": len(latencies),
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def export_model(root: Path, name: str) -> Path:
    import torchkeel as tk
    from torchkeel.export import export_run

    data = (
        [
            "data.target=serve:make_images",
            "data.num_workers=0",
            f"data.preprocess={json.dumps(PREPROCESS)}",
            "train.batch_size=8",
        ]
        if name == "image"
        else ["data.target=serve:make_data"]
    )
    config = tk.load_config(
        None,
        [
            f"out_dir={root / name}",
            "name=bench",
            f"model.target=serve:{MODELS[name]}",
            *data,
            "train.max_epochs=null",
            "train.max_steps=1",
        ],
    )
    tk.Trainer(config, progress=False).fit()
    export_dir = root / f"export-{name}"
    export_run(root / name / "bench", "torchscript", export_dir, batch_sizes=(1, 8, 64))
    return export_dir


def measure(name: str, export_dir: Path, requests: int, rounds: int) -> dict[tuple[str, int], dict[str, float]]:
    keel_port, base_port, grpc_port = free_port(), free_port(), free_port()
    keel = launch(
        [
            "-m",
            "torchkeel.cli.main",
            "serve",
            str(export_dir),
            "--port",
            str(keel_port),
            "--grpc-port",
            str(grpc_port if name == "grpc" else 0),
        ],
        keel_port,
    )
    # (process, port, pre-encoded requests, over gRPC)
    if name == "grpc":
        contenders = {
            "grpc": (keel, grpc_port, grpc_requests(), True),
            "rest": (keel, keel_port, v2_binary_requests(), False),
        }
    else:
        baseline = launch(
            [str(HERE / "serve.py"), "--baseline-server", name, str(export_dir), str(base_port)], base_port
        )
        bodies = image_requests() if name == "image" else v1_requests()
        contenders = {"keel": (keel, keel_port, bodies, False), "baseline": (baseline, base_port, bodies, False)}
    first, second = contenders
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for concurrency in CONCURRENCY:
            for round_ in range(rounds):
                for server in (first, second) if round_ % 2 == 0 else (second, first):
                    proc, port, bodies, over_grpc = contenders[server]
                    load(port, concurrency, 64, bodies, over_grpc)  # warm-up of the connections
                    cpu = cpu_seconds(proc.pid)
                    result = load(port, concurrency, requests // rounds, bodies, over_grpc)
                    result["cpu_us"] = (cpu_seconds(proc.pid) - cpu) / result["n"] * 1e6
                    runs.setdefault((server, concurrency), []).append(result)
        rss = {server: rss_mb(c[0].pid) for server, c in contenders.items()}
    finally:
        for proc in {c[0] for c in contenders.values()}:
            proc.terminate()
            proc.wait(timeout=60)
    merged = {}
    for key, rs in runs.items():
        merged[key] = {
            "rps": statistics.mean(r["rps"] for r in rs),
            "round_rps": [r["rps"] for r in rs],
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": max(r["p99_ms"] for r in rs),
            "cpu_us": statistics.mean(r["cpu_us"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
        }
    failed = {key: r["errors"] for key, r in merged.items() if r["errors"]}
    if failed:
        raise SystemExit(f"[{name}] requests failed (server, concurrency → count): {failed}")
    print(f"\n[{name}] server RSS after the load: " + ", ".join(f"{s} {mb:.0f} MB" for s, mb in rss.items()))
    print(f"{'server':10s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'CPU us/req':>10s}  errors")
    for (server, concurrency), r in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0] != first)):
        print(
            f"{server:10s} {concurrency:4d} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['cpu_us']:10.0f}  "
            f"{r['errors']}"
        )
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per concurrency level, server and model")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds the requests are split into")
    parser.add_argument("--models", default="small,fastapi-async,wide,image,grpc")
    parser.add_argument("--baseline-server", nargs=3, metavar=("MODEL", "EXPORT_DIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        import uvicorn

        name, export_dir, port = args.baseline_server
        app = BASELINES.get(name, baseline_app)(export_dir)
        uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)
        return
    if PINNED:
        os.sched_setaffinity(0, {LOAD_CORE})
    print(
        f"servers pinned to core {SERVER_CORE}, load generator to core {LOAD_CORE}"
        if PINNED
        else "cores 0 and 1 are not both usable: nothing pinned"
    )
    sys.path.insert(0, str(HERE))
    root = Path(tempfile.mkdtemp(prefix="torchkeel-bench-serve-"))
    ratios = []
    for name in args.models.split(","):
        result = measure(name, export_model(root, name), args.requests, args.rounds)
        a, b = ("grpc", "rest") if name == "grpc" else ("keel", "baseline")
        for concurrency in CONCURRENCY:
            ours, theirs = result[(a, concurrency)], result[(b, concurrency)]
            ratio = ours["rps"] / theirs["rps"]
            rounds = " ".join(f"{x / y:.2f}" for x, y in zip(ours["round_rps"], theirs["round_rps"]))
            goal = {
                ("small", 64): 1.5,
                ("wide", 64): 4.0,
                ("image", 64): 2.0,
                ("fastapi", 64): 1.5,
                ("fastapi-async", 64): 1.5,
            }.get((name, concurrency), 1.0)
            ratios.append(
                f"{name} concurrency {concurrency:2d}: {a} / {b} req/s {ratio:5.2f}x (goal >= {goal}; rounds {rounds})"
            )
        cpu = result[(a, 1)]["cpu_us"] / result[(b, 1)]["cpu_us"]
        ratios.append(
            f"{name} concurrency  1: {a} / {b} server CPU per request {cpu:5.2f}x"
            + ("" if name == "grpc" else " (goal <= 1.1)")
        )
    print()
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
