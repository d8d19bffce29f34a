"""Docs that stay true: every config key is documented, and the README's code runs."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import torchkeel as tk
from torchkeel.config.schema import KeelConfig

ROOT = Path(__file__).resolve().parents[2]


def config_keys(cls=KeelConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        # a section (``train.ema``), or an optional one (``model.hf``: ``HFModelConfig | None``)
        tp = hints[f.name]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
        section = next((t for t in (tp, *options) if dataclasses.is_dataclass(t)), None)
        if section is not None:
            yield from config_keys(section, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.metadata.get('key', f.name)}"


def test_every_config_key_is_in_docs_config_md():
    documented = set(
        re.findall(r"^\| `([a-z_.]+)` \|", (ROOT / "docs" / "config.md").read_text().split("## Run files")[0], re.M)
    )
    keys = set(config_keys())
    assert len(keys) > 25
    assert keys - documented == set(), "undocumented keys"
    assert documented - keys == set(), "documented keys that do not exist"


def test_every_public_name_is_in_docs_api_md():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in tk.__all__ if not name.startswith("_") and f"`{name}" not in text]
    assert missing == []


def test_readme_python_block_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    code = blocks[0].replace("/tmp/torchkeel-readme", str(tmp_path))
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("completed ")


def test_readme_quickstart_is_the_two_commands():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^make (\w+)", quickstart, re.M)
    assert commands == ["demo", "test"]


def test_every_diagnose_id_and_lint_rule_is_documented():
    from torchkeel.diagnose.findings import FINDING_IDS
    from torchkeel.lint import RULES

    diagnose = (ROOT / "docs" / "diagnose.md").read_text()
    assert [i for i in FINDING_IDS if f"| `{i}` |" not in diagnose] == []
    lint = (ROOT / "docs" / "lint.md").read_text()
    assert [c for c in RULES if f"| `{c}` |" not in lint] == []
