"""Does a replica answer at full speed from the moment it says ready? ``keel serve`` with its
warm-up (one batch of every warm-up size, then warm-up requests, before ready) against
``--warmup-batch-sizes none``.

Not a test: it prints figures. Each round starts a fresh server on 127.0.0.1, waits for
``/v2/health/ready``, then sends the first 100 requests and 1,000 more at concurrency 8 (KServe
v1, one sample each): the first pass. Then it does the same again on the same server, now
warm by any measure: the second pass, the control. Figures, as medians over the rounds:

- the goal's figure: p99 of the first 100 requests / p99 of the last 1,000 (steady), first pass.
  Goal with warm-up: ≤ 1.5;
- the same figure of the second pass: what the measurement gives for a server that has nothing
  left to warm (eight fresh connections starting to send);
- cold start: p99 of the first pass's first 100 / p99 of the second pass's first 100, which
  leaves the client's own start out: 1.0 is a replica as fast at its first request as after
  2,200.

The eight clients start 0.3 ms apart: sent at the same instant, eight requests on eight fresh
connections had a p99 1.4x to 1.9x the steady one on a server warm by any measure (the second
pass), a burst the figure could not see past. The client is kept from measuring itself: its
keep-alive connections open before the clock starts (as a load balancer's pool), one
unmeasured round first runs its own code paths, and its garbage collector is frozen before
each pass (a full collection of this process, which holds torch, stalls every client thread for
milliseconds — at a moment that falls in the first 100).
TorchScript exports of bench/serve.py's small and wide MLPs.

    python bench/serve_warmup.py [--rounds 8] [--models small,wide]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve import export_model, free_port, launch  # noqa: E402

CONCURRENCY, FIRST, STEADY = 8, 100, 1000
STAGGER_S = 0.0003
"""Client i sends its first request i x this after the start (2.1 ms for the last, about one
median latency of the small model): a load balancer's requests reach a new replica when they
come, not as one burst of eight at the same instant."""


def latencies(port: int, count: int) -> list[float]:
    """``count`` single-sample v1 requests at concurrency 8; their latencies in seconds, in order sent."""
    bodies = [json.dumps({"instances": [np.random.default_rng(i).normal(size=64).tolist()]}) for i in range(64)]
    results: list[tuple[float, float]] = []
    lock, next_index = threading.Lock(), [0]
    # Connected before the clock starts, as a load balancer's pool is: the figure is requests, not TCP handshakes.
    connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(CONCURRENCY)]
    for connection in connections:
        connection.connect()
    start_together = threading.Barrier(CONCURRENCY)

    def client(connection: http.client.HTTPConnection, delay: float) -> None:
        start_together.wait()
        time.sleep(delay)
        while True:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= count:
                break
            start = time.perf_counter()
            connection.request("POST", "/v1/models/bench:predict", bodies[index % 64])
            response = connection.getresponse()
            response.read()
            assert response.status == 200, response.status
            with lock:
                results.append((start, time.perf_counter() - start))
        connection.close()

    threads = [threading.Thread(target=client, args=(c, i * STAGGER_S)) for i, c in enumerate(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [latency for _, latency in sorted(results)]


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def round_trip(export_dir: Path, warm: bool) -> tuple[float, float, float]:
    """One fresh server, two passes: the goal's figure, the control's, and the cold start."""
    port = free_port()
    args = ["-m", "torchkeel.cli.main", "serve", str(export_dir), "--port", str(port), "--grpc-port", "0"]
    proc = launch([*args, *([] if warm else ["--warmup-batch-sizes", "none"])], port)
    try:
        passes = []
        for _ in range(2):
            gc.collect()
            gc.freeze()
            passes.append(latencies(port, FIRST + STEADY))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    first, again = (p99(seen[:FIRST]) for seen in passes)
    steady, steady_again = (p99(seen[-STEADY:]) for seen in passes)
    return first / steady, again / steady_again, first / again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--models", default="small,wide")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            export_dir = export_model(Path(root), name)
            round_trip(export_dir, True)  # unmeasured: the client's own first run
            figures: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for _ in range(args.rounds):
                for warm in (True, False):  # alternating, so drift hits both
                    figures[warm].append(round_trip(export_dir, warm))
            for warm, label in ((True, "warm-up (default)"), (False, "--warmup-batch-sizes none")):
                goal, control, cold = (statistics.median(column) for column in zip(*figures[warm]))
                print(
                    f"{name:6s} {label:26s} p99(first {FIRST}) / p99(steady): {goal:.2f} (max "
                    f"{max(f[0] for f in figures[warm]):.2f}; goal with warm-up <= 1.5), on the warm "
                    f"second pass {control:.2f}; cold start {cold:.2f}"
                )


if __name__ == "__main__":
    main()
