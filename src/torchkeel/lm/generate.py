"""``generate``: text from a causal language model and its tokenizer, for a hand-written loop,
``keel generate``, ``train.sample_every`` and the server alike."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from torchkeel.lm.decoding import Decoder, decode_batch, decoder_for, sequences
from torchkeel.lm.sampling import GenerationError, SamplingParams
from torchkeel.lm.tokenizer import text_tokenizer

DEFAULT_NEW_TOKENS = 64


@dataclass
class Generation:
    """One generated continuation."""

    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    """``stop``: end-of-text or a stop string; ``length``: ``max_new_tokens`` reached."""


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Seq[str],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    num_return_sequences: int = 1,
    stop: Seq[str] = (),
    decoder: Decoder | None = None,
) -> list[Generation]:
    """Continue ``prompt`` (one text or several) with ``model``: a transformers causal LM
    decodes with its key/value cache, any other module of ``input_ids`` → logits recomputes
    the sequence each step. Generation stops at the tokenizer's end-of-text, a ``stop`` string
    or ``max_new_tokens``.

    ``tokenizer`` is torchkeel's (``data.tokenizer``'s), a transformers tokenizer
    (``AutoTokenizer.from_pretrained``) or a ``tokenizers.Tokenizer`` (see ``text_tokenizer``):
    the prompt is encoded without added special tokens, as transformers' text-generation pipeline does.

    ``max_new_tokens`` (default: 64, or fewer where the model's positions end sooner) bounds
    each continuation. ``temperature=0`` is greedy decoding: the tokens transformers' ``generate(do_sample=False)``
    gives. Otherwise tokens are sampled after temperature, ``top_k`` and ``top_p``; with a
    ``seed`` the same call gives the same text (the ``r``-th return sequence draws from
    ``seed + r``). Returns ``num_return_sequences`` generations per prompt, prompt by prompt.

    Raises:
        GenerationError: a setting out of range, an empty prompt, or a prompt and
            ``max_new_tokens`` longer than the model's positions (naming the setting).
        TypeError: ``tokenizer`` is none of the kinds above.

    Example::

        [out] = tk.generate(model, tokenizer, "def main(", max_new_tokens=40, temperature=0)
        print(out.text)
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if num_return_sequences < 1:
        raise GenerationError("num_return_sequences", f"must be >= 1, got {num_return_sequences}")
    decoder = decoder if decoder is not None else decoder_for(model)
    tokenizer = text_tokenizer(tokenizer)
    for where, text in [
        *((f"prompt[{i}]", p) for i, p in enumerate(prompts)),
        *((f"stop[{i}]", s) for i, s in enumerate(stop)),
    ]:
        _check_text(where, text)
    encoded = [[int(i) for i in tokenizer.encode(text)] for text in prompts]
    if max_new_tokens is None:
        room = decoder.max_length - max(map(len, encoded)) if decoder.max_length is not None else DEFAULT_NEW_TOKENS
        max_new_tokens = max(1, min(DEFAULT_NEW_TOKENS, room))
    params = SamplingParams(max_new_tokens, float(temperature), top_k, float(top_p), seed, tuple(stop))
    for ids in encoded:
        params.checked(len(ids), decoder.max_length)
    rows = sequences(tokenizer, encoded, params, num_return_sequences)
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    try:
        for _ in decode_batch(decoder, rows):
            pass
    finally:
        if was_training:
            model.train()
    texts = [text for text in prompts for _ in range(num_return_sequences)]
    return [Generation(p, r.text, list(r.tokens), r.finish_reason or "length") for p, r in zip(texts, rows)]


def _check_text(where: str, text: object) -> None:
    """A ``GenerationError`` naming ``where`` for what no tokenizer reads: not a string, or a lone
    surrogate (a ``"\\ud800"`` escape that is not half of a pair)."""
    if not isinstance(text, str):
        raise GenerationError(where, f"must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GenerationError(
            where, f"holds a lone surrogate {text[exc.start]!r} at character {exc.start}; give valid text"
        ) from None
