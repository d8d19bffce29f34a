"""The ``data`` section of the configuration: sources, batching, workers, image preprocessing and
text tokenizing (``KeelConfig.data``; every key is documented in ``docs/config.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


@dataclass
class PreprocessConfig:
    mode: Optional[Literal["RGB", "L"]] = None
    """Decode each sample's input as an image in this mode (``null``: no image preprocessing).
    The input is the first item of a tuple sample or the ``input`` key of a dict sample: encoded
    bytes, a file path, a PIL image or a uint8 array. ``keel export`` records these keys in
    ``model.json`` and ``keel serve`` applies the same code to the images it receives."""
    resize: Union[int, list[int], None] = None
    """An int scales the shorter side to it; ``[height, width]`` resizes to that size (``null``: no resize)."""
    crop: Union[int, list[int], None] = None
    """A centre crop of ``size`` or ``[height, width]`` after the resize (``null``: no crop)."""
    interpolation: Literal["nearest", "bilinear", "bicubic"] = "bilinear"
    """The resize filter (Pillow's, antialiased, as torchvision's ``Resize`` uses on images)."""
    scale: float = 1 / 255
    """Pixel values are multiplied by this first (1/255: [0, 1], as ``ToTensor``)."""
    mean: list[float] = field(default_factory=list)
    """Subtracted per channel after scaling (empty: nothing)."""
    std: list[float] = field(default_factory=list)
    """Divided by per channel after the mean (empty: nothing)."""


@dataclass
class TokenizerConfig:
    path: str = ""
    """A directory written by ``save_pretrained`` (its ``tokenizer.json``) or a ``tokenizer.json``."""
    eos: Optional[str] = None
    """The end-of-text token put between documents (``null``: the one the tokenizer's config names,
    or ``<|endoftext|>``, ``</s>``, ``<eos>`` if it has one)."""


@dataclass
class DataConfig:
    format: Literal["map", "parquet", "webdataset", "text", "datasets"] = "map"
    """``map``: ``target`` returns map-style datasets; ``parquet`` / ``webdataset`` / ``text``:
    stream the files of ``train`` / ``val``; ``datasets``: ``train`` / ``val`` are Hugging Face
    datasets on disk (``save_to_disk`` directories or ``.arrow`` files), read map-style."""
    target: Optional[str] = None
    """Format ``map``: ``module:callable`` that returns ``(train_dataset, val_dataset)``.
    Streaming formats: the label column (Parquet) or sample key (WebDataset, e.g. ``cls``);
    ``null`` for samples without a label."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``target``."""
    train: Union[str, list[str], None] = None
    """Streaming formats: the training files — a glob, a brace pattern (``train-{000..099}.tar``),
    a directory, or a list of them."""
    val: Union[str, list[str], None] = None
    """Streaming formats: the validation files (``null``: no validation)."""
    input: Union[str, list[str], None] = None
    """Parquet: the feature columns (stacked into one vector) or one list-valued column.
    WebDataset: the sample key of the input (``npy``); ``null`` yields the decoded sample as a dict."""
    columns: list[str] = field(default_factory=list)
    """Parquet, instead of ``input``/``target``: samples are dicts of these columns, one tensor
    each — a number, a vector, or a variable-length list (with ``collate: pad``) — for a model
    called as ``model(**batch)`` (``[input_ids, labels]``)."""
    image: Optional[str] = None
    """WebDataset: decode images with this ``webdataset`` spec (``rgb8``, ``torchrgb``...; needs Pillow)."""
    transform: Optional[str] = None
    """``module:callable`` applied to each sample (a sample that makes it raise is skipped and named)."""
    batch_transform: Optional[str] = None
    """Parquet: ``module:callable`` applied to each block of rows, already tensors (vectorized)."""
    collate: str = "default"
    """``default`` (stack), ``pad`` (pad variable lengths to the longest of the batch) or
    ``module:callable`` taking the list of samples."""
    pad_value: Union[float, dict[str, float]] = 0.0
    """What ``collate: pad`` fills with: a number, or a number per key (``{input_ids: 0, labels:
    -100}``; tuple samples: an index, ``input`` or ``target``). Integer ``labels`` (and the
    integer target of an ``(input, target)`` pair) get -100 unless named."""
    mask_key: Optional[str] = "attention_mask"
    """``collate: pad``: dict samples without this key get it (1 on the real elements of the
    first sequence key, ``input_ids`` if there is one); ``null``: no mask is added."""
    lengths_key: Optional[str] = None
    """``collate: pad``: dict samples get each one's sequence length under this key (e.g.
    ``lengths``, for ``loss.count_key``); ``null`` (the default) adds none, so a strict
    ``forward(input_ids, attention_mask, labels)`` takes the batch."""
    bucket_by: Optional[str] = None
    """Group samples of similar length: a list-valued column (Parquet), or a dict key / ``input``
    / ``target`` of the sample (map-style datasets; lengths are read once at the start)."""
    bucket_window: int = 4096
    """Samples sorted by length together when bucketing (a window of the seeded order)."""
    shuffle_buffer: int = 1000
    """WebDataset: samples held by the seeded shuffle buffer within a shard (0: shard order).
    Parquet row groups are shuffled whole."""
    drop_last: bool = False
    """Drop the last short batch (of each worker's stream, for streaming formats)."""
    streams: int = 8
    """Streaming formats: the streams each rank reads in turn. The batches and their order depend
    on the seed, the epoch, the number of ranks and this — not on ``num_workers`` — so a run is
    the same with any number of workers; each stream keeps one unit open (a row group, a shard
    and its shuffle buffer), and more workers than streams would have nothing to read."""
    num_workers: Union[int, Literal["auto"]] = "auto"
    """DataLoader worker processes (0 loads in the training process); ``auto`` times 0, 1, 2, …
    up to the usable CPUs on the real data at the start and keeps the fastest (cached per data
    and machine). It changes how fast batches come, never which batches or their order."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    max_bad_fraction: float = 0.001
    """Stop with an error listing them when more than this share of an epoch's samples are bad
    (fail to read, decode or transform); below it they are skipped and recorded as incidents."""
    shuffle: bool = True
    """Shuffle the training set each epoch (the order depends only on ``seed`` and the epoch)."""
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    """Image decoding and normalization of each sample's input, recorded in the export for serving."""
    tokenizer: Union[str, TokenizerConfig] = "byte"
    """Text: ``byte`` (UTF-8 bytes as ids 0-255, end-of-text 256), a directory written by
    ``save_pretrained`` (its ``tokenizer.json``) or a ``tokenizer.json`` file, or ``{path, eos}``."""
    block_size: int = 1024
    """Text: tokens per sample."""
    pack: bool = True
    """Text: join documents with the end-of-text token and cut them into full blocks; ``false``:
    a document per sample, cut into pieces of at most ``block_size`` (needs ``collate: pad``)."""
    text_key: str = "text"
    """Text: the string field of each ``.jsonl`` line."""
    chunk_bytes: int = 1048576
    """Text: about how many bytes of a file make one unit of work (cut at a line end)."""
    mlm_probability: Optional[float] = None
    """Text, for a masked LM (``model.hf.task: masked-lm``): the share of tokens masked in each
    sample (BERT: 0.15; 80 % become the mask token, 10 % a random one, 10 % stay). ``null``:
    the labels are the ids (a causal LM)."""
