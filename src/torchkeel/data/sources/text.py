"""Text files tokenized and packed into blocks: chunks of files are the units of work.

Each file is cut into chunks of about ``chunk_bytes`` at line ends (a seek and a line read per
chunk), so that one large file spreads over every rank and stream. A unit's size must be known
before the epoch, so every chunk is tokenized once at the start — in a pool of processes, never
in the training process — to count its blocks; the counts are cached per files, tokenizer and
settings. Afterwards a chunk is tokenized again where it is read, in the DataLoader workers, and
its blocks are put in their seeded order, which makes a position in it one number, as for a
Parquet row group.

Documents: a ``.txt`` file is one document (its text as it is, newlines kept); each line of a
``.jsonl`` file is one, the string under ``text_key``. With ``pack``, a chunk's documents are
joined with the end-of-text token after each and cut into blocks of ``block_size`` tokens (the
tokens after the chunk's last whole block are left out: fewer than ``block_size`` per chunk);
without it, each document is a sample of its own, cut into pieces of at most ``block_size``.
A line that is not UTF-8, not JSON or has no text is a bad sample named by file and line.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchkeel.data.order import Unit
from torchkeel.data.sources import Bad, Rows, Sample, expand_paths, files_fingerprint, stat_files
from torchkeel.data.sources.masking import Masking
from torchkeel.data.sources.tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    FileTokenizer,
    TokenizerSpec,
    load_tokenizer,
    tokenizer_identity,
    tokenizer_spec,
)
from torchkeel.data.stream import worker_context
from torchkeel.data.tune import default_cache_dir
from torchkeel.errors import ConfigError, DataError, first_line
from torchkeel.io import write_json_atomic

SUFFIXES = (".txt", ".jsonl")
INLINE_BYTES = 32 << 20
"""Below this many bytes of byte-level text the blocks are counted in this process (reading the
bytes is all that counting them takes); above it, and for any other tokenizer, in a pool."""


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, stop)`` of ``path``, a whole number of lines; ``last``: it ends its file."""

    path: str
    start: int
    stop: int
    last: bool
    jsonl: bool


class TextSource:
    """Samples ``{"input_ids", "labels"}`` (the same ids; a causal LM shifts them) from text files.

    Args:
        paths: ``.txt`` / ``.jsonl`` files, globs, brace patterns or directories.
        tokenizer: ``"byte"`` (ids 0–255, end-of-text 256), a directory written by
            ``save_pretrained`` or a ``tokenizer.json`` file, or ``{"path", "eos"}`` naming the
            end-of-text token when the tokenizer's config does not.
        block_size: tokens per sample.
        pack: join documents (end-of-text after each) and cut the stream into full blocks;
            ``False``: each document is a sample, cut into pieces of at most ``block_size``
            (samples of different lengths: batch them with ``PadCollate``).
        text_key: the string field of each ``.jsonl`` line.
        chunk_bytes: about how many bytes of a file make one unit of work.
        cache_dir: where the block counts are kept (default: torchkeel's cache directory).

    Example::

        source = TextSource("corpus/*.txt", tokenizer="byte", block_size=256)
    """

    sequence_axes = {"input_ids": [1], "labels": [1]}
    """Axes that hold the sequence: an export takes any length there, not only ``block_size``."""
    min_workers = 1
    """``num_workers: auto`` tries no fewer: tokenizing in the training process takes from the step."""

    def __init__(
        self,
        paths: str | Sequence[str],
        *,
        tokenizer: Any = "byte",
        block_size: int = 1024,
        pack: bool = True,
        text_key: str = "text",
        chunk_bytes: int = 1 << 20,
        key: str = "data.train",
        cache_dir: str | Path | None = None,
        mlm_probability: float | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"data.block_size must be >= 1, got {block_size}")
        if chunk_bytes < 1:
            raise ConfigError(f"data.chunk_bytes must be >= 1, got {chunk_bytes}")
        self.paths = expand_paths(paths, key, SUFFIXES)
        self.spec = tokenizer_spec(tokenizer)
        tok = load_tokenizer(self.spec)
        self.eos_id, self.vocab_size = tok.eos_id, tok.vocab_size
        self.masking = Masking.of(mlm_probability, tok) if mlm_probability is not None else None
        if self.masking is not None:
            self.vocab_size = max(self.vocab_size, self.masking.vocab_size)
        self.block_size, self.pack, self.text_key = block_size, pack, text_key
        self._chunks = [c for path in self.paths for c in _chunks(path, chunk_bytes)]
        self.file_stats = stat_files(self.paths)
        """Size and mtime of each file as the blocks were planned (the resume's check starts from them)."""
        self._fingerprint = json.dumps(
            [
                "text",
                files_fingerprint(self.paths, self.file_stats),
                tokenizer_identity(self.spec),
                block_size,
                pack,
                text_key,
                chunk_bytes,
            ]
        )
        counts = _counts(self, cache_dir)
        self._first_lines = _first_lines(self._chunks, [lines for _, lines in counts])
        self._units = [
            Unit(f"{c.path} bytes {c.start}-{c.stop}", samples) for c, (samples, _) in zip(self._chunks, counts)
        ]
        self.empty_files = [path for path in self.paths if self._size(path) == 0]
        """Files with nothing in them: they hold no sample (the Trainer records each as an incident)."""
        if not any(samples for samples, _ in counts):
            raise ConfigError(self._why_no_samples(key))
        self._tokenizer: ByteTokenizer | FileTokenizer | None = None  # loaded in each worker

    def units(self) -> list[Unit]:
        return self._units

    @property
    def input_files(self) -> list[str]:
        """The text files and the tokenizer's files: what the plan of blocks is made from."""
        tokenizer = [] if self.spec.path is None else [self.spec.path]
        if tokenizer and os.path.isdir(tokenizer[0]):
            tokenizer = [p for name in TOKENIZER_FILES if os.path.isfile(p := os.path.join(tokenizer[0], name))]
        return [*self.paths, *tokenizer]

    def _size(self, path: str) -> int:
        return self.file_stats[os.path.abspath(path)][0]

    def _why_no_samples(self, key: str) -> str:
        files = f"{len(self.paths)} file{'s' * (len(self.paths) != 1)} of {key}"
        if len(self.empty_files) == len(self.paths):
            return f"every one of the {files} is empty: point {key} at files with text in them"
        if not self.pack:
            return f"the {files} hold no document: give .txt files, or .jsonl lines with a '{self.text_key}' string"
        total = sum(self._size(path) for path in self.paths)
        return (
            f"every one of the {files} ({total} bytes in all) is shorter than data.block_size={self.block_size} "
            "tokens, and a block never spans two files (nor two chunks of data.chunk_bytes): lower "
            "data.block_size, or join the short files into larger ones"
        )

    def fingerprint(self) -> str:
        return self._fingerprint

    def where(self, unit: int, row: int) -> str:
        what = "block" if self.pack else "piece"
        return f"{self._chunks[unit].path} {what} {row} of the lines from {self._first_lines[unit]}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def read(
        self, unit: int, first: int, rng: np.random.Generator | None, *, as_samples: bool
    ) -> Iterator[Rows | Sample | Bad]:

        chunk = self._chunks[unit]
        documents, bad, _ = chunk_documents(chunk, self.text_key)
        if first == 0:  # a bad line holds no position: it is reported when the chunk is begun
            for line, error in bad:
                yield Bad(f"{chunk.path} line {self._first_lines[unit] + line}", error, 0)
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec)
        samples = chunk_samples(documents, self._tokenizer, self.block_size, self.pack)
        n = len(samples) if isinstance(samples, list) else samples.shape[0]
        if n != self._units[unit].num_samples:
            raise DataError(
                f"{chunk.path} changed since its blocks were counted ({self._units[unit].num_samples}, now {n}); "
                "keep the training files unchanged during a run, or start a new one"
            )
        order = rng.permutation(n) if rng is not None else np.arange(n)
        mask_seed = int(rng.integers(2**63)) if rng is not None else unit  # new masks each epoch
        positions = np.arange(first, n)
        rows = order[first:]
        if isinstance(samples, np.ndarray) and not as_samples:
            if rows.size:
                yield Rows(self._sample(samples[rows], rows, mask_seed), positions + 1, rows)
            return
        for pos, row in zip(positions.tolist(), rows.tolist()):
            yield Sample(
                self._sample(np.array(samples[row]), np.array([row]), mask_seed), pos + 1, self.where(unit, row)
            )

    def _sample(self, ids: np.ndarray, rows: np.ndarray, mask_seed: int) -> dict[str, Any]:
        """``{input_ids, labels}``: the same ids (a causal LM shifts them), or masked (``data.mlm_probability``)."""
        import torch

        if self.masking is None:
            tensor = torch.from_numpy(ids)
            return {"input_ids": tensor, "labels": tensor.clone()}
        inputs, labels = self.masking.apply(ids, rows, mask_seed)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}


def chunk_documents(chunk: Chunk, text_key: str) -> tuple[list[tuple[str, bool]], list[tuple[int, str]], int]:
    """The chunk's documents as ``(text, ends here)``, its bad lines as ``(line in the chunk,
    why)`` (0-based), and its number of line ends."""
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        raw = f.read(chunk.stop - chunk.start)
    documents, bad = _documents(raw, chunk, text_key)
    return documents, bad, raw.count(b"\n")


def _documents(raw: bytes, chunk: Chunk, text_key: str) -> tuple[list[tuple[str, bool]], list[tuple[int, str]]]:
    if not chunk.jsonl:
        try:
            return [(raw.decode("utf-8"), chunk.last)], []
        except UnicodeDecodeError:
            pass
        good, bad = [], []
        for i, line in enumerate(_lines(raw)):
            try:
                good.append(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                bad.append((i, f"not UTF-8 text ({first_line(exc)})"))
        return [("".join(good), chunk.last)], bad
    documents: list[tuple[str, bool]] = []
    bad = []
    for i, line in enumerate(_lines(raw)):
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip(b"\r\n"))
        except (UnicodeDecodeError, ValueError) as exc:
            bad.append((i, f"not a JSON line ({type(exc).__name__}: {first_line(exc)})"))
            continue
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = (
                f"'{text_key}' is {type(text).__name__}, not a string"
                if isinstance(record, dict) and text_key in record
                else f"no '{text_key}' key (it has: {', '.join(map(str, record))})"
                if isinstance(record, dict)
                else f"a JSON {type(record).__name__}, not an object with '{text_key}'"
            )
            bad.append((i, f"{what}; set data.text_key to the text field"))
            continue
        documents.append((text, True))
    return documents, bad


def chunk_samples(
    documents: list[tuple[str, bool]], tokenizer: ByteTokenizer | FileTokenizer, block_size: int, pack: bool
) -> np.ndarray | list[np.ndarray]:
    """The chunk's samples in file order: ``[blocks, block_size]`` token ids when packing, else
    each document's pieces of at most ``block_size``."""
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    tokens = [
        np.concatenate([tokenizer.encode(text), eos]) if ends else tokenizer.encode(text) for text, ends in documents
    ]
    if pack:
        ids = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
        n = len(ids) // block_size
        return ids[: n * block_size].reshape(n, block_size)
    return [ids[i : i + block_size] for ids in tokens for i in range(0, len(ids), block_size)]


def count_chunk(job: tuple[Chunk, str, TokenizerSpec, int, bool]) -> tuple[int, int]:
    """``(samples, lines)`` of one chunk: what a pool process runs."""
    chunk, text_key, spec, block_size, pack = job
    documents, _, lines = chunk_documents(chunk, text_key)
    samples = chunk_samples(documents, _pool_tokenizer(spec), block_size, pack)
    return (len(samples) if isinstance(samples, list) else int(samples.shape[0])), lines


_POOL_TOKENIZERS: dict[TokenizerSpec, Any] = {}


def _pool_tokenizer(spec: TokenizerSpec) -> ByteTokenizer | FileTokenizer:
    if spec not in _POOL_TOKENIZERS:
        _POOL_TOKENIZERS[spec] = load_tokenizer(spec)
    return _POOL_TOKENIZERS[spec]


def _counts(source: TextSource, cache_dir: str | Path | None) -> list[tuple[int, int]]:
    """Every chunk's ``(samples, lines)``, from the cache or counted (and cached)."""

    digest = hashlib.sha256(source.fingerprint().encode()).hexdigest()[:32]
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "text" / f"{digest}.json"
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, list) and len(cached) == len(source._chunks):
            return [(int(s), int(n)) for s, n in cached]
    except (OSError, ValueError, TypeError):
        pass
    jobs = [(c, source.text_key, source.spec, source.block_size, source.pack) for c in source._chunks]
    size = sum(c.stop - c.start for c in source._chunks)
    if source.spec.path is None and size <= INLINE_BYTES or len(jobs) == 0:
        counts = [count_chunk(job) for job in jobs]
    else:
        counts = _count_in_pool(jobs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, [list(c) for c in counts])
    except OSError:
        pass  # a read-only cache: counted again next time
    return counts


def _count_in_pool(jobs: list[tuple[Chunk, str, TokenizerSpec, int, bool]]) -> list[tuple[int, int]]:
    """Count in worker processes started as the DataLoader starts its own, sharing the machine
    with the other ranks on it."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    workers = max(1, min(len(jobs), usable // max(1, ranks_here)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(worker_context(None))) as pool:
        return list(pool.map(count_chunk, jobs, chunksize=max(1, len(jobs) // (4 * workers))))


def _chunks(path: str, chunk_bytes: int) -> list[Chunk]:
    """``path`` cut at the first line end after every ``chunk_bytes`` bytes."""
    size = os.path.getsize(path)
    jsonl = path.endswith(".jsonl")
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            f.seek(bounds[-1] + chunk_bytes - 1)
            f.readline()  # to the end of the line that holds the cut
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [Chunk(path, a, b, i == len(bounds) - 2, jsonl) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _first_lines(chunks: list[Chunk], lines: list[int]) -> list[int]:
    """The 1-based line number of each chunk's first line in its file."""
    first: list[int] = []
    for i, chunk in enumerate(chunks):
        same_file = i > 0 and chunks[i - 1].path == chunk.path
        first.append(first[-1] + lines[i - 1] if same_file else 1)
    return first


def _lines(raw: bytes) -> list[bytes]:
    """The lines of ``raw``, each with its newline (the last may have none)."""
    lines = raw.split(b"\n")
    return [line + b"\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
