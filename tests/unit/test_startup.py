"""Start-up pays only for what it uses: which top-level modules each command imports.

Each case runs in a fresh interpreter and reports ``sys.modules`` after the command (or the
import) is done: a test of the import graph, not of time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, sys
    what, args = sys.argv[1], sys.argv[2:]
    code = None
    if what == "cli":
        from torchkeel.cli.main import main
        try:
            code = main(args)
        except SystemExit as exc:  # --version and --help exit through argparse
            code = exc.code
    else:
        __import__(what)
    print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
""")


def imported(what: str, *args: str, cwd=None) -> tuple[object, set[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, what, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["code"], set(report["modules"])


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def torchkeel_packages(modules: set[str]) -> set[str]:
    return {m.split(".")[1] for m in modules if m.startswith("torchkeel.") and m.count(".") >= 1}


def test_keel_version_imports_neither_torch_nor_the_library():
    code, modules = imported("cli", "--version")
    assert code == 0
    assert "torch" not in top_level(modules) and "numpy" not in top_level(modules)
    assert torchkeel_packages(modules) <= {"cli", "errors", "_version", "_lazy"}


def test_keel_lint_reads_source_without_importing_torch(tmp_path):
    (tmp_path / "train.py").write_text("import torch\nfor x in range(3):\n    loss = x\n")
    code, modules = imported("cli", "lint", str(tmp_path / "train.py"), cwd=tmp_path)
    assert code in (0, 1)
    assert "torch" not in top_level(modules)
    assert "torchkeel.lint" in modules and not torchkeel_packages(modules) & {"train", "diagnose", "data", "serve"}


@pytest.mark.parametrize("module", ["torchkeel.serve.grpc", "torchkeel.serve.app", "torchkeel.cli.serve"])
def test_serving_imports_no_training_diagnose_or_lint_code(module):
    _, modules = imported(module)
    assert "torchkeel.serve" in modules
    assert not torchkeel_packages(modules) & {"train", "diagnose", "lint", "report", "demo"}


def test_import_torchkeel_alone_loads_nothing_and_names_resolve_on_use():
    _, modules = imported("torchkeel")
    assert "torch" not in top_level(modules)
    assert torchkeel_packages(modules) <= {"_version", "_lazy"}
    import torchkeel

    assert torchkeel.Trainer.__module__ == "torchkeel.train.trainer"
    assert set(torchkeel.__all__) <= set(dir(torchkeel))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        torchkeel.Nope  # noqa: B018
