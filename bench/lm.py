"""A language model side by side: ``keel``'s Trainer against a hand-written loop and transformers'
``Trainer`` on the same tiny GPT-2, and what activation checkpointing saves.

Not a test: it prints figures. A GPT-2 built from a config (2 layers × 128, block 128, vocabulary
of 257 byte tokens, end-of-text 256), batch 8, one thread, on byte tokens of this repository's
own text (README and docs, packed into blocks). Every contender starts from the same weights
(seed 0) and trains STEPS steps of AdamW (lr 3e-4, weight decay 0), clipping at 1.0, cosine
schedule. Step time is taken between consecutive training forwards (a forward pre-hook on the
model: whatever each runs between two steps counts), after the first 5 steps, over interleaved
rounds; each figure is the median over rounds of its ratio to the hand loop of the same round.

- the hand-written loop (DataLoader, shuffled);
- transformers' ``Trainer`` (no saving, no reporting, no evaluation), when ``accelerate`` is installed;
- Lightning, if installed;
- ``keel``'s Trainer with checkpoints off, every protection on;
- ``keel``'s Trainer with its defaults (checkpoints on);
- ``keel``'s Trainer with checkpoints off and ``optim.args: {foreach: false}``: torch's own AdamW
  on the CPU, one tensor at a time (keel's default is the fused AdamW, as transformers' Trainer's
  ``adamw_torch_fused``);
- ``keel``'s Trainer with its defaults on the same text as files (``data.format: text``, byte
  tokenizer, block 128, tokenized and packed in one DataLoader worker): the path a user takes.

Goals: keel (protections on) ≤ 1.0 × transformers' Trainer and ≤ 1.03 × the hand loop; defaults
≤ 1.05 ×. Then peak RSS of 3 steps at block 512, without and with ``train.activation_checkpointing``,
each in a fresh process (peak RSS only grows).

    python bench/lm.py [--rounds 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import torchkeel as tk

ROOT = Path(__file__).resolve().parents[1]
BATCH, BLOCK, EOS, VOCAB = 8, 128, 256, 257
FIRST = 5  # steps left out: the first calls' warm-up
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": VOCAB}


def blocks(block: int) -> list[dict[str, torch.Tensor]]:
    """The repository's text as byte tokens, documents separated by end-of-text, in blocks."""
    ids: list[int] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        ids += list(path.read_bytes()) + [EOS]
    whole = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    return [{"input_ids": row, "labels": row.clone()} for row in whole]


def make_model(block: int = BLOCK) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**GPT2, n_positions=block))


def timed(model: torch.nn.Module) -> list[float]:
    """Start times of the model's training forwards, from now on."""
    stamps: list[float] = []
    model.register_forward_pre_hook(
        lambda module, args: stamps.append(time.perf_counter()) if module.training else None
    )
    return stamps


def step_s(stamps: list[float]) -> float:
    gaps = [b - a for a, b in zip(stamps[FIRST:], stamps[FIRST + 1 :])]
    return statistics.median(gaps)


def hand(data: list, steps: int, out: str) -> float:
    model = make_model()
    stamps = timed(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model.train()
    for step, batch in enumerate(loader, 1):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            loss.item()  # the others read the loss back to log it
        if step == steps:
            break
    return step_s(stamps)


def hf_trainer(data: list, steps: int, out: str) -> float:
    from transformers import Trainer, TrainingArguments

    model = make_model()
    stamps = timed(model)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=3e-4,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return step_s(stamps)


def keel(data: list | None, steps: int, out: str, *extra: str) -> float:
    model = make_model()
    stamps = timed(model)
    config = tk.load_config(
        None,
        [
            f"out_dir={out}",
            "name=lm",
            f"train.batch_size={BATCH}",
            f"train.max_steps={steps}",
            "train.max_epochs=null",
            "optim.lr=3e-4",
            "loss.count_key=labels",
            "data.num_workers=0",
            *extra,
        ],
    )
    tk.Trainer(config, model=model, train_data=data, overwrite=True, progress=False).fit()  # data None: the config's
    return step_s(stamps)


def text_files(out: Path) -> Path:
    """The same documents as ``.txt`` files, for ``data.format: text``."""
    folder = out / "text"
    folder.mkdir(exist_ok=True)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        (folder / f"{path.stem}.txt").write_bytes(path.read_bytes())
    return folder


def keel_text(data: list, steps: int, out: str) -> float:
    folder = text_files(Path(out))
    return keel(
        None, steps, out, "data.format=text", f"data.train={folder}", f"data.block_size={BLOCK}", "data.num_workers=1"
    )


def peak_rss(checkpointing: bool) -> None:
    """Child process: 3 steps at block 512; prints peak RSS in MiB."""
    data = blocks(512)
    with tempfile.TemporaryDirectory() as out:
        model = make_model(512)
        config = tk.load_config(
            None,
            [f"out_dir={out}", f"train.batch_size={BATCH}", "train.max_steps=3", "train.max_epochs=null",
             "data.num_workers=0", "checkpoint.enabled=false", f"train.activation_checkpointing={str(checkpointing).lower()}"],
        )  # fmt: skip
        tk.Trainer(config, model=model, train_data=data, progress=False).fit()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--peak-rss", choices=["on", "off"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak_rss:
        peak_rss(args.peak_rss == "on")
        return
    data = blocks(BLOCK)
    contenders = {"hand-written loop": hand}
    if importlib.util.find_spec("accelerate") is not None:
        contenders["transformers Trainer"] = hf_trainer
    else:
        print("transformers' Trainer: left out (it needs accelerate: pip install accelerate)")
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        print("Lightning: not installed, left out")
    contenders["keel, checkpoints off"] = lambda d, s, o: keel(d, s, o, "checkpoint.enabled=false")
    contenders["keel, defaults"] = lambda d, s, o: keel(d, s, o)
    contenders["keel, text files"] = keel_text
    # keel's default AdamW is fused where torch has the kernel (as transformers' Trainer's
    # adamw_torch_fused); torch.optim.AdamW()'s own CPU default, one tensor at a time, for comparison.
    contenders["keel, checkpoints off, AdamW(foreach=False)"] = lambda d, s, o: keel(
        d, s, o, "checkpoint.enabled=false", "optim.args={foreach: false}"
    )
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as out:
        for run in contenders.values():  # warm-up
            run(data, FIRST + 5, out)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(contenders[name](data, args.steps, out))
    print(f"rounds {args.rounds} x {args.steps} steps, GPT-2 2x128, block {BLOCK}, batch {BATCH}, 1 thread")
    for name in names:
        ratio = statistics.median(t / h for t, h in zip(times[name], times[names[0]]))
        step = statistics.median(times[name])
        print(f"{name:44s} step {step * 1e3:7.2f} ms  {BATCH * BLOCK / step:8.0f} tokens/s  {ratio:.3f} x hand loop")
    if "transformers Trainer" in times:
        for name in ("keel, defaults", "keel, checkpoints off"):
            ratio = statistics.median(k / t for k, t in zip(times[name], times["transformers Trainer"]))
            print(f"{name} (protections on) / transformers Trainer  {ratio:.3f}   (goal <= 1.0)")
    rss = {}
    for flag in ("off", "on"):
        child = subprocess.run(
            [sys.executable, __file__, "--peak-rss", flag], capture_output=True, text=True, check=True
        )
        rss[flag] = float(child.stdout.strip().splitlines()[-1])
    print(
        f"peak RSS, 3 steps at block 512: {rss['off']:.0f} MiB without activation checkpointing, "
        f"{rss['on']:.0f} MiB with ({rss['off'] - rss['on']:.0f} MiB less)"
    )


if __name__ == "__main__":
    main()
