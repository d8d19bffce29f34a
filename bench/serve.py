"""Serving throughput and latency on loopback: ``keel serve`` (dynamic batching) against an
unbatched baseline (a plain ASGI endpoint calling the same model once per request).

Not a test: it prints figures. Model: MLP 64→4096→4096→10 (its batch-1 forward is slow next to
the HTTP overhead, so batching matters), exported to TorchScript with parity checked. Bounded
load: single-sample requests at concurrency 1, 8 and 64, a fixed number of requests each, the
two servers alternating. Also: the raw in-process forward throughput at batch 1 and 64.
Goals: at concurrency 64, ≥ 4× the baseline's throughput; at concurrency 1, p50 within 1.5 ms.

    python bench/serve.py [--requests 1500]
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
# Both servers run the model on one thread: the other core is left to HTTP and the load generator.
THREADS = 1


class BigMLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))


def make_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:64], y[:64])


def baseline_app(export_dir: str):
    """The unbatched baseline: Starlette + uvicorn, one forward per request, on the event loop."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    model = torch.jit.load(str(Path(export_dir) / "model.pt")).eval()

    async def infer(request: Request) -> JSONResponse:
        doc = json.loads(await request.body())
        tensor = doc["inputs"][0]
        x = torch.tensor(tensor["data"], dtype=torch.float32).reshape(tensor["shape"])
        with torch.inference_mode():
            out = model(x)
        return JSONResponse({"outputs": [{"name": "output", "datatype": "FP32", "shape": list(out.shape),
                                          "data": out.reshape(-1).tolist()}]})

    return Starlette(routes=[Route("/v2/models/bench/infer", infer, methods=["POST"]),
                             Route("/v2/health/ready", lambda r: JSONResponse({}))])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(THREADS)}
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def load(port: int, concurrency: int, total: int) -> dict[str, float]:
    """``total`` single-sample requests from ``concurrency`` keep-alive connections; latency percentiles.

    The load generator is a small asyncio HTTP/1.1 client with pre-encoded requests, so that on
    a 2-core machine it takes as little CPU from the servers as it can.
    """
    return asyncio.run(_load(port, concurrency, total))


async def _load(port: int, concurrency: int, total: int) -> dict[str, float]:
    requests = []
    for i in range(64):
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                       "data": np.random.default_rng(i).normal(size=64).tolist()}]}).encode()
        head = (f"POST /v2/models/bench/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        requests.append(head + body)
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
    return {"rps": len(latencies) / wall, "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3, "errors": len(errors)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per concurrency level and server")
    parser.add_argument("--baseline-server", nargs=2, metavar=("EXPORT_DIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        import uvicorn

        uvicorn.run(baseline_app(args.baseline_server[0]), host="127.0.0.1", port=int(args.baseline_server[1]),
                    log_level="warning", access_log=False)
        return
    import torchkeel as tk
    from torchkeel.export import export_run

    root = Path(tempfile.mkdtemp(prefix="torchkeel-bench-serve-"))
    sys.path.insert(0, str(HERE))
    config = tk.load_config(None, [f"out_dir={root}", "name=bench", "model.target=serve:BigMLP",
                                   "data.target=serve:make_data", "train.max_epochs=null", "train.max_steps=1"])
    tk.Trainer(config, progress=False).fit()
    export_dir = root / "export"
    export_run(root / "bench", "torchscript", export_dir, batch_sizes=(1, 8, 64))

    model = torch.jit.load(str(export_dir / "model.pt")).eval()
    torch.set_num_threads(THREADS)  # as in the servers
    raw = {}
    for batch in (1, 64):
        x = torch.randn(batch, 64)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 1.0:
                model(x)
                n += batch
        raw[batch] = n / (time.perf_counter() - start)
    print(f"raw in-process forward: batch 1 {raw[1]:.0f} samples/s, batch 64 {raw[64]:.0f} samples/s "
          f"({torch.get_num_threads()} threads)")

    keel_port, base_port = free_port(), free_port()
    keel = launch(["-m", "torchkeel.cli.main", "serve", str(export_dir), "--port", str(keel_port)], keel_port)
    base = launch([str(HERE / "serve.py"), "--baseline-server", str(export_dir), str(base_port)], base_port)
    try:
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for concurrency in (1, 8, 64):
            for name, port in (("keel", keel_port), ("baseline", base_port), ("keel", keel_port), ("baseline", base_port)):
                load(port, concurrency, 64)  # warm-up of the connections
                results.setdefault((name, concurrency), []).append(load(port, concurrency, args.requests // 2))
        print(f"{'server':10s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}  errors")
        for (name, concurrency), runs in results.items():
            rps = sum(r["rps"] for r in runs) / len(runs)
            p50 = statistics.median(r["p50_ms"] for r in runs)
            p99 = max(r["p99_ms"] for r in runs)
            print(f"{name:10s} {concurrency:4d} {rps:8.0f} {p50:8.2f} {p99:8.2f}  {sum(r['errors'] for r in runs)}")
        k64 = sum(r["rps"] for r in results[("keel", 64)]) / 2
        b64 = sum(r["rps"] for r in results[("baseline", 64)]) / 2
        k1 = statistics.median(r["p50_ms"] for r in results[("keel", 1)])
        b1 = statistics.median(r["p50_ms"] for r in results[("baseline", 1)])
        print(f"concurrency 64: keel / baseline throughput {k64 / b64:.2f}x (goal >= 4)")
        print(f"concurrency 1: p50 keel {k1:.2f} ms, baseline {b1:.2f} ms, difference {k1 - b1:+.2f} ms (goal <= 1.5)")
        print(f"server RSS after the load: keel {rss_mb(keel.pid):.0f} MB, baseline {rss_mb(base.pid):.0f} MB")
    finally:
        for proc in (keel, base):
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
