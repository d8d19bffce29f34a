"""Masked-language-model inputs (BERT's recipe): a share of the tokens is chosen, and of those
80 % become the mask token, 10 % a random token and 10 % stay; the labels hold the chosen
tokens' ids and -100 elsewhere. Special tokens (end-of-text, ``[CLS]``, ``[SEP]``, padding) are
never chosen.

The draws are a function of (the unit's seed, the sample's row, the position): the same sample
is masked the same way whichever rank, worker or resume reads it, and anew each epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchkeel.errors import ConfigError

MASK_NAMES = ("[MASK]", "<mask>")
IGNORE = -100
_GOLDEN, _ROW, _POS = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class Masking:
    """What masking needs from the config and the tokenizer."""

    probability: float
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]

    @classmethod
    def of(cls, probability: float, tokenizer: object) -> Masking:
        """The masking of ``tokenizer``: its mask token (``[MASK]`` or ``<mask>``; the byte
        tokenizer's is id 257, so its model needs ``vocab_size`` >= 258) and its special tokens.

        Raises:
            ConfigError: the probability is not in (0, 1), or the tokenizer has no mask token.
        """
        if not 0 < probability < 1:
            raise ConfigError(f"data.mlm_probability must be in (0, 1) (BERT uses 0.15), got {probability}")
        backend = getattr(tokenizer, "tokenizer", None)
        eos = int(getattr(tokenizer, "eos_id"))
        if backend is None:  # bytes: ids 0-255, end-of-text 256, mask 257
            return cls(probability, 257, 258, (eos,))
        mask = next((i for name in MASK_NAMES if (i := backend.token_to_id(name)) is not None), None)
        if mask is None:
            raise ConfigError(
                f"data.mlm_probability needs a tokenizer with a mask token ({' or '.join(MASK_NAMES)}); "
                "data.tokenizer has none: add one when training the tokenizer"
            )
        special = {eos, mask, *(int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special)}
        return cls(probability, int(mask), int(backend.get_vocab_size(with_added_tokens=True)), tuple(sorted(special)))

    def apply(self, ids: np.ndarray, rows: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` for samples ``ids`` (``[n, length]``, or one ``[length]``)
        whose rows in their unit are ``rows``."""
        ids = np.asarray(ids, dtype=np.int64)
        flat = ids.reshape(-1, ids.shape[-1])
        row = np.asarray(rows, dtype=np.uint64).reshape(-1, 1)
        position = np.arange(flat.shape[1], dtype=np.uint64).reshape(1, -1)
        with np.errstate(over="ignore"):  # wrapping multiplication is the hash
            key = (np.uint64(seed % 2**64) * _GOLDEN) ^ (row * _ROW) ^ (position * _POS)
        chosen = (_uniform(key, 1) < self.probability) & ~np.isin(flat, self.special_ids)
        action = _uniform(key, 2)
        replaced = _mix(key, 3) % np.uint64(self.vocab_size)
        inputs = flat.copy()
        inputs[chosen & (action < 0.8)] = self.mask_id
        randomly = chosen & (action >= 0.8) & (action < 0.9)
        inputs[randomly] = replaced[randomly].astype(np.int64)
        labels = np.where(chosen, flat, IGNORE)
        return inputs.reshape(ids.shape), labels.reshape(ids.shape)


def _mix(key: np.ndarray, stream: int) -> np.ndarray:
    """A 64-bit hash of each key (splitmix64's finalizer), one stream per ``stream``."""
    with np.errstate(over="ignore"):
        x = key + np.uint64(stream) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _ROW
        x = (x ^ (x >> np.uint64(27))) * _POS
        return x ^ (x >> np.uint64(31))


def _uniform(key: np.ndarray, stream: int) -> np.ndarray:
    return (_mix(key, stream) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
