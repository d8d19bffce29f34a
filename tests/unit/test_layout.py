"""The size budgets of docs/architecture.md: a loop that fits a screen or two, rooms of a size
a newcomer reads in one sitting."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "torchkeel"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_trainer_is_a_loop_and_no_module_outgrows_its_budget():
    assert lines(SRC / "train" / "trainer.py") <= 300
    over = {str(p.relative_to(SRC)): lines(p) for p in SRC.rglob("*.py") if lines(p) > 450}
    assert not over, f"modules over 450 lines: {over}"
    over = {str(p.relative_to(SRC)): lines(p) for p in (SRC / "diagnose").rglob("*.py") if lines(p) > 400}
    assert not over, f"diagnose modules over 400 lines: {over}"
