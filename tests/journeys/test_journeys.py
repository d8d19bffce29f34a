"""Whole journeys, as a user takes them: data as it comes (bad samples included) → train with the
defaults (``num_workers: auto``, an empty cache) → kill -9 mid-epoch and resume → export (ONNX
and TorchScript) → serve → ask it, and a rerun.

The matrix: source {map-style, Parquet, WebDataset} × batch {``(input, target)`` for a plain
classifier, a dict for a transformers-shaped model with a strict ``forward``} × ranks {1, 2
under torchrun}. Each journey asserts:

- every epoch trains on every good sample exactly once (the model records the ids it trains on);
- the two bad samples are named (file and row, shard and key, dataset index) in
  ``incidents.jsonl`` in every epoch, whichever rank read them, and printed once per run;
- ``summary.json`` counts the completed epochs and every sample trained on;
- a run killed with SIGKILL mid-epoch and resumed with ``--resume auto`` (in the full matrix on
  an empty cache of its own) ends with the uninterrupted run's weights, bit for bit;
- a rerun (with the cache the first run filled) ends with the same weights, bit for bit;
- ONNX and TorchScript exports pass parity, and the server's answers (KServe v2, and v1 for
  the dict model) equal the eager model's within 1e-5.

Two journeys run in the default suite — Parquet × dict × 1 rank and WebDataset × pairs × 2
ranks — in a shorter form: no rerun (``tests/unit/test_reproducibility.py`` reruns runs of each
kind), the killed run uses the filled cache, the 1-rank one exports in the test's process (what
``keel export`` calls; ``tests/e2e/test_cli.py`` runs the command) and serves only its ONNX
export (the TorchScript one is run in the test's process) and the 2-rank one neither exports nor
serves. The whole matrix, in full, is ``slow`` (``make test-slow``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import journeydata
import journeymodels
import numpy as np
import pytest
import torch

from torchkeel.checkpoint import CheckpointStore
from torchkeel.checkpoint.foreign import checkpoint_weights
from torchkeel.data import PadCollate
from torchkeel.export import export_run
from torchkeel.export.formats import load_exported

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
EPOCHS, BATCH = 2, 32
SHORT = {("parquet", "dict", 1), ("webdataset", "pair", 2)}
JOURNEYS = [
    (source, batch, ranks)
    for source in ("map", "parquet", "webdataset")
    for batch in ("pair", "dict")
    for ranks in (1, 2)
]


class Journey:
    def __init__(self, root: Path, source: str, batch: str, ranks: int) -> None:
        self.root, self.source, self.batch, self.ranks = root, source, batch, ranks
        data, self.bad_names = journeydata.write(source, batch, root / "data")
        config = {
            "name": "first",
            "seed": 7,
            "model": {"target": "journeymodels:mlp" if batch == "pair" else "journeymodels:tiny_lm"},
            "data": data,
            "optim": {"lr": 3e-3},
            "train": {
                "max_epochs": EPOCHS,
                "batch_size": BATCH,
                "log_every": 8,
                "accumulate": 1 if batch == "pair" else 2,
            },
            "checkpoint": {"every_steps": 10},
            **({"loss": {"count_key": "labels", "shift_labels": True}} if batch == "dict" else {}),
        }
        (root / "cfg.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
        self.num_good = journeydata.NUM_TRAIN - len(journeydata.BAD)

    def env(self, cache: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        path = os.pathsep.join([str(HERE), str(ROOT / "tests")])
        return {**env, "PYTHONPATH": path, "XDG_CACHE_HOME": str(self.root / cache), **extra}

    def command(self, name: str, *args: str) -> list[str]:
        nproc = ["--nproc", str(self.ranks)] if self.ranks > 1 else []
        return [
            sys.executable,
            "-m",
            "torchkeel.cli.main",
            "train",
            "cfg.yaml",
            f"name={name}",
            "--no-progress",
            *nproc,
            *args,
        ]

    def train(self, name: str, cache: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return self.succeeds(self.command(name, *args), cache, **extra)

    def export(self, name: str, fmt: str, out: Path) -> dict:
        """``keel export`` of run ``name``, as a user runs it; returns its ``model.json``."""
        command = [sys.executable, "-m", "torchkeel.cli.main", "export", str(self.run_dir(name))]
        self.succeeds([*command, "--format", fmt, "--out", str(out)], "cache")
        return json.loads((out / "model.json").read_text())

    def succeeds(self, command: list[str], cache: str, **extra: str) -> subprocess.CompletedProcess:
        """``command`` in the journey's folder; it must succeed."""
        result = subprocess.run(
            command, cwd=self.root, env=self.env(cache, **extra), capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    def run_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        found, problems = CheckpointStore(self.run_dir(name) / "checkpoints").latest_valid()
        assert found is not None, problems
        return checkpoint_weights(found)

    def differences(self, name: str, other: str) -> dict[str, object]:
        """What differs between two runs' final weights: each tensor that is not bit for bit
        equal, with its largest difference, and then the two runs' logged losses, their worker
        choices and ``other``'s resume, so that a failure says where the runs parted."""
        mine, theirs = self.weights(name), self.weights(other)
        differ: dict[str, object] = {
            k: float((mine[k] - v).abs().max()) for k, v in theirs.items() if not torch.equal(mine[k], v)
        }
        if differ:
            for run in (name, other):
                rows = [json.loads(line) for line in (self.run_dir(run) / "metrics.jsonl").read_text().splitlines()]
                differ[run] = [
                    (r.get("kind"), r.get("step"), r.get("loss"), r.get("num_workers"), r.get("batch_in_epoch"))
                    for r in rows
                    if r.get("kind") in ("train", "data_workers", "resume")
                ]
        return differ

    def kill_mid_epoch_and_resume(self, name: str, cache: str) -> dict:
        """SIGKILL the whole job once a checkpoint of the first epoch is on disk and the run has
        gone on; then ``--resume auto`` to the end."""
        proc = subprocess.Popen(
            self.command(name),
            cwd=self.root,
            env=self.env(cache, JOURNEY_DELAY="0.03"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        store = self.run_dir(name) / "checkpoints"
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if (store / "step-00000010" / "manifest.json").exists():
                    time.sleep(0.5)  # a few steps past it: mid-epoch, after the checkpoint
                    break
                time.sleep(0.05)
            assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
        finally:
            kill_tree(proc.pid)
            proc.wait(timeout=60)
        resumed = self.train(name, cache, "--resume", "auto")
        rows = [json.loads(line) for line in (self.run_dir(name) / "metrics.jsonl").read_text().splitlines()]
        resume = [r for r in rows if r.get("kind") == "resume"]
        assert resume and resume[0]["epoch"] == 0 and resume[0]["batch_in_epoch"] > 0, resume
        assert "keel: resumed: step" in resumed.stderr  # said also with --no-progress
        return resume[0]

    def export_and_serve(self, name: str, serve: tuple[str, ...], keel_export: bool = True) -> None:
        """Export ONNX and TorchScript (``keel_export``: those served with ``keel export``); serve
        those in ``serve`` (the others run as a server would load them, in this process) and
        compare with the eager model."""
        eager = (journeymodels.mlp() if self.batch == "pair" else journeymodels.tiny_lm()).eval()
        eager.load_state_dict(self.weights(name))
        inputs = self.requests()
        with torch.inference_mode():
            expected = eager(*inputs.values()) if self.batch == "pair" else eager(**inputs).logits
        for fmt in ("onnx", "torchscript"):
            out = self.root / f"export-{fmt}"
            # keel export as a user runs it, or the function it calls, in this process
            by_keel = keel_export and fmt in serve
            meta = self.export(name, fmt, out) if by_keel else export_run(self.run_dir(name), fmt, out)
            assert meta["parity"]["passed"] and [i["name"] for i in meta["inputs"]] == list(inputs)
            if fmt not in serve:
                run = load_exported(fmt, out / meta["file"], list(inputs), meta["outputs"][0]["name"])
                assert np.abs(run({k: v.numpy() for k, v in inputs.items()}) - expected.numpy()).max() <= 1e-5
                continue
            with Served(out, self.env("cache")) as server:
                answer = server.v2(name, inputs)
                assert np.abs(answer - expected.numpy()).max() <= 1e-5
                if self.batch == "dict":
                    instances = [{k: v[i].tolist() for k, v in inputs.items()} for i in range(len(expected))]
                    predictions = np.asarray(
                        server.post(f"/v1/models/{name}:predict", {"instances": instances})["predictions"]
                    )
                    assert np.abs(predictions - expected.numpy()).max() <= 1e-5

    def requests(self) -> dict[str, torch.Tensor]:
        """Four validation samples as the model takes them (padded, for the dict model)."""
        if self.batch == "pair":
            x, _ = journeydata.pairs(journeydata.NUM_VAL, 2)
            return {"input": torch.from_numpy(x[:4])}
        samples = [{"input_ids": torch.from_numpy(s)} for s in journeydata.tokens(journeydata.NUM_VAL, 2)[:4]]
        return PadCollate()(samples)

    def check_exactly_once_and_bad_samples(self, name: str, ids_log: Path, stderr: str) -> None:
        ids = [int(line) for line in ids_log.read_text().split()]
        good = sorted(set(range(journeydata.NUM_TRAIN)) - set(journeydata.BAD))
        assert len(ids) == EPOCHS * self.num_good
        epochs = [ids[e * self.num_good : (e + 1) * self.num_good] for e in range(EPOCHS)]
        for epoch in epochs:
            assert sorted(epoch) == good, "an epoch did not train on every good sample exactly once"
        assert epochs[0] != epochs[1]
        summary = json.loads((self.run_dir(name) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["epochs"] == EPOCHS
        assert summary["samples"] == EPOCHS * self.num_good
        incidents = [json.loads(line) for line in (self.run_dir(name) / "incidents.jsonl").read_text().splitlines()]
        bad = [r for r in incidents if r["kind"] == "bad_sample"]
        assert sorted(r["where"] for r in bad) == sorted(self.bad_names * EPOCHS), bad
        assert summary["incidents"]["bad_sample"] == len(journeydata.BAD) * EPOCHS
        printed = [line for line in stderr.splitlines() if "skipped a bad sample" in line]
        assert len(printed) == len(journeydata.BAD), printed  # once per run, every one in incidents.jsonl


class Served:
    """``keel serve`` on 127.0.0.1 for one export, stopped with SIGTERM."""

    def __init__(self, export: Path, env: dict[str, str]) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchkeel.cli.main",
                "serve",
                str(export),
                "--port",
                str(self.port),
                "--grpc-port",
                "0",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> "Served":
        import urllib.request

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=5):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.proc.stderr.read()) from None
                time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=60)

    def post(self, path: str, body: dict) -> dict:
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def v2(self, model: str, inputs: dict[str, torch.Tensor]) -> np.ndarray:
        kinds = {torch.float32: "FP32", torch.int64: "INT64"}
        body = {
            "inputs": [
                {"name": k, "datatype": kinds[v.dtype], "shape": list(v.shape), "data": v.flatten().tolist()}
                for k, v in inputs.items()
            ]
        }
        output = self.post(f"/v2/models/{model}/infer", body)["outputs"][0]
        return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun starts its workers in sessions of
    their own), as a machine that loses power would."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    for target in reversed(found):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize(
    "journey",
    [pytest.param(j, marks=() if j in SHORT else pytest.mark.slow, id=f"{j[0]}-{j[1]}-{j[2]}rank") for j in JOURNEYS],
)
def test_a_journey(tmp_path, journey):
    is_short = journey in SHORT
    run = Journey(tmp_path, *journey)
    first = run.train("first", "cache", JOURNEY_IDS=str(tmp_path / "first.ids"))
    run.check_exactly_once_and_bad_samples("first", tmp_path / "first.ids", first.stderr)
    if not is_short:  # short: the reruns are tests/unit/test_reproducibility.py's
        run.train("rerun", "cache")  # the cache the first run filled: no worker trial this time
        assert run.differences("first", "rerun") == {}
    run.kill_mid_epoch_and_resume("killed", cache="cache" if is_short else "cache-killed")
    assert run.differences("first", "killed") == {}
    if not (is_short and run.ranks > 1):  # short: the 1-rank journey exports and serves
        run.export_and_serve(
            "first", serve=("onnx",) if is_short else ("onnx", "torchscript"), keel_export=not is_short
        )
