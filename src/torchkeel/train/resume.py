"""Choosing the checkpoint to resume from, checking the config against the checkpoint's, and
trimming run files back to it."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchkeel.checkpoint import Checkpoint, CheckpointStore, read_checkpoint
from torchkeel.config.load import config_hash, to_dict
from torchkeel.config.schema import KeelConfig
from torchkeel.data.inputs import describe_changes, input_changes, is_refused
from torchkeel.errors import ConfigError

# What a run computes: a change here means the resumed run is no longer the uninterrupted one.
EXACT = (
    "seed",
    "deterministic",
    "precision",
    "model",
    "data",
    "loss",
    "optim",
    "schedule",
    "train.batch_size",
    "train.accumulate",
    "train.clip_grad_norm",
    "train.carry",
)
# ... except how data is loaded, not which: these never change the batches.
NOT_EXACT = (
    "data.num_workers",
    "data.prefetch_factor",
    "data.max_bad_fraction",
    "data.val",
    "model.init_from",
    "model.init_strict",
)
# The schedule is planned over the run's length: a change re-plans the learning rate from here.
REPLANS = ("train.max_epochs", "train.max_steps")
# Restored as the checkpoint holds them, whatever the config says now: a change could not apply.
# The optimizer's state is per param group; a schedule.target is rebuilt from its saved state
# (its arguments included), so every schedule.* key is kept when either config has a target.
KEPT = ("optim.groups", "optim.decay_filter")


def find_checkpoint(store: CheckpointStore, resume: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """``"auto"``: the newest valid checkpoint in ``store`` (``None``: start fresh), each
    skipped one reported through ``warn``; otherwise the checkpoint directory ``resume``.

    Raises:
        CheckpointError: an explicit ``resume`` path that is missing or fails verification.
    """
    if str(resume) != "auto":
        return read_checkpoint(resume)
    found, problems = store.latest_valid()
    for problem in problems:
        warn(f"skipping invalid checkpoint: {problem}")
    if found is None and problems:
        warn("no valid checkpoint left; starting from scratch")
    return found


def config_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    prefix: str = "",
    defaults: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for every key that differs, deepest keys first named.

    A key the saved config lacks (it was saved by a version without it) counts as its value in
    ``defaults``: the old version behaved as the default does, so that is no change."""
    changes = []
    defaults = defaults or {}
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        old = saved[key] if key in saved else defaults.get(key)
        new = current.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            below = defaults.get(key)
            changes += config_changes(old, new, f"{name}.", below if isinstance(below, Mapping) else None)
        elif old != new:
            changes.append((name, old, new))
    return changes


def breaks_exactness(key: str) -> bool:
    """Whether a change of ``key`` changes what the resumed run computes (data, model, batch, seed…)."""

    def within(prefixes: tuple[str, ...]) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    return within(EXACT) and not within(NOT_EXACT)


def check_resume_config(
    manifest: Mapping[str, Any], current: Mapping[str, Any], *, allow: bool, checkpoint: str | Path
) -> list[str]:
    """Compare the config of a resume with the one in its checkpoint's manifest.

    Returns the lines to print: every differing key, old → new. A change that breaks
    exactness (``breaks_exactness``) is refused unless ``allow``.

    Raises:
        ConfigError: naming the keys, and ``--allow-config-change``.
    """
    saved = manifest.get("config")
    if saved is None:  # a checkpoint from before configs were kept in the manifest: only its hash
        if manifest.get("config_hash") not in (None, config_hash(current)):
            return [
                f"the config differs from the one checkpoint '{checkpoint}' was saved with (which keys, a "
                "checkpoint this old does not say)"
            ]
        return []
    changes = config_changes(saved, current, defaults=to_dict(KeelConfig()))
    # The files of a fingerprinted source are compared themselves (check_resume_inputs): a new
    # path to the same files does not change what the run computes.
    by_files = set(manifest.get("inputs") or {})
    breaking = [key for key, _, _ in changes if breaks_exactness(key) and key not in by_files]
    target = (current.get("schedule") or {}).get("target")
    if allow:
        _refuse_kept(changes, target or (saved.get("schedule") or {}).get("target"), checkpoint)
    if breaking and not allow:
        shown = "; ".join(f"{k}: {_short(o)} -> {_short(n)}" for k, o, n in changes if k in breaking)
        raise ConfigError(
            f"--resume: the config differs from checkpoint '{checkpoint}' in what the run computes "
            f"({shown}); resume with the checkpoint's config, start a new run (another name), "
            "or pass --allow-config-change to continue anyway (no longer the uninterrupted run)"
        )
    lines = []
    for key, old, new in changes:
        note = ""
        if key in REPLANS and target is not None:
            note = " (schedule.target follows its own arguments: nothing to re-plan)"
        elif key in REPLANS:
            note = " (the learning-rate schedule is planned anew over the new length, from this step on)"
        elif key in breaking:
            note = " (allowed by --allow-config-change: the run is no longer the uninterrupted one)"
        lines.append(f"config differs from the checkpoint's: {key}: {_short(old)} -> {_short(new)}{note}")
    return lines


def _refuse_kept(changes: list[tuple[str, Any, Any]], target: str | None, checkpoint: str | Path) -> None:
    """Even with ``--allow-config-change``: a change of what the checkpoint restores as it holds it."""
    kept = [k for k, _, _ in changes if k in KEPT or (target is not None and k.startswith("schedule."))]
    if not kept:
        return
    why = (
        f"schedule.target {target!r} is restored from the checkpoint's saved scheduler, arguments included"
        if kept[0].startswith("schedule.")
        else "the checkpoint's optimizer state is kept per parameter group"
    )
    raise ConfigError(
        f"--resume: {kept[0]} differs from checkpoint '{checkpoint}', and {why}, so the change cannot apply "
        "even with --allow-config-change; resume with the checkpoint's value, or start a new run (another "
        "name) from its weights with model.init_from"
    )


def check_resume_inputs(
    manifest: Mapping[str, Any], current: Mapping[str, Any], *, allow: bool, checkpoint: str | Path
) -> list[str]:
    """Compare the data files of a resume (``torchkeel.data.inputs``) with those its checkpoint
    planned over. Returns the line to print when ``allow`` lets a change through.

    Raises:
        ConfigError: a file changed, went missing or was added; naming them, and ``--allow-data-change``.
    """
    changes = input_changes(manifest.get("inputs") or {}, current)
    if not changes:
        return []
    shown = describe_changes(changes)
    if not is_refused(changes):
        return [f"data moved since the checkpoint: {shown} (the same files: the run continues exactly)"]
    if not allow:
        raise ConfigError(
            f"--resume: the data changed since checkpoint '{checkpoint}' was saved ({shown}); put the files "
            "back as they were, start a new run (another name), or pass --allow-data-change to continue "
            "over the new files (a new data plan: no longer the uninterrupted run)"
        )
    return [f"data differs from the checkpoint's: {shown} (allowed by --allow-data-change: the data plan is new)"]


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
