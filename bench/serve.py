"""Serving throughput, latency and CPU on loopback: ``keel serve`` (dynamic batching) against an
unbatched baseline (a plain ASGI endpoint calling the same model once per request).

Not a test: it prints figures. Each server process is pinned to core 0, the load generator to
core 1 (on a machine with fewer than 2 cores nothing is pinned). Two TorchScript models, each
exported with parity checked: "small" (MLP 64→256→256→10, where HTTP overhead dominates) and
"wide" (MLP 64→4096→4096→10, whose batch-1 forward is slow next to the HTTP overhead, so batching
matters). Bounded load: single-sample KServe v1 requests at concurrency 1, 8 and 64, a fixed
number each, the two servers in alternating rounds. Server CPU per request is read from
/proc/PID/stat around each round.

Goals: keel / baseline req/s ≥ 1.0 at concurrency 1, 8 and 64 on the small model (≥ 1.5 at 64),
≥ 4 at 64 on the wide model; server CPU per request at concurrency 1 ≤ 1.1× the baseline's.

    python bench/serve.py [--requests 1500] [--rounds 2]
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


MODELS = {"small": "SmallMLP", "wide": "BigMLP"}


def make_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:64], y[:64])


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

    return Starlette(routes=[Route("/v1/models/bench:predict", predict, methods=["POST"]),
                             Route("/v2/health/ready", lambda r: JSONResponse({}))])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PINNED = hasattr(os, "sched_setaffinity") and {SERVER_CORE, LOAD_CORE} <= os.sched_getaffinity(0)


def launch(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(THREADS)}
    pin = (lambda: os.sched_setaffinity(0, {SERVER_CORE})) if PINNED else None
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=pin)
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


def load(port: int, concurrency: int, total: int) -> dict[str, float]:
    """``total`` single-sample requests from ``concurrency`` keep-alive connections; latency percentiles.

    The load generator is a small asyncio HTTP/1.1 client with pre-encoded requests, so that it
    takes as little CPU as it can.
    """
    return asyncio.run(_load(port, concurrency, total))


async def _load(port: int, concurrency: int, total: int) -> dict[str, float]:
    requests = []
    for i in range(64):
        body = json.dumps({"instances": [np.random.default_rng(i).normal(size=64).tolist()]}).encode()
        head = (f"POST /v1/models/bench:predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3, "errors": len(errors), "n": len(latencies)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def export_model(root: Path, name: str) -> Path:
    import torchkeel as tk
    from torchkeel.export import export_run

    config = tk.load_config(None, [f"out_dir={root / name}", "name=bench", f"model.target=serve:{MODELS[name]}",
                                   "data.target=serve:make_data", "train.max_epochs=null", "train.max_steps=1"])
    tk.Trainer(config, progress=False).fit()
    export_dir = root / f"export-{name}"
    export_run(root / name / "bench", "torchscript", export_dir, batch_sizes=(1, 8, 64))
    return export_dir


def measure(name: str, export_dir: Path, requests: int, rounds: int) -> dict[tuple[str, int], dict[str, float]]:
    keel_port, base_port = free_port(), free_port()
    servers = {
        "keel": (launch(["-m", "torchkeel.cli.main", "serve", str(export_dir), "--port", str(keel_port)], keel_port),
                 keel_port),
        "baseline": (launch([str(HERE / "serve.py"), "--baseline-server", str(export_dir), str(base_port)], base_port),
                     base_port),
    }
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for concurrency in CONCURRENCY:
            for round_ in range(rounds):
                order = ("keel", "baseline") if round_ % 2 == 0 else ("baseline", "keel")
                for server in order:
                    proc, port = servers[server]
                    load(port, concurrency, 64)  # warm-up of the connections
                    cpu = cpu_seconds(proc.pid)
                    result = load(port, concurrency, requests // rounds)
                    result["cpu_us"] = (cpu_seconds(proc.pid) - cpu) / result["n"] * 1e6
                    runs.setdefault((server, concurrency), []).append(result)
        rss = {server: rss_mb(proc.pid) for server, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    merged = {}
    for key, rs in runs.items():
        merged[key] = {"rps": statistics.mean(r["rps"] for r in rs), "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                       "p99_ms": max(r["p99_ms"] for r in rs), "cpu_us": statistics.mean(r["cpu_us"] for r in rs),
                       "errors": sum(r["errors"] for r in rs)}
    failed = {key: r["errors"] for key, r in merged.items() if r["errors"]}
    if failed:
        raise SystemExit(f"[{name}] requests failed (server, concurrency → count): {failed}")
    print(f"\n[{name}] server RSS after the load: keel {rss['keel']:.0f} MB, baseline {rss['baseline']:.0f} MB")
    print(f"{'server':10s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'CPU us/req':>10s}  errors")
    for (server, concurrency), r in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0] != "keel")):
        print(f"{server:10s} {concurrency:4d} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['cpu_us']:10.0f}  "
              f"{r['errors']}")
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per concurrency level, server and model")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds the requests are split into")
    parser.add_argument("--models", default="small,wide")
    parser.add_argument("--baseline-server", nargs=2, metavar=("EXPORT_DIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        import uvicorn

        uvicorn.run(baseline_app(args.baseline_server[0]), host="127.0.0.1", port=int(args.baseline_server[1]),
                    log_level="warning", access_log=False)
        return
    if PINNED:
        os.sched_setaffinity(0, {LOAD_CORE})
    print(f"servers pinned to core {SERVER_CORE}, load generator to core {LOAD_CORE}" if PINNED
          else "cores 0 and 1 are not both usable: nothing pinned")
    sys.path.insert(0, str(HERE))
    root = Path(tempfile.mkdtemp(prefix="torchkeel-bench-serve-"))
    ratios = []
    for name in args.models.split(","):
        result = measure(name, export_model(root, name), args.requests, args.rounds)
        for concurrency in CONCURRENCY:
            ratio = result[("keel", concurrency)]["rps"] / result[("baseline", concurrency)]["rps"]
            goal = {("small", 64): 1.5, ("wide", 64): 4.0}.get((name, concurrency), 1.0)
            ratios.append(f"{name} concurrency {concurrency:2d}: keel / baseline req/s {ratio:5.2f}x (goal >= {goal})")
        cpu = result[("keel", 1)]["cpu_us"] / result[("baseline", 1)]["cpu_us"]
        ratios.append(f"{name} concurrency  1: keel / baseline server CPU per request {cpu:5.2f}x (goal <= 1.1)")
    print()
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
