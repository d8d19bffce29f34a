"""Where ``keel serve`` listens and what it serves, on a laptop and as a KServe custom predictor.

KServe starts a predictor container with ``STORAGE_URI`` set, downloads that URI into
``/mnt/models`` (its storage initializer) and sends HTTP to port 8080 and gRPC to 8081 (the port
named ``h2c``). Under KServe ``keel serve`` needs no arguments: those are its defaults there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KSERVE_MODEL_DIR = "/mnt/models"


@dataclass(frozen=True)
class Listening:
    host: str
    http_port: int
    grpc_port: int
    model_dirs: list[str] = field(default_factory=list)


LOCAL = Listening("127.0.0.1", 8000, 8001)
"""Outside KServe: loopback only, Triton's ports, the export directories given."""


def is_kserve(environ: Mapping[str, str]) -> bool:
    """KServe sets ``STORAGE_URI`` in the predictor container of an InferenceService with a storageUri."""
    return bool(environ.get("STORAGE_URI"))


def kserve_defaults(environ: Mapping[str, str], mount: str = KSERVE_MODEL_DIR) -> Listening:
    """All interfaces, 8080 and 8081, and the models at ``/mnt/models``; a ``STORAGE_URI`` that is a
    local path (``file://`` or absolute, a volume mounted as it is) is served from where it points
    when nothing was copied to ``/mnt/models``."""
    uri = environ.get("STORAGE_URI", "")
    local = uri.removeprefix("file://") if uri.startswith(("file://", "/")) else None
    models = mount if Path(mount).is_dir() or local is None else local
    return Listening("0.0.0.0", 8080, 8081, [models])
