"""What the resume's data check costs (``torchkeel.data.inputs``): a whole resume of a text run over
FILES files with the check against the same resume without it (the check replaced by nothing),
in interleaved rounds, one more step each time; and a fresh run's fingerprint (every file's
head and tail read and hashed), timed alone.

Not a test: it prints figures. Goal: the check adds <= 1 % to the resume.

    python bench/resume_inputs.py [--files 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torchkeel as tk
from torchkeel.config import load_config
from torchkeel.data.inputs import fingerprint_inputs
from torchkeel.data.sources.text import TextSource
from torchkeel.train import checkpointing


def nothing(sources, known=None):
    """No check: the checkpoint's record passed on as it is (so the next resume with the check finds it)."""
    return dict(known or {})


GPT2 = "{model_type: gpt2, n_layer: 1, n_head: 2, n_embd: 16, n_positions: 32, vocab_size: 257}"


def config(root: Path, steps: int):
    return load_config(
        None,
        [
            f"out_dir={root / 'runs'}",
            "name=bench",
            "data.format=text",
            f"data.train={root / 'corpus'}",
            "data.block_size=32",
            "data.num_workers=0",
            f"model.hf.config={GPT2}",
            "loss.count_key=labels",
            "train.batch_size=8",
            f"train.max_steps={steps}",
            "train.max_epochs=null",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        for i in range(args.files):
            (root / "corpus" / f"doc-{i:05d}.txt").write_text(
                f"document {i}: " + "some words of text. " * (20 + i % 200)
            )
        tk.Trainer(config(root, 1), progress=False).fit()  # counts the blocks once (cached) and saves
        times: dict[str, list[float]] = {"with": [], "without": [], "fresh": []}
        steps = 1
        for _ in range(args.rounds):
            for contender in ("with", "without"):
                steps += 1
                checkpointing.fingerprint_inputs = fingerprint_inputs if contender == "with" else nothing
                start = time.perf_counter()
                tk.Trainer(config(root, steps), resume="auto", progress=False).fit()
                times[contender].append(time.perf_counter() - start)
            source = TextSource(str(root / "corpus"), block_size=32)
            start = time.perf_counter()
            fingerprint_inputs({"data.train": source})
            times["fresh"].append(time.perf_counter() - start)
        checkpointing.fingerprint_inputs = fingerprint_inputs
        ratio = statistics.median(w / o for w, o in zip(times["with"], times["without"]))
        print(f"files {args.files}, rounds {args.rounds}")
        print(f"resume with the check      median {statistics.median(times['with']):.3f} s")
        print(f"resume without it          median {statistics.median(times['without']):.3f} s")
        print(f"with / without             {ratio:.4f}   (goal <= 1.01)")
        print(f"a fresh run's fingerprint  median {statistics.median(times['fresh']) * 1e3:.1f} ms (every file read)")


if __name__ == "__main__":
    main()
