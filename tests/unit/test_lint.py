"""``keel lint``: every rule fires on the bug it names and stays quiet on the correct form next to it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from torchkeel.cli.main import main
from torchkeel.diagnose.findings import FINDING_IDS
from torchkeel.lint import PARALLEL_FROM, RULES, lint_paths, lint_source, select_rules

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "lint.schema.json").read_text())

LOOP = """
import torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
"""

# code: (bad source, good source) — the good one is the fix the rule suggests.
CASES = {
    "TK101": (
        LOOP
        + """
total = 0
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    total += loss
""",
        LOOP
        + """
total = 0
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    total += loss.item()
""",
    ),
    "TK102": (
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        scale = x.abs().max().item()
        return x / scale
""",
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return x / x.abs().max()
""",
    ),
    "TK103": (
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return x + torch.zeros(x.shape[0], 1)
model = M().cuda()
""",
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return x + torch.zeros(x.shape[0], 1, device=x.device)
model = M().cuda()
""",
    ),
    "TK104": (
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x)
        h *= 2
        return h
""",
        """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x)
        h = h * 2
        return h
""",
    ),
    "TK105": (
        """
from torch.utils.data import DataLoader
loader = DataLoader(list(range(10)), num_workers=2)
for batch in loader:
    pass
""",
        """
from torch.utils.data import DataLoader
def main():
    for batch in DataLoader(list(range(10)), num_workers=2):
        pass
if __name__ == "__main__":
    main()
""",
    ),
    "TK106": (
        LOOP
        + """
for i, (x, y) in enumerate(data):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if i % 2 == 0:
        opt.step()
        opt.zero_grad()
""",
        LOOP
        + """
for i, (x, y) in enumerate(data):
    torch.nn.functional.mse_loss(model(x), y).backward()
    if i % 2 == 0:
        opt.step()
        opt.zero_grad()
""",
    ),
    "TK107": (
        LOOP
        + """
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
""",
        LOOP
        + """
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
""",
    ),
    "TK108": (
        LOOP
        + """
scaler = torch.amp.GradScaler()
for x, y in data:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""",
        LOOP
        + """
scaler = torch.amp.GradScaler()
for x, y in data:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""",
    ),
    "TK109": (
        LOOP
        + """
scaler = torch.amp.GradScaler()
for x, y in data:
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
""",
        LOOP
        + """
scaler = torch.amp.GradScaler()
for x, y in data:
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
""",
    ),
    "TK110": (
        LOOP.replace("torch.nn.Linear(2, 1)", "torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(2, 1))")
        + """
for x, y in data:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
with torch.no_grad():
    val = model(data[0][0])
""",
        LOOP.replace("torch.nn.Linear(2, 1)", "torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(2, 1))")
        + """
for x, y in data:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
model.eval()
with torch.no_grad():
    val = model(data[0][0])
""",
    ),
    "TK111": (
        """
import torch
def validate(model, loader):
    model.eval()
    total = 0.0
    for x in loader:
        total += model(x).sum().item()
    return total
""",
        """
import torch
def validate(model, loader):
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for x in loader:
            total += model(x).sum().item()
    return total
""",
    ),
    "TK112": (
        """
import torch
model = torch.nn.Dropout(0.5)
model.eval
""",
        """
import torch
model = torch.nn.Dropout(0.5)
model.eval()
""",
    ),
    "TK113": (
        """
import torch
import torch.nn.functional as F
logits = torch.randn(4, 3, requires_grad=True)
loss = F.cross_entropy(F.softmax(logits, dim=1), torch.tensor([0, 1, 2, 0]))
""",
        """
import torch
import torch.nn.functional as F
logits = torch.randn(4, 3, requires_grad=True)
loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 0]))
""",
    ),
    "TK114": (
        """
import torch
import urllib.request
path, _ = urllib.request.urlretrieve("https://example.com/model.pt")
state = torch.load(path, weights_only=False)
""",
        """
import torch
import urllib.request
path, _ = urllib.request.urlretrieve("https://example.com/model.pt")
state = torch.load(path, weights_only=True)
""",
    ),
    "TK115": (
        """
import torch
model = torch.nn.Linear(2, 1)
torch.save(model, "model.pt")
""",
        """
import torch
model = torch.nn.Linear(2, 1)
torch.save(model.state_dict(), "model.pt.tmp")
import os
os.replace("model.pt.tmp", "model.pt")
""",
    ),
    "TK116": (
        """
import torch
def save(state, path):
    torch.save(state, path)
""",
        """
import os
import torch
def save(state, path):
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
""",
    ),
    "TK117": (
        """
import os
import torch
import torch.distributed as dist
def setup():
    dist.init_process_group("nccl")
    dist.barrier()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
""",
        """
import os
import torch
import torch.distributed as dist
def setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
""",
    ),
    "TK118": (
        """
from torch.utils.data import DataLoader, DistributedSampler
def train(model, opt, dataset, epochs):
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler)
    for epoch in range(epochs):
        for batch in loader:
            opt.zero_grad()
            model(batch).sum().backward()
            opt.step()
""",
        """
from torch.utils.data import DataLoader, DistributedSampler
def train(model, opt, dataset, epochs):
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            model(batch).sum().backward()
            opt.step()
""",
    ),
    "TK119": (
        LOOP
        + """
scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
for x, y in data:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    scheduler.step()
    opt.step()
""",
        LOOP
        + """
scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
for x, y in data:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    scheduler.step()
""",
    ),
    "TK120": (
        """
import numpy as np
import torch
torch.manual_seed(0)
class Noisy(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.tensor(np.random.rand(3))
""",
        """
import torch
class Noisy(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.rand(3)
""",
    ),
    "TK121": (
        """
import torch
class Data(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.ones(3).cuda()
""",
        """
import torch
class Data(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.ones(3)
""",
    ),
    "TK122": (
        """
import torch
model = torch.nn.Linear(2, 1)
model.register_forward_hook(lambda module, args, output: print(output.shape))
out = model.forward(torch.randn(1, 2))
""",
        """
import torch
class Child(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2
model = Child(2, 1)
out = model(torch.randn(1, 2))
""",
    ),
    "TK123": (
        """
import torch
words = "a b c a".split()
vocab = {w: i for i, w in enumerate(set(words))}
torch.save(vocab, "vocab.pt")
""",
        """
import torch
words = "a b c a".split()
vocab = {w: i for i, w in enumerate(sorted(set(words)))}
torch.save(vocab, "vocab.pt")
""",
    ),
    "TK124": (
        """
from torch.utils.data import DataLoader
def main():
    return DataLoader(list(range(4)), num_workers=2, collate_fn=lambda b: b)
""",
        """
from torch.utils.data import DataLoader
def collate(batch):
    return batch
def main():
    return DataLoader(list(range(4)), num_workers=2, collate_fn=collate)
""",
    ),
    "TK125": (
        LOOP
        + """
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.zero_grad()
    opt.step()
""",
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
""",
    ),
    "TK126": (
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.step()
""",
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
""",
    ),
    "TK127": (
        LOOP
        + """
import torch.nn.functional as F
for x, y in data:
    opt.zero_grad()
    loss = F.nll_loss(F.softmax(model(x), dim=1), y.long().flatten())
    loss.backward()
    opt.step()
""",
        LOOP
        + """
import torch.nn.functional as F
for x, y in data:
    opt.zero_grad()
    loss = F.nll_loss(F.log_softmax(model(x), dim=1), y.long().flatten())
    loss.backward()
    opt.step()
""",
    ),
    "TK128": (
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
""",
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    out = model(x)
    first = torch.nn.functional.mse_loss(out, y)
    second = out.abs().mean()
    first.backward(retain_graph=True)
    second.backward()
    opt.step()
""",
    ),
    "TK129": (
        """
import torch
import torch.nn.functional as F
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(F.dropout(x, 0.5))
""",
        """
import torch
import torch.nn.functional as F
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(F.dropout(x, 0.5, training=self.training))
""",
    ),
    "TK130": (
        LOOP
        + """
opt = torch.optim.LBFGS(model.parameters(), lr=0.8)
for x, y in data:
    def closure():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
""",
        LOOP
        + """
opt = torch.optim.LBFGS(model.parameters(), lr=0.8)
for x, y in data:
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
""",
    ),
    "TK131": (
        """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
criterion = torch.nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in [(torch.randn(4, 8), torch.rand(4, 1))]:
    opt.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
""",
        """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
criterion = torch.nn.BCEWithLogitsLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in [(torch.randn(4, 8), torch.rand(4, 1))]:
    opt.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
""",
    ),
    "TK132": (
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    loss.backward()
    opt.step()
""",
        LOOP
        + """
for x, y in data:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
""",
    ),
    "TK133": (
        """
import torch
model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
def evaluate():
    model.eval()
    with torch.no_grad():
        return sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in data)
for epoch in range(3):
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    print(evaluate())
""",
        """
import torch
model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
def evaluate():
    model.eval()
    with torch.no_grad():
        return sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in data)
for epoch in range(3):
    model.train()
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    print(evaluate())
""",
    ),
    "TK134": (
        LOOP
        + """
accum = 4
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
""",
        LOOP
        + """
accum = 4
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
""",
    ),
    "TK135": (
        """
import numpy as np
import torch
data = np.sin(np.arange(100) / 20.0)
torch.save(data, open("traindata.pt", "wb"))
loaded = torch.load("traindata.pt")
""",
        """
import numpy as np
import torch
data = np.sin(np.arange(100) / 20.0)
torch.save(torch.from_numpy(data), open("traindata.pt", "wb"))
loaded = torch.load("traindata.pt", weights_only=True)
""",
    ),
}


def codes(text: str, code: str) -> list[str]:
    return [f.code for f in lint_source(textwrap.dedent(text), "case.py", select_rules([code]))]


def test_every_rule_has_a_case_and_a_valid_id():
    assert sorted(CASES) == sorted(RULES)
    assert len(RULES) >= 15
    for rule in RULES.values():
        assert rule.id is None or rule.id in FINDING_IDS
        assert rule.severity in ("error", "warning", "info")


@pytest.mark.parametrize("code", sorted(CASES))
def test_rule_fires_on_the_bug(code):
    assert code in codes(CASES[code][0], code)


@pytest.mark.parametrize("code", sorted(CASES))
def test_rule_is_quiet_on_the_fix(code):
    assert codes(CASES[code][1], code) == []


@pytest.mark.parametrize("code", sorted(CASES))
def test_fixed_forms_pass_every_rule(code):
    # The suggested fix must not trip another rule either (a fix that moves the bug is no fix).
    good = [f for f in lint_source(textwrap.dedent(CASES[code][1]), "case.py", RULES.values())]
    assert [f.code for f in good if f.code != "TK116"] == []


def test_noqa_silences_one_line_and_one_code():
    text = (
        "import torch\nstate = torch.load('https://x.org/a.pt', weights_only=False)  # keel: noqa[TK114]\n"
        "other = torch.load('https://x.org/b.pt', weights_only=False)\n"
    )
    lines = [f.line for f in lint_source(text, "x.py", RULES.values())]
    assert lines == [3]
    text = "import torch\nstate = torch.load('https://x.org/a.pt', weights_only=False)  # keel: noqa[TK101]\n"
    assert [f.code for f in lint_source(text, "x.py", RULES.values())] == ["TK114"]


def test_clean_controls_of_the_diagnose_corpus_have_no_errors():
    report = lint_paths([str(ROOT / "tests" / "diagnose" / "corpus")])
    flagged = {Path(f.path).name for f in report.findings if f.severity == "error"}
    assert not {n for n in flagged if n.startswith("clean_")}


TEMPLATE = """\
import torch
{% if cuda %}
model = model.cuda()
{% endif %}
def train({{ args }}):
    pass
"""


def test_a_file_that_is_not_python_is_skipped_and_counted_never_a_finding(tmp_path, capsys):
    """Templates with {{ }} are common in repositories: not Python, so not linted."""
    (tmp_path / "template.py").write_text(TEMPLATE)
    (tmp_path / "nul.py").write_bytes(b"import torch\x00\n")
    bad = tmp_path / "train.py"
    bad.write_text(textwrap.dedent(CASES["TK113"][0]))
    assert main(["lint", "--json", str(tmp_path)]) == 1  # the real finding still fails the run
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, SCHEMA)
    assert [f["code"] for f in out["findings"]] == ["TK113"] and out["files"] == 1
    assert sorted(Path(s["path"]).name for s in out["skipped"]) == ["nul.py", "template.py"]
    assert all(s["reason"].startswith("does not parse as Python") for s in out["skipped"])
    bad.unlink()
    assert main(["lint", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("0 finding(s) in 0 file(s); 2 skipped, not Python (first: ") and "nul.py" in last
    with pytest.raises(SyntaxError):
        lint_source("def broken(:\n", "bad.py", RULES.values())


def test_files_linted_in_parallel_give_the_report_of_one_process(tmp_path):
    for i in range(2 * PARALLEL_FROM + 3):
        code, bad_or_good = sorted(CASES)[i % len(CASES)], i % 2
        text = TEMPLATE if i % 17 == 0 else textwrap.dedent(CASES[code][bad_or_good])
        (tmp_path / f"f{i:03d}.py").write_text(text)
    one = lint_paths([str(tmp_path)], workers=1)
    two = lint_paths([str(tmp_path)], workers=2)
    assert one.findings and one.skipped
    assert (two.findings, two.files, two.skipped) == (one.findings, one.files, one.skipped)


def test_cli_json_matches_the_schema_and_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent(CASES["TK113"][0]))
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent(CASES["TK113"][1]))
    assert main(["lint", "--json", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, SCHEMA)
    assert [f["code"] for f in out["findings"]] == ["TK113"]
    assert out["findings"][0]["id"] == "probabilities-into-cross-entropy" and out["findings"][0]["line"] > 1
    assert main(["lint", "--json", "--select", "TK113", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    assert main(["lint", "--ignore", "TK113", str(bad)]) == 0


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["lint", "--select", "XX9", str(tmp_path)]) == 2
    assert "XX9" in capsys.readouterr().err


def test_pre_commit_hook_runs_keel_lint(tmp_path):
    if shutil.which("pre-commit", path=os.path.dirname(sys.executable)) is None:
        pytest.fail("pre-commit is a dev dependency: `make setup` installs it")
    repo = tmp_path / "project"
    repo.mkdir()
    (repo / "train.py").write_text(textwrap.dedent(CASES["TK113"][0]))
    (repo / "ok.py").write_text(textwrap.dedent(CASES["TK113"][1]))
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(tmp_path / "cache"),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    git = ["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    run = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "pre-commit"),
            "try-repo",
            str(ROOT),
            "keel-lint",
            "--files",
            "train.py",
            "ok.py",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "train.py" in run.stdout and "TK113" in run.stdout
    run = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "pre-commit"),
            "try-repo",
            str(ROOT),
            "keel-lint",
            "--files",
            "ok.py",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
