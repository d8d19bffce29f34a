"""``keel lint`` preview rules that stay quiet where one file shows no fault (issue 55, second
pass over the measured false findings): each form as users write it, and the fault still found."""

from __future__ import annotations

import textwrap

from torchkeel.lint import lint_source, select_rules


def found(text: str, code: str, path: str = "train.py") -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(text), path, select_rules([code])) if f.code == code]


# --- TK111: gradients turned off by the caller, or by set_grad_enabled(False) ---------------------

EVALUATOR = """
    import torch
    class Evaluator:
        def __init__(self, model, loader):
            self.model = model
            self.loader = loader

        def run_all_evals(self):
            scores = {}
            with torch.no_grad():
                self.evaluate_clm(scores)
            return scores

        def evaluate_clm(self, scores):
            self.model.eval()
            total = 0.0
            for x, y in self.loader:
                total += self.model(x).sub(y).abs().sum().item()
            scores["clm"] = total
    """


def test_tk111_quiet_when_every_caller_runs_it_under_no_grad():
    assert found(EVALUATOR, "TK111") == []


def test_tk111_quiet_under_set_grad_enabled_false():
    text = """
        import torch
        def test(model, data):
            model.eval()
            loss = 0.0
            with torch.set_grad_enabled(False):
                for batch in iter(data.dev_iter):
                    p1, p2 = model(batch)
                    loss += (p1.sum() + p2.sum()).item()
            return loss
        """
    assert found(text, "TK111") == []


def test_tk111_still_fires_when_a_caller_keeps_gradients_on():
    enabled = EVALUATOR.replace("torch.no_grad()", "torch.set_grad_enabled(True)")
    assert found(enabled, "TK111") == [18]
    also_bare = EVALUATOR.rstrip(" ") + "    def report(evaluator):\n        evaluator.evaluate_clm({})\n"
    assert found(also_bare, "TK111") == [18]  # one caller with gradients on is enough
