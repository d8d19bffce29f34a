"""The language-model journey: a GPT-2 built from a config, on a folder of text files tokenized as
bytes and packed into blocks (a line that is not UTF-8 and a line that is not JSON among them),
with the defaults (``num_workers: auto``) → ``keel train`` → SIGKILL mid-epoch → ``--resume
auto`` → the uninterrupted run's weights, bit for bit → ``keel export`` (ONNX, parity, any
sequence length) → ``keel serve`` → its answers equal the eager model's → ``keel generate`` on the
run, its ``--format hf`` and ONNX exports → the same greedy text over Triton's generate, its
stream and the ``openai`` client, from both exports served. The same under torchrun
with 2 ranks (train, kill, resume) is ``slow``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import textdata
import torch
from keelmain import keel_main  # noqa: F401 - a fixture
from test_journeys import Journey, Served

pytest.importorskip("transformers")  # in `all`, so in `make test`; an install without it skips only this

PROMPT = "def dumps(obj"
GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "n_positions": 64,
    "vocab_size": 257,
    "bos_token_id": 256,
    "eos_token_id": 256,
}


class TextJourney(Journey):
    """The journeys' runner (``keel train``/``export`` in subprocesses, SIGKILL of the whole job)
    on the text data and a GPT-2 built from its config."""

    def __init__(self, root: Path, ranks: int) -> None:
        self.root, self.ranks = root, ranks
        train, self.bad = textdata.write(root / "corpus")
        config = {
            "name": "first",
            "seed": 3,
            "model": {"hf": {"config": GPT2}},
            "data": {
                "format": "text",
                "train": str(train),
                "val": str(root / "corpus" / "val"),
                "tokenizer": "byte",
                "block_size": 64,
                "chunk_bytes": 1024,  # 16 blocks: a batch per unit, throttled by textdata:throttle
                "batch_transform": "textdata:throttle",
                "max_bad_fraction": 0.01,
            },
            "loss": {"count_key": "labels"},
            "optim": {"lr": 3e-3},
            "train": {"max_epochs": 2, "batch_size": 16, "log_every": 8, "clip_grad_norm": 1.0},
            "checkpoint": {"every_steps": 10},
        }
        (root / "cfg.yaml").write_text(json.dumps(config))

    def env(self, cache: str = "cache", **extra: str) -> dict[str, str]:
        return super().env(cache, **extra)  # the threads keel train chooses: 2 on 2 cores, bitwise

    def check_bad_lines(self, name: str) -> None:
        """Each bad line is named by file and line in every epoch, and the run completed both epochs."""
        summary = json.loads((self.run_dir(name) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["epochs"] == 2
        incidents = [json.loads(line) for line in (self.run_dir(name) / "incidents.jsonl").read_text().splitlines()]
        bad = sorted(r["where"] for r in incidents if r["kind"] == "bad_sample")
        assert bad == sorted(self.bad * 2), bad

    def export_and_serve(self, name: str, keel_main) -> None:
        """ONNX export with parity at the data's length and another; served answers at a third
        length equal the eager model's. ``keel export`` (ONNX) and ``keel serve`` run as a user
        runs them; ``keel export --format hf`` and ``keel generate`` in this process (``keel_main``):
        test_cli and test_lm_generation run them as subprocesses."""
        from transformers import AutoModelForCausalLM, GPT2Config

        meta = self.export(name, "onnx", self.root / "export-onnx")
        assert meta["parity"]["passed"]
        assert [(i["name"], i["shape"]) for i in meta["inputs"]] == [("input_ids", [-1, -1])]
        assert {tuple(r.get("shapes", {}).get("input_ids", [0, 64])[1:]) for r in meta["parity"]["results"]} == {
            (64,),
            (32,),
        }
        eager = AutoModelForCausalLM.from_config(GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"}))
        eager.load_state_dict(self.weights(name))
        eager.eval()
        prompt = torch.tensor([list(b"def dumps(obj, *, skipkeys=False"), list(b"class DictReader(f, fieldnames=N")])
        with torch.inference_mode():
            expected = eager(input_ids=prompt).logits.numpy()
        with Served(self.root / "export-onnx", self.env()) as server:
            answer = server.v2(meta["name"], {"input_ids": prompt})
            served = self.served_text(server, meta["name"])
        assert answer.shape == (2, prompt.shape[1], 257)
        assert np.abs(answer - expected).max() <= 1e-5
        exported = keel_main("export", str(self.run_dir(name)), "--format", "hf", "--out", "export-hf", cwd=self.root)
        assert exported.returncode == 0, exported.stderr[-3000:]
        with Served(self.root / "export-hf", self.env()) as server:  # decoded with its cache
            served_hf = self.served_text(server, meta["name"])
        sampled = self.generated(self.run_dir(name), keel_main)  # the other sources: tests/e2e/test_lm_generation.py
        assert sampled == PROMPT + served["generate"], (sampled, served)
        assert served == served_hf and len(set(served.values())) == 1, (served, served_hf)

    def generated(self, source: Path, keel_main) -> str:
        """``keel generate`` greedy, as a user samples from a run or an export."""
        result = keel_main(
            "generate", str(source), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "24", cwd=self.root
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout[:-1]

    def served_text(self, server: Served, name: str) -> dict[str, str]:
        """The greedy continuation over Triton's generate, its stream, and the openai client."""
        import openai

        greedy = {"max_tokens": 24, "temperature": 0}
        out = {"generate": server.post(f"/v2/models/{name}/generate", {"text_input": PROMPT, "parameters": greedy})}
        out["generate"] = out["generate"]["text_output"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        out["openai"] = client.completions.create(model=name, prompt=PROMPT, **greedy).choices[0].text
        stream = client.completions.create(model=name, prompt=PROMPT, stream=True, **greedy)
        out["openai stream"] = "".join(chunk.choices[0].text for chunk in stream)
        return out


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"])
def test_the_text_journey(tmp_path, keel_main, ranks):
    run = TextJourney(tmp_path, ranks)
    run.train("first", "cache")
    run.check_bad_lines("first")
    reference = run.weights("first")
    if ranks == 1:  # on the threads keel train chooses (2 here): a second uninterrupted run is the same
        run.train("again", "cache-again")
        assert run.differences("first", "again") == {}  # on failure: the tensors, then each run's losses and workers
    run.kill_mid_epoch_and_resume("killed", "cache")
    run.check_bad_lines("killed")
    weights = run.weights("killed")
    assert weights.keys() == reference.keys()
    differ = {k: float((reference[k] - v).abs().max()) for k, v in weights.items() if not torch.equal(reference[k], v)}
    assert differ == {}
    if ranks == 1:
        run.export_and_serve("first", keel_main)
