"""Language models after training: sampling (``generate``), batched decoding with a key/value
cache (``decoding``), and the tokenizer an export carries (``tokenizer``)."""

from torchkeel.lm.generate import Generation, generate
from torchkeel.lm.sampling import GenerationError, SamplingParams

__all__ = ["Generation", "GenerationError", "SamplingParams", "generate"]
