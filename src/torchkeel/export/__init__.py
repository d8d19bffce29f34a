"""Export with parity checks, and the Triton model repository."""

from torchkeel._lazy import lazy_exports

_EXPORTS = {
    "check_parity": "torchkeel.export.parity",
    "export_pretrained": "torchkeel.export.export",
    "export_run": "torchkeel.export.export",
    "read_model_json": "torchkeel.export.formats",
    "reference_stats": "torchkeel.export.stats",
}

__all__ = ["check_parity", "export_pretrained", "export_run", "read_model_json", "reference_stats"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
