"""Decoding many sequences at once: a ``Decoder`` runs the model (with its key/value cache when
it has one), ``Sequence`` keeps one sequence's tokens, text and stop rules, and ``decode_batch``
steps them together until each has ended, dropping a finished or abandoned row from the batch."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from torchkeel.lm.sampling import SamplingParams, generator_for, next_tokens


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> Any: ...

    def decode(self, ids: Seq[int]) -> str: ...


class Decoder(Protocol):
    """Next-token logits for a batch of sequences, one token more per ``step``."""

    max_length: int | None

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after each prompt."""

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after one more token per row."""

    def keep(self, rows: list[int]) -> None:
        """Go on with these rows only (in this order)."""


def model_max_length(model: Any) -> int | None:
    """The positions of a transformers model (``max_position_embeddings``), if it says."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


class CachedDecoder:
    """A transformers causal LM with its key/value cache: the prompts once (left-padded, with
    their attention mask and positions), then one token per row per step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._keep_last = "logits_to_keep" in parameters
        self.max_length = model_max_length(model)
        self._device = next(model.parameters()).device
        self._cache: Any = None

    @staticmethod
    def fits(model: Any) -> bool:
        """Whether ``model`` takes a cache (a transformers model built for generation)."""
        forward = getattr(model, "forward", None)
        if not isinstance(model, torch.nn.Module) or forward is None:
            return False
        parameters = inspect.signature(forward).parameters
        return ("cache" in parameters or "past_key_values" in parameters) and "use_cache" in parameters

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        positions = (self._mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": self._mask,
            "position_ids": positions,
            "use_cache": True,
        }
        if self._cache is not None:
            kwargs[self._cache_arg] = self._cache
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        self._cache = out[self._cache_arg] if self._cache_arg in out else out.get("past_key_values")
        return out["logits"][:, -1, :].float()

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        self._mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            self._mask[row, longest - len(prompt) :] = 1
        self._mask = self._mask.to(self._device)
        self._cache = None
        return self._run(ids.to(self._device))

    def step(self, tokens: list[int]) -> torch.Tensor:
        ones = torch.ones(len(tokens), 1, dtype=torch.long, device=self._device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        return self._run(torch.tensor(tokens, device=self._device).view(-1, 1))

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self._device)
        self._mask = self._mask[index]
        if hasattr(self._cache, "batch_select_indices"):
            self._cache.batch_select_indices(index)
        else:  # the legacy tuple of (key, value) per layer
            self._cache = tuple(tuple(t[index] for t in layer) for layer in self._cache)

    @property
    def can_join(self) -> bool:
        """Whether rows can join mid-way: a cache of plain (not sliding-window) key/value tensors."""
        layers = getattr(self._cache, "layers", None)
        if self._cache is None or isinstance(self._cache, tuple):
            return True
        return layers is not None and all(
            isinstance(getattr(layer, "keys", None), torch.Tensor) and not getattr(layer, "is_sliding", False)
            for layer in layers
        )

    def join(self, prompts: list[list[int]]) -> torch.Tensor:
        """Take more rows mid-way (after the current ones): their prompts run on their own, then
        both caches and masks are left-padded to one length and stacked; returns their logits."""
        joining = CachedDecoder(self.model)
        logits = joining.start(prompts)
        length = max(self._mask.shape[1], joining._mask.shape[1])
        self._mask = torch.cat([_left_pad(self._mask, length, 2), _left_pad(joining._mask, length, 2)])
        mine, theirs = _key_values(self._cache), _key_values(joining._cache)
        merged = [
            tuple(torch.cat([_left_pad(a, length, 3), _left_pad(b, length, 3)]) for a, b in zip(pair, other))
            for pair, other in zip(mine, theirs)
        ]
        if isinstance(self._cache, tuple):
            self._cache = tuple(merged)
        else:
            for layer, (keys, values) in zip(self._cache.layers, merged):
                layer.keys, layer.values = keys, values
        return logits


def _left_pad(tensor: torch.Tensor, length: int, rank: int) -> torch.Tensor:
    """Zeros before the sequence axis (axis 1 of a mask, 2 of a ``[batch, heads, length, dim]`` cache)."""
    axis = 1 if rank == 2 else 2
    missing = length - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def _key_values(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(cache, tuple):
        return [(layer[0], layer[1]) for layer in cache]
    return [(layer.keys, layer.values) for layer in cache.layers]


class RecomputeDecoder:
    """Any model of token ids → logits ``[rows, length, vocab]`` without a cache (an ONNX or
    TorchScript export, a hand-written GPT): each step runs the whole sequences again,
    right-padded, so a causal model's positions are those of each sequence alone."""

    def __init__(self, run: Callable[[dict[str, np.ndarray]], Any], names: Seq[str], max_length: int | None) -> None:
        self.run, self.names, self.max_length = run, list(names), max_length
        self._rows: list[list[int]] = []

    @classmethod
    def of_module(cls, model: torch.nn.Module) -> RecomputeDecoder:
        """A module called as ``model(input_ids)`` (or ``model(input_ids=...)`` for a transformers model)."""

        def run(feed: dict[str, np.ndarray]) -> torch.Tensor:
            with torch.inference_mode():
                out = model(torch.from_numpy(feed["input_ids"]))
            return out if isinstance(out, torch.Tensor) else out["logits"]

        return cls(run, ["input_ids"], model_max_length(model))

    def _logits(self) -> torch.Tensor:
        longest = max(len(r) for r in self._rows)
        ids = np.zeros((len(self._rows), longest), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(self._rows):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        feed = {"input_ids": ids, "attention_mask": mask}
        logits = torch.as_tensor(np.asarray(self.run({name: feed[name] for name in self.names})))
        last = torch.tensor([len(r) - 1 for r in self._rows])
        return logits[torch.arange(len(self._rows)), last].float()

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        self._rows = [list(p) for p in prompts]
        return self._logits()

    def step(self, tokens: list[int]) -> torch.Tensor:
        for row, token in zip(self._rows, tokens):
            row.append(token)
        return self._logits()

    def keep(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]

    can_join = True

    def join(self, prompts: list[list[int]]) -> torch.Tensor:
        """Take more rows mid-way (after the current ones); returns the logits after their prompts."""
        joining = RecomputeDecoder(self.run, self.names, self.max_length)
        logits = joining.start(prompts)
        self._rows += joining._rows
        return logits


def decoder_for(model: Any) -> Decoder:
    """The cached decoder for a transformers causal LM, the recomputing one for any other module."""
    return CachedDecoder(model) if CachedDecoder.fits(model) else RecomputeDecoder.of_module(model)


@dataclass
class Sequence:
    """One sequence being generated: its tokens, its text so far and why it ended."""

    prompt: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    """The text given out so far (never taken back)."""
    finish_reason: str | None = None
    """``stop`` (end-of-text or a stop string), ``length`` (``max_new_tokens``), ``abandoned``."""

    def add(self, token: int) -> str:
        """Take the next token; returns the text it completes (``""`` while a character or a
        possible stop string is still open)."""
        if token == self.tokenizer.eos_id:
            self.finish_reason = "stop"
            return self._give(self.tokenizer.decode(self.tokens))
        self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens)
        for stop in self.params.stop:
            at = full.find(stop, max(0, len(self.text) - len(stop)))
            if at >= 0:
                self.finish_reason = "stop"
                return self._give(full[:at])
        if len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            return self._give(full)
        held = max((len(s) - 1 for s in self.params.stop), default=0)
        stable = full.rstrip("\ufffd")  # a character whose bytes are not all there yet
        return self._give(stable[: len(stable) - held] if held else stable)

    def _give(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


def sequences(
    tokenizer: Tokenizer, prompts: Seq[list[int]], params: SamplingParams, num_return_sequences: int = 1
) -> list[Sequence]:
    """A ``Sequence`` per prompt and return sequence; the ``r``-th of a prompt draws from seed + ``r``."""
    return [
        Sequence(list(prompt), params, tokenizer, generator_for(params, r))
        for prompt in prompts
        for r in range(num_return_sequences)
    ]


def decode_batch(decoder: Decoder, rows: list[Sequence]) -> Iterator[list[tuple[Sequence, str]]]:
    """Generate every row to its end, together; yields each step's ``(row, new text)``. A row
    whose ``finish_reason`` is set from outside (a client gone) leaves the batch at the next step."""
    active = [r for r in rows if r.finish_reason is None]
    if not active:
        return
    logits = decoder.start([r.prompt for r in active])
    while True:
        chosen = next_tokens(logits, [r.params for r in active], [r.generator for r in active])
        yield [(row, row.add(token)) for row, token in zip(active, chosen) if row.finish_reason is None]
        going = [i for i, row in enumerate(active) if row.finish_reason is None]
        if not going:
            return
        if len(going) < len(active):
            decoder.keep(going)
            active = [active[i] for i in going]
        logits = decoder.step([active_row.tokens[-1] for active_row in active])
