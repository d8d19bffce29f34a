"""How the next token is chosen: greedy, or sampled with temperature, top-k and top-p (in
transformers' order), each sequence from its own seeded generator so that a seed repeats."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.errors import ConfigError

MAX_SEED = 2**63 - 1
"""The largest ``seed`` (a signed 64-bit integer, as OpenAI's): seed + row stays within a torch seed."""


class GenerationError(ConfigError):
    """A generation request the model cannot serve; the message names the field and the limit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name} {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """The settings of one sequence's generation.

    ``temperature`` 0 is greedy decoding (transformers' ``do_sample=False``); ``top_k`` 0 and
    ``top_p`` 1 keep every token. ``stop``: strings that end the text (not included in it).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def checked(
        self, prompt_tokens: int, max_length: int | None, names: dict[str, str] | None = None
    ) -> SamplingParams:
        """These settings, or a ``GenerationError`` naming the field (``names`` maps a setting
        to the request field a client sent it as)."""
        name = (names or {}).get

        def number(key: str, value: Any, kind: type) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise GenerationError(
                    name(key, key), f"must be {'a number' if kind is float else 'an integer'}, got {_short(value)}"
                )
            if kind is float and not (abs(value) <= sys.float_info.max):  # inf, nan, or an int past any float
                raise GenerationError(name(key, key), f"must be finite, got {_short(value)}")

        for key, kind in (("max_new_tokens", int), ("temperature", float), ("top_k", int), ("top_p", float)):
            number(key, getattr(self, key), kind)
        if self.max_new_tokens < 1:
            raise GenerationError(
                name("max_new_tokens", "max_new_tokens"), f"must be >= 1, got {_short(self.max_new_tokens)}"
            )
        if self.temperature < 0:
            raise GenerationError(
                name("temperature", "temperature"), f"must be >= 0 (0: greedy), got {_short(self.temperature)}"
            )
        if self.top_k < 0:
            raise GenerationError(name("top_k", "top_k"), f"must be >= 0 (0: no limit), got {_short(self.top_k)}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(name("top_p", "top_p"), f"must be in (0, 1], got {_short(self.top_p)}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise GenerationError(
                name("seed", "seed"), f"must be an integer in [0, 2**63 - 1], got {_short(self.seed)}"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise GenerationError(name("stop", "stop"), f"must be non-empty strings, got {_short(list(self.stop))}")
        if prompt_tokens < 1:
            raise GenerationError(name("prompt", "prompt"), "is empty; send at least one token of text")
        if max_length is not None and prompt_tokens >= max_length:
            over = f", {prompt_tokens - max_length} over it" if prompt_tokens > max_length else ""
            raise GenerationError(
                name("prompt", "prompt"),
                f"is too long: its {prompt_tokens} tokens alone fill the model's context of {max_length} "
                f"positions{over}, leaving no room for a new token; shorten it to at most {max_length - 1} tokens",
            )
        if max_length is not None and prompt_tokens + self.max_new_tokens > max_length:
            raise GenerationError(
                name("max_new_tokens", "max_new_tokens"),
                f"is too large: the prompt's {prompt_tokens} tokens + {_short(self.max_new_tokens)} new ones exceed "
                f"the model's context of {max_length} positions; ask for at most {max_length - prompt_tokens} or "
                "send a shorter prompt",
            )
        return self


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a client's number can have thousands of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def generator_for(params: SamplingParams, row: int = 0) -> torch.Generator | None:
    """The seeded generator of one sequence (row ``row`` of ``num_return_sequences``), or
    ``None``: greedy, or no seed (torch's global generator)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(params.seed + row)
    return generator


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of next-token logits after temperature, top-k and top-p (removed tokens at -inf)."""
    logits = logits.float()
    scaled = logits / params.temperature
    # A temperature so small that the division overflows (softmax: nan) is the limit it tends to:
    # the best token(s) at 0, the rest at -inf or far below. Chosen on the device, without a sync.
    best = logits.max()
    limit = torch.where(logits == best, 0.0, (logits - best) / params.temperature)
    logits = torch.where((torch.isposinf(scaled) | torch.isnan(scaled)).any(), limit, scaled)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative > params.top_p
        drop[1:] = drop[:-1].clone()  # keep the token that crosses top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return logits


def next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The next token of each row of ``logits`` (``[rows, vocab]``) under that row's settings."""
    tokens = []
    greedy = logits.argmax(-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append(int(greedy[row]))
            continue
        probs = filtered_logits(logits[row], p).softmax(-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens
