"""Which files ``keel lint`` reads: the ``.py`` files named or found under folders."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from torchkeel.errors import ConfigError

_SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "site-packages", "node_modules", ".tox", "build", "dist"}


def python_files(paths: Iterable[str]) -> list[str]:
    """The ``.py`` files named or found under the directories named (virtualenvs and caches skipped)."""
    files: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
        elif path.exists():
            files.append(str(path))
        else:
            raise ConfigError(f"keel lint: {raw}: no such file or directory")
    return files
