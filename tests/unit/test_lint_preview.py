"""Preview rules (issue 55): a rule not yet measured precise on public code runs only when asked
for, with ``--preview`` or by its whole code in ``--select``; the docs' tables say which set each
rule is in, as the code does."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from torchkeel.cli.main import main
from torchkeel.lint import PREVIEW, RULES, lint_paths, select_rules

ROOT = Path(__file__).resolve().parents[2]

# TK112 (default set): `model.eval` never called. TK134 (preview): an accumulated loss never divided.
SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Dropout(0.1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4, 2), torch.randn(4, 1))] * 8
accum = 4
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
model.eval
"""


def codes(path: Path, **kwargs) -> list[str]:
    return sorted({f.code for f in lint_paths([str(path)], **kwargs).findings})


def test_preview_rules_run_only_with_preview_or_their_whole_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    assert "TK134" in PREVIEW and "TK112" not in PREVIEW
    assert codes(script) == ["TK112"]
    assert codes(script, preview=True) == ["TK112", "TK134"]
    assert codes(script, select=["TK134"]) == ["TK134"]  # asked for by name
    assert codes(script, select=["TK13"]) == []  # a prefix does not choose a preview rule
    assert codes(script, select=["TK1"]) == ["TK112"]
    assert codes(script, select=["TK13"], preview=True) == ["TK134"]
    assert codes(script, preview=True, ignore=["TK134"]) == ["TK112"]


def test_select_rules_default_set_is_every_rule_outside_preview():
    assert PREVIEW <= set(RULES)
    assert {r.code for r in select_rules()} == set(RULES) - PREVIEW
    assert {r.code for r in select_rules(preview=True)} == set(RULES)
    assert [r.code for r in select_rules(iter(["TK134"]))] == ["TK134"]  # any iterable, read once


def test_cli_preview_flag(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    assert main(["lint", "--json", str(script)]) == 1  # TK112 is an error
    assert [f["code"] for f in json.loads(capsys.readouterr().out)["findings"]] == ["TK112"]
    main(["lint", "--json", "--preview", str(script)])
    assert sorted(f["code"] for f in json.loads(capsys.readouterr().out)["findings"]) == ["TK112", "TK134"]
    assert main(["lint", "--json", "--select", "TK134", str(script)]) == 0  # TK134 is a warning
    assert [f["code"] for f in json.loads(capsys.readouterr().out)["findings"]] == ["TK134"]


def _sets_in(table_head: str) -> dict[str, str]:
    """``{code: "default" | "preview"}`` from the docs/lint.md table that starts with ``table_head``."""
    text = (ROOT / "docs" / "lint.md").read_text()
    table = text[text.index(table_head) :].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `(TK\d+)` \| (default|preview) \|", table, re.M))


def test_docs_say_which_set_each_rule_is_in():
    expected = {code: "preview" if code in PREVIEW else "default" for code in RULES}
    assert _sets_in("| code | set |") == expected
    assert _sets_in("| rule | set | trees |") == expected
