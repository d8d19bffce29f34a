"""Out-of-memory handling: split micro-batches, free memory, and say how much there was.

The step (``train_step``) catches ``torch.OutOfMemoryError`` around forward and backward,
calls ``free_memory``, halves the micro-batch size and redoes the step; the gradient of each
piece is weighted by its share of samples, so the update is the full batch's. Tests inject an
OOM on CPU with ``torchkeel.testing.OomInjector``; any other error passes through unchanged.
"""

from __future__ import annotations

import gc

import torch

from torchkeel.errors import SampleTooLarge
from torchkeel.introspect.memory import rss_bytes


def smaller_size(failed_size: int, device: torch.device) -> int:
    """Half of the micro-batch size that ran out of memory.

    Raises:
        SampleTooLarge: a single sample did not fit (with the memory figures).
    """
    if failed_size <= 1:
        raise SampleTooLarge(
            f"a single sample does not fit in memory on {device} ({memory_figures(device)}); "
            "use a smaller model or input, precision=bf16, or a device with more memory"
        )
    return max(1, failed_size // 2)


def free_memory(device: torch.device) -> None:
    """Release what the failed attempt held: Python garbage and the CUDA caching allocator's blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_figures(device: torch.device) -> str:
    """A short description of memory use on ``device`` for error messages."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (
            f"allocated {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB, "
            f"reserved {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB, "
            f"free {free / 2**30:.2f} of {total / 2**30:.2f} GiB"
        )
    return f"process RSS {rss_bytes() / 2**30:.2f} GiB"
