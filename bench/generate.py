"""Generation side by side: ``torchkeel.generate`` against transformers' ``generate()`` on the same
model and prompt, and the server's batched decoding against the same streams one after another.

Not a test: it prints figures. A GPT-2 built from a config (2 layers × 128, 256 positions, 257
byte tokens), one thread, a prompt of 32 bytes of this repository's README, 96 new tokens with no
end-of-text (both run to ``max_new_tokens``). In interleaved rounds:

- in process: tokens/s of ``torchkeel.generate`` and of ``model.generate``, greedy and sampled
  (temperature 0.8, top-k 50, top-p 0.95); each figure is the median over rounds of keel's
  tokens/s ÷ transformers'. Goal: ≥ 0.95.
- served (``keel serve`` of the model's ``--format hf`` export, decoded with its cache, then of
  its ONNX export, recomputed each step; after one training step so that it is a run): 8 streams (``/v2/models/m/generate_stream``) at once against the same 8 one after
  another, tokens/s. Goal: ≥ 2×. Time to first token of one stream against ``generate(max_new_tokens=1)``
  in process plus the HTTP round trip of a health probe. Goal: ≤ 1.2×.

The last line gives both exports' ratios side by side: the hf export decodes with its key/value
cache and scales with streams; the ONNX export has no cache and recomputes every row's whole
sequence each step, so streams at once gain little or lose (it was measured at 0.49-0.56x).

    python bench/generate.py [--rounds 5] [--served-only]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import torchkeel as tk
from torchkeel.data.sources.tokenizer import ByteTokenizer
from torchkeel.export import export_run
from torchkeel.export.export import export_pretrained

ROOT = Path(__file__).resolve().parents[1]
NEW = 96
GPT2 = "{model_type: gpt2, n_layer: 2, n_embd: 128, n_head: 2, n_positions: 256, vocab_size: 257}"


class NoEnd(ByteTokenizer):
    eos_id = -1  # never drawn: every generation runs to max_new_tokens, as transformers' with eos None


def in_process(rounds: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=128, n_head=2, n_positions=256, vocab_size=257)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = (ROOT / "README.md").read_bytes()[:32].decode("utf-8", "ignore")
    ids = torch.tensor([list(prompt.encode())])
    settings = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_k": 50, "top_p": 0.95}}
    ratios: dict[str, list[float]] = {name: [] for name in settings}
    rates: dict[str, list[float]] = {f"{who} {name}": [] for who in ("keel", "hf") for name in settings}
    for _ in range(rounds + 1):  # the first round warms both up and is left out
        for name, kw in settings.items():
            start = time.perf_counter()
            [out] = tk.generate(model, NoEnd(), prompt, max_new_tokens=NEW, seed=0, **kw)
            keel = len(out.tokens) / (time.perf_counter() - start)
            hf_kw = {"do_sample": False} if name == "greedy" else {"do_sample": True, **kw}
            start = time.perf_counter()
            with torch.inference_mode():
                made = model.generate(
                    ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0, **hf_kw
                )
            hf = (made.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
            rates[f"keel {name}"].append(keel)
            rates[f"hf {name}"].append(hf)
            ratios[name].append(keel / hf)
    print(f"in process, {NEW} new tokens, {rounds} rounds (median):")
    for name in settings:
        keel, hf = statistics.median(rates[f"keel {name}"][1:]), statistics.median(rates[f"hf {name}"][1:])
        print(
            f"  {name:8s} keel {keel:8.0f} tok/s   transformers {hf:8.0f} tok/s   ratio {statistics.median(ratios[name][1:]):.3f}"
        )


def served(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "text").mkdir()
        (out / "text" / "readme.txt").write_text((ROOT / "README.md").read_text() * 4)
        config = tk.load_config(None, [f"out_dir={out}", "name=m", "data.format=text", f"data.train={out / 'text'}",
                                       "data.block_size=64", "data.num_workers=0", f"model.hf.config={GPT2}",
                                       "loss.count_key=labels", "train.max_steps=1", "train.batch_size=2"])  # fmt: skip
        tk.Trainer(config, progress=False).fit()
        export_run(out / "m", "onnx")
        export_pretrained(out / "m")
        ratios = {kind: _serve_one(out / "m" / kind, rounds) for kind in ("export-hf", "export-onnx")}
    print("8 streams at once / the same 8 one after another, tokens/s (goal >= 2): "
          + "   ".join(f"{kind} {ratio:.2f}x" for kind, ratio in ratios.items()))  # fmt: skip


def _serve_one(export: Path, rounds: int) -> float:
    """Serve ``export``, print its figures; returns the tokens/s of 8 streams at once over one after another."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "torchkeel.cli.main", "serve", str(export), "--port", str(port),
         "--grpc-port", "0"], env={"OMP_NUM_THREADS": "1", **_env()}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait_ready(port)
        prompt = (ROOT / "README.md").read_text()[:32]
        one_after: list[float] = []
        at_once: list[float] = []
        ttft, baseline = [], []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            tokens = sum(_stream(port, prompt, NEW)[1] for _ in range(8))
            one_after.append(tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                tokens = sum(n for _, n in pool.map(lambda _: _stream(port, prompt, NEW), range(8)))
            at_once.append(tokens / (time.perf_counter() - start))
            ttft.append(_stream(port, prompt, 1)[0])
            baseline.append(_in_process_first_token(export, prompt) + _round_trip(port))
        sequential, together = statistics.median(one_after[1:]), statistics.median(at_once[1:])
        print(f"served ({export.name}, {NEW} new tokens, {rounds} rounds, median):")
        print(f"  8 streams one after another {sequential:8.0f} tok/s   8 at once {together:8.0f} tok/s   "
              f"ratio {together / sequential:.2f}")  # fmt: skip
        first, base = statistics.median(ttft[1:]), statistics.median(baseline[1:])
        print(f"  time to first token {first * 1e3:.2f} ms   in-process generate + HTTP round trip "
              f"{base * 1e3:.2f} ms   ratio {first / base:.2f}")  # fmt: skip
        return together / sequential
    finally:
        server.terminate()
        server.wait(timeout=60)


_LOADED: dict[Path, object] = {}


def _in_process_first_token(export: Path, prompt: str) -> float:
    """``generate(max_new_tokens=1)`` on the same export, loaded in this process."""
    if export not in _LOADED:
        _LOADED[export] = tk.open_language_model(export)
    lm = _LOADED[export]
    start = time.perf_counter()
    tk.generate(lm.model, lm.tokenizer, prompt, max_new_tokens=1, temperature=0, decoder=lm.decoder)
    return time.perf_counter() - start


def _stream(port: int, prompt: str, tokens: int) -> tuple[float, int]:
    """One generate_stream request: seconds to its first event, and the tokens it was given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"text_input": prompt, "parameters": {"max_tokens": tokens, "temperature": 0}}
    start = time.perf_counter()
    conn.request("POST", "/v2/models/m/generate_stream", json.dumps(body))
    response = conn.getresponse()
    first = None
    while line := response.readline():
        if line.startswith(b"data: ") and first is None:
            first = time.perf_counter() - start
    conn.close()
    return first or 0.0, tokens


def _round_trip(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    start = time.perf_counter()
    conn.request("GET", "/v2/health/ready")
    conn.getresponse().read()
    conn.close()
    return time.perf_counter() - start


def _wait_ready(port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--served-only", action="store_true", help="only the served figures (both exports)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.served_only:
        in_process(args.rounds)
    served(args.rounds)


if __name__ == "__main__":
    main()
