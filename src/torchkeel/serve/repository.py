"""The models one server serves: exports loaded at start, each with its own batcher and queue.

``ModelRepository(["exports/a", "exports/b"])`` or ``ModelRepository(["exports"])`` (a directory
whose subdirectories are exports). A model that fails to load is kept as *unavailable* with its
reason — listed in the index, answered with a 503 that gives the reason — while the others serve;
a server with no model at all is a ConfigError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchkeel.errors import ConfigError, first_line
from torchkeel.lm.decoding import RecomputeDecoder
from torchkeel.serve.metrics import ServerMetrics
from torchkeel.serve.model import VERSION, ServedModel, ServeOptions
from torchkeel.serve.tensors import ProtocolError

# bench/generate.py: 8 streams at once over the same 8 one after another, tokens/s (docs/language-models.md).
RECOMPUTE_SCALING = "8 streams at once were measured at 0.5-1.4x the tokens/s of the same 8 one after another"
CACHED_SCALING = "4-9.5x"


@dataclass
class Unavailable:
    """A model that could not be loaded, and why."""

    name: str
    path: str
    reason: str


class ModelRepository:
    """Loaded models by name, and the ones that failed to load."""

    def __init__(
        self, sources: Sequence[str | Path], options: ServeOptions, metrics: ServerMetrics, images: Executor
    ) -> None:
        self.models: dict[str, ServedModel] = {}
        self.unavailable: list[Unavailable] = []
        self.metrics = metrics
        self.holding = False
        """True while the server warms its request path over its own socket: the models answer,
        and readiness probes are told they are not ready yet."""
        for path, problem in _exports(sources):
            if problem is not None:
                self.unavailable.append(Unavailable(_name_of(path), str(path), problem))
                continue
            try:
                model = ServedModel(path, options, metrics, images)
            except Exception as exc:  # noqa: BLE001 - any failure to load is this model's, reported with it
                self.unavailable.append(
                    Unavailable(_name_of(path), str(path), f"{type(exc).__name__}: {first_line(exc)}")
                )
                continue
            if model.name in self.models:
                first = self.models[model.name].path
                self.unavailable.append(
                    Unavailable(
                        model.name,
                        str(path),
                        f"the name '{model.name}' is already served from '{first}'; give the run another name",
                    )
                )
                continue
            self.models[model.name] = model
        if options.model_name is not None and len(self.models) + len(self.unavailable) > 1:
            raise ConfigError(
                f"--model_name {options.model_name!r} names one model, and {len(self.models) + len(self.unavailable)} "
                "exports were given; serve one export, or drop --model_name to serve each under its own name"
            )
        if not self.models:
            reasons = "; ".join(f"'{u.path}': {u.reason}" for u in self.unavailable) or "no export given"
            raise ConfigError(f"no model could be loaded ({reasons})")

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """The model ``name`` (version ``1`` or none); a ProtocolError (404/503) names what is there."""
        model = self.models.get(name)
        if model is None:
            failed = next((u for u in self.unavailable if u.name == name), None)
            if failed is not None:
                raise ProtocolError(503, f"model '{name}' is unavailable: it failed to load ({failed.reason})")
            raise ProtocolError(404, f"unknown model '{name}'; this server has {sorted(self.models)}")
        if version not in (None, "", VERSION):
            raise ProtocolError(404, f"model '{name}' has no version '{version}'; it has '{VERSION}'")
        return model

    @property
    def ready(self) -> bool:
        """Every loaded model is ready (the ones that failed to load are reported, not waited for)."""
        return not self.holding and bool(self.models) and all(m.ready for m in self.models.values())

    def model_ready(self, model: ServedModel) -> bool:
        """What a readiness probe is told of ``model``: ready, and not held back by the server."""
        return model.ready and not self.holding

    def notes(self) -> list[str]:
        """What the server says once at start about how its models serve (none: nothing to say):
        a language model decoded without a key/value cache (an ONNX, TorchScript or torch.export
        export) recomputes every stream's whole sequence for each token, so streams served at
        once gain little over the same streams one after another, where the hf export scales."""
        return [
            f"{m.name}: this {m.meta['format']} export of a language model has no key/value cache: each new token "
            "runs every stream's whole sequence again, so concurrent streams share about one stream's throughput "
            f"({RECOMPUTE_SCALING}); to serve concurrent streams, serve `keel export RUN --format hf` instead, "
            f"decoded with its cache ({CACHED_SCALING})"
            for m in self.models.values()
            if m.generation is not None and isinstance(m.generation.decoder, RecomputeDecoder)
        ]

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: name, version, state (``READY``/``UNAVAILABLE``) and reason."""
        rows = [
            {
                "name": m.name,
                "version": m.version,
                "state": "READY" if self.model_ready(m) else "UNAVAILABLE",
                "reason": "",
            }
            for m in self.models.values()
        ]
        rows += [
            {"name": u.name, "version": VERSION, "state": "UNAVAILABLE", "reason": u.reason} for u in self.unavailable
        ]
        return sorted(rows, key=lambda r: r["name"])

    async def start(self) -> None:
        """Warm every model up (on a thread: the event loop stays free), then mark it ready.
        A model whose warm-up fails is unavailable, with the reason."""
        for name, model in list(self.models.items()):
            try:
                await asyncio.to_thread(model.warm_up)
            except Exception as exc:  # noqa: BLE001 - the model's own failure, reported with it
                self.unavailable.append(Unavailable(name, str(model.path), f"warm-up failed: {first_line(exc)}"))
                del self.models[name]
                continue
            await model.batcher.start()
            if model.generation is not None:
                model.generation.start()
            model.ready = True

    async def stop(self) -> None:
        """Stop taking requests, answer everything already queued, stop the batchers."""
        for model in self.models.values():
            model.ready = False
        for model in self.models.values():
            await model.batcher.stop()
            if model.generation is not None:
                await asyncio.to_thread(model.generation.stop)


def _exports(sources: Sequence[str | Path]) -> Iterator[tuple[Path, str | None]]:
    """Each export directory, or a path with the reason it is not one."""
    for source in sources:
        path = Path(source)
        if (path / "model.json").is_file():
            yield path, None
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if (p / "model.json").is_file())
            if not found:
                yield path, "no model.json in it or in its subdirectories; pass a directory written by keel export"
            yield from ((p, None) for p in found)
        else:
            yield path, "not a directory; pass a directory written by keel export"


def _name_of(path: Path) -> str:
    """The model's name from its model.json if readable, else the directory's name."""
    try:
        return str(json.loads((path / "model.json").read_text())["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return path.name
