"""``keel diagnose`` as a tool: it does not change what the script computes, it keeps the script's
own errors and exit status, it stops where asked, and it reports torch.compile breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
from diagcorpus import CORPUS, KEEL, diagnose

from torchkeel.diagnose.detectors import judge
from torchkeel.diagnose.findings import Finding, order_findings
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.repro import first_difference
from torchkeel.diagnose.runner import ScriptOutcome

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "diagnose.schema.json").read_text())

# Dropout, batch norm, a shuffled DataLoader and Adam: every RNG and buffer the probe must not
# disturb. From step 4 one batch carries a NaN, so the probe's replays and anomaly checks run too.
RECORDING = """
import json, sys
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(96, 6)
if "--nan" in sys.argv:
    x[70, 2] = float("nan")
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for xb, yb in DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    opt.step()
    losses.append(repr(loss.item()))
json.dump({"losses": losses, "weight": repr(model[0].weight.sum().item())}, open(sys.argv[1], "w"))
"""


def plain_run(script: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(script), *args],
        check=True,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        timeout=120,
    )


@pytest.mark.parametrize("flag", [(), ("--nan",)], ids=["healthy", "goes-nan"])
def test_same_results_as_an_uninstrumented_run(tmp_path, flag):
    script = tmp_path / "train.py"
    script.write_text(RECORDING)
    plain_run(script, str(tmp_path / "plain.json"), *flag)
    report, _, _ = diagnose("train.py", "--no-repro", cwd=tmp_path, args=(str(tmp_path / "probed.json"), *flag))
    assert json.loads((tmp_path / "plain.json").read_text()) == json.loads((tmp_path / "probed.json").read_text())
    jsonschema.validate(report, SCHEMA)
    if flag:
        assert report["findings"][0]["id"] == "nonfinite-input"
        assert report["findings"][0]["evidence"]["features"] == [2]
    else:
        assert report["findings"] == []


def test_the_scripts_own_error_still_happens_and_is_reported(tmp_path):
    report, code, _ = diagnose("inplace_sigmoid.py", "--no-repro")
    assert code == 1
    error = report["script"]["error"]
    assert report["script"]["exit_status"] == 1 and error["type"] == "RuntimeError"
    assert "inplace" in error["message"] and error["file"] == "inplace_sigmoid.py"
    assert report["findings"][0]["id"] == "inplace-modified"


def test_exit_status_stdout_and_stop_after_steps(tmp_path):
    (tmp_path / "s.py").write_text(
        textwrap.dedent("""
        import sys, torch
        print("hello from the script")
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(50):
            opt.zero_grad()
            model(torch.randn(4, 2)).pow(2).mean().backward()
            opt.step()
        sys.exit(3)
    """)
    )
    report, code, _ = diagnose("s.py", "--no-repro", cwd=tmp_path)
    assert code == 0 and report["script"]["exit_status"] == 3 and report["steps"] == 50
    assert "hello from the script" in diagnose.last_stderr
    report, _, _ = diagnose("s.py", "--no-repro", "--steps", "7", cwd=tmp_path)
    assert report["steps"] == 7 and "--steps" in report["script"]["stopped"]
    assert report["script"]["exit_status"] == 0


def test_timeout_stops_a_script_that_never_ends(tmp_path):
    (tmp_path / "forever.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    report, code, elapsed = diagnose("forever.py", "--timeout", "1.5", cwd=tmp_path)
    assert "--timeout" in report["script"]["stopped"] and code == 0 and elapsed < 30


def test_usage_errors_exit_2_without_traceback(tmp_path):
    for argv in (
        ["diagnose", "--", "python", "missing.py"],
        ["diagnose", "--", "python"],
        ["diagnose", "--steps", "0", "--", "python", "x.py"],
    ):
        proc = subprocess.run([*KEEL, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, argv
        assert proc.stderr.startswith("keel: error:") and "Traceback" not in proc.stderr


def test_human_report_names_the_finding_and_the_fix():
    proc = subprocess.run(
        [*KEEL, "diagnose", "--no-repro", "--", "python", "double_step_accum.py"],
        cwd=CORPUS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "1. [error] double-step:" in proc.stdout and "fix:" in proc.stdout


GRAPH_BREAK = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 0:
            h = h * 2
        return h.relu()


torch.manual_seed(0)
model = Net()
if "--compiled" in __import__("sys").argv:
    model = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    opt.zero_grad()
    model(torch.randn(4 + step, 8)).sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("compiled", [False, True], ids=["forced-by-flag", "compiled-by-script"])
def test_compile_reports_graph_breaks_and_recompiles(tmp_path, compiled):
    (tmp_path / "net.py").write_text(GRAPH_BREAK)
    report, _, _ = diagnose("net.py", "--compile", "--no-repro", cwd=tmp_path, args=("--compiled",) if compiled else ())
    jsonschema.validate(report, SCHEMA)
    assert report["script"]["error"] is None
    breaks = [f for f in report["findings"] if f["id"] == "graph-break"]
    assert breaks and breaks[0]["evidence"]["file"] == "net.py" and breaks[0]["evidence"]["line"] == 13
    assert "item()" in breaks[0]["message"]
    if compiled:
        assert any(f["id"] == "recompile" and "size mismatch" in f["message"] for f in report["findings"])


def test_a_script_that_compiles_runs_unchanged_without_the_flag(tmp_path):
    (tmp_path / "net.py").write_text(GRAPH_BREAK)
    report, code, _ = diagnose("net.py", "--no-repro", cwd=tmp_path, args=("--compiled",))
    assert report["script"]["error"] is None and code == 0


def test_first_difference_treats_nan_as_equal():
    nan = float("nan")
    assert first_difference([1.0, nan, 2.0], [1.0, nan, 2.0]) is None
    assert first_difference([1.0, nan, 2.0], [1.0, nan, 2.5]) == 2


def test_order_puts_errors_first_then_the_root_cause():
    f = [
        Finding("leaked-graph", "error", "m", {}, "x"),
        Finding("dataloader-bottleneck", "warning", "m", {}, "x"),
        Finding("nonfinite-input", "error", "m", {}, "x"),
    ]
    assert [x.id for x in order_findings(f)] == ["nonfinite-input", "leaked-graph", "dataloader-bottleneck"]


def test_consequences_are_dropped_and_a_bare_error_is_reported():
    facts = Facts(steps=3, backward_calls=3)
    facts.grad_norms = [
        {"step": s, "optimizer": 0, "layers": {"m": v}, "total": v} for s, v in ((1, 1.0), (2, 1e3), (3, 1e7))
    ]
    facts.events["zero-grad-checks"] = [
        {"step": s, "optimizer": "SGD", "optimizer_index": 0, "param": "m.weight"} for s in (2, 3)
    ]
    outcome = ScriptOutcome("s.py", [])
    assert [f.id for f in judge(facts, outcome)] == ["missing-zero-grad"]
    facts.events.clear()
    assert [f.id for f in judge(facts, outcome)] == ["grad-exploding"]
    outcome.error = {"type": "ValueError", "message": "bad", "file": "s.py", "line": 3, "traceback": ""}
    assert [f.id for f in judge(Facts(), outcome)] == ["script-error"]


def test_uninitialized_memory_is_no_ops_doing():
    """``torch.empty`` returns what the memory held — NaN from a freed tensor, often — and
    ``nn.Linear`` then initializes it: no non-finite op to report (it once hid the data's NaN)."""
    import torch

    from torchkeel.diagnose.tracing import FirstNonfiniteOp, allocates_uninitialized

    assert allocates_uninitialized(torch.empty) and allocates_uninitialized(torch.empty_like)
    assert not allocates_uninitialized(torch.full) and not allocates_uninitialized(torch.log)
    poisoned = torch.full((4096,), float("nan"))
    del poisoned
    with FirstNonfiniteOp() as tracer:
        reused = torch.empty(4096)
        reused.zero_()
    assert tracer.found is None
    with FirstNonfiniteOp() as tracer:
        torch.log(torch.zeros(3) - 1)
    assert tracer.found is not None and tracer.found["op"] == "torch.log"


def test_looking_at_a_view_autograd_refuses_to_describe_does_not_break_the_script(tmp_path):
    """A view made under no_grad of a parameter then changed in place raises on ``.grad_fn``
    (transformers' embeddings with a padding index make one while they initialise): the probe's
    own look must not raise into the script, which runs as it does without the probe."""
    script = tmp_path / "views.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            weight = torch.nn.Parameter(torch.zeros(3, 4))
            with torch.no_grad():
                row = weight[0]
                weight.mul_(2)
                row.fill_(1.0)
            model = torch.nn.Embedding(10, 4, padding_idx=0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                opt.zero_grad()
                model(torch.tensor([[1, 2, 0]])).sum().backward()
                opt.step()
            print("trained")
            """
        )
    )
    report, code, _ = diagnose("views.py", "--no-repro", cwd=tmp_path)
    assert report["script"]["error"] is None and code == 0
    assert report["steps"] == 3


def test_dataloader_bottleneck_is_a_warning_only_when_data_takes_twice_the_compute():
    from torchkeel.diagnose.input_detectors import dataloader_bottleneck
    from torchkeel.diagnose.probe import Facts
    from torchkeel.diagnose.runner import ScriptOutcome

    def judged(wait_s: float) -> list:
        loader = {"dataset_class": "MNIST", "num_workers": 0, "batches": 150, "wait_s": wait_s}
        facts = Facts(data={"loaders": [loader], "wait_s": wait_s, "loop_s": 1.5})
        return [(x.id, x.severity) for x in dataloader_bottleneck(facts, ScriptOutcome("t.py", []))]

    assert judged(0.84) == [("dataloader-bottleneck", "info")]  # 56 %: as long as the compute
    assert judged(1.3) == [("dataloader-bottleneck", "warning")]  # 87 %
    assert judged(0.5) == []


def test_a_layer_called_from_a_models_method_is_named_inside_the_model():
    import torch
    from torch import nn

    from torchkeel.diagnose.probe import Probe

    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc4 = nn.Linear(4, 2), nn.Linear(2, 4)

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return self.fc4(z)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decode(self.fc1(x))

    model = VAE()
    with Probe(anomaly_steps=0) as probe:
        model(torch.randn(3, 4))
        model.decode(torch.randn(3, 2))  # sampling: fc4 runs outside any forward
        names = {label for _, label in probe.state.roots.values()}
        assert names == {"model", "model.fc4"}
        assert probe.param_names()[id(model.fc4.weight)] == "model.fc4.weight"
