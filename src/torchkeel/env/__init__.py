"""The environment: facts about this machine and the doctor's checks over them."""

from torchkeel.env.checks import CHECKS, Finding, run_checks
from torchkeel.env.facts import Facts, collect_facts

__all__ = ["CHECKS", "Facts", "Finding", "collect_facts", "run_checks"]
