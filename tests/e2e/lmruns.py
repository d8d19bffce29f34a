"""Language-model runs as users make them, for the generation, export and serving tests: a
folder of text files, a BPE tokenizer trained on it with ``tokenizers`` and saved with
``save_pretrained``, and models built from transformers configs (unseeded, as a user's are)."""

from __future__ import annotations

import sys
from pathlib import Path

import torchkeel as tk

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("json", "textwrap", "heapq", "bisect")
PROMPT = "The function returns"
GPT2 = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 48, n_positions: 64, vocab_size: %d}"
LLAMA = (
    "{model_type: llama, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, hidden_size: 48, "
    "intermediate_size: 96, max_position_embeddings: 64, vocab_size: 257}"
)


def corpus(root: Path) -> Path:
    """``root/text/{train,val}``: a few modules' documentation, a file each."""
    sys.path.insert(0, str(ROOT / "examples" / "text"))
    try:
        import corpus as docs
    finally:
        sys.path.pop(0)
    for split, names in (("train", MODULES[:-1]), ("val", MODULES[-1:])):
        (root / "text" / split).mkdir(parents=True, exist_ok=True)
        for name in names:
            (root / "text" / split / f"{name}.txt").write_text(docs.documentation(name)[:20000], encoding="utf-8")
    return root / "text"


def trained_tokenizer(text: Path, out: Path, vocab_size: int = 384) -> Path:
    """A byte-level BPE trained on the training files and saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(p) for p in sorted((text / "train").glob("*.txt"))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def train_lm(out: Path, name: str, model: str, *overrides: str, steps: int = 30) -> Path:
    config = tk.load_config(
        None,
        [
            f"out_dir={out}",
            f"name={name}",
            "data.format=text",
            f"data.train={out / 'text' / 'train'}",
            f"data.val={out / 'text' / 'val'}",
            "data.block_size=32",
            "data.num_workers=0",
            f"model.hf.config={model}",
            "loss.count_key=labels",
            f"train.max_steps={steps}",
            "train.batch_size=8",
            "optim.lr=3e-3",
            *overrides,
        ],
    )
    tk.Trainer(config, progress=False).fit()
    return out / name
