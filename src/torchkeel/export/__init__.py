"""Export with parity checks, and the Triton model repository."""

from torchkeel.export.export import export_run, read_model_json
from torchkeel.export.parity import check_parity
from torchkeel.export.stats import reference_stats

__all__ = ["check_parity", "export_run", "read_model_json", "reference_stats"]
