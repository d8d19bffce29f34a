"""A language model after training, as a user takes it: sample from the run with ``keel
generate``, export it (``--format hf`` for transformers' tools, ONNX for the server) with its
tokenizer, and get the same text from each."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from keelproc import run_keel  # noqa: E402
from lmruns import GPT2, LLAMA, PROMPT, corpus, train_lm, trained_tokenizer  # noqa: E402

import torchkeel as tk  # noqa: E402
from torchkeel.cli.main import main  # noqa: E402
from torchkeel.export import export_run  # noqa: E402
from torchkeel.export.export import export_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    text = corpus(out)
    tokenizer = trained_tokenizer(text, out / "tokenizer")
    gpt2 = train_lm(out, "gpt2-bpe", GPT2 % 384, f"data.tokenizer={tokenizer}")
    llama = train_lm(out, "llama-docs", LLAMA, "data.pack=false", "data.collate=pad", steps=8)
    return out, tokenizer, gpt2, llama


def keel(capsys, *argv: str) -> tuple[int, str, str]:
    """``keel ARGV`` in this process (a subprocess pays seconds of imports per call): exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generated(capsys, source, *args: str) -> str:
    code, out, err = keel(capsys, "generate", str(source), "--prompt", PROMPT, *args)
    assert code == 0, err
    return out


def test_the_run_and_its_exports_generate_the_same_greedy_text_as_transformers(runs, capsys):
    out, tokenizer, gpt2, _ = runs
    hf = export_pretrained(gpt2)
    export_run(gpt2, "onnx")
    args = ("--temperature", "0", "--max-new-tokens", "24")
    texts = {where: generated(capsys, where, *args) for where in (hf, gpt2 / "export-onnx")}
    done = run_keel("generate", str(gpt2), "--prompt", PROMPT, *args, cwd=out)  # as a user runs it
    assert done.returncode == 0, done.stderr
    texts[gpt2] = done.stdout
    assert len(set(texts.values())) == 1, texts
    assert texts[gpt2].startswith(PROMPT) and len(texts[gpt2]) > len(PROMPT) + 5

    ids = transformers.AutoTokenizer.from_pretrained(hf)(PROMPT, return_tensors="pt")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    greedy = model.generate(ids, do_sample=False, max_new_tokens=24)[0]
    assert texts[gpt2] == transformers.AutoTokenizer.from_pretrained(hf).decode(greedy, skip_special_tokens=True) + "\n"


def test_the_hf_export_carries_the_training_tokenizer_and_pipeline_continues_a_prompt(runs):
    from tokenizers import Tokenizer

    out, tokenizer, gpt2, _ = runs
    hf = export_pretrained(gpt2, out / "hf-export")
    loaded = transformers.AutoTokenizer.from_pretrained(hf)
    trained = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    sample = (out / "text" / "val" / "bisect.txt").read_text()[:2000]
    assert loaded(sample)["input_ids"] == trained.encode(sample).ids
    assert loaded.eos_token == "<|endoftext|>" and loaded.model_max_length == 64
    pipe = transformers.pipeline("text-generation", model=str(hf))
    [answer] = pipe(PROMPT, max_new_tokens=12, do_sample=False)
    assert answer["generated_text"].startswith(PROMPT) and len(answer["generated_text"]) > len(PROMPT)
    [default] = pipe(PROMPT)  # the pipeline's own length stays within the model's 64 positions
    assert default["generated_text"].startswith(PROMPT)


def test_an_unpacked_llama_run_exports_with_every_sequence_axis_dynamic_and_its_byte_tokenizer(runs, capsys):
    out, _, _, llama = runs
    meta = export_run(llama, "onnx")
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert all(t["dims"] == ["batch", "length"] and t["max_shape"] == [-1, 64] for t in inputs.values())
    checked = [r["shapes"] for r in meta["parity"]["results"] if "shapes" in r]
    assert any(s["input_ids"] == s["attention_mask"] and s["input_ids"][1] < 32 for s in checked), checked
    assert meta["parity"]["passed"] and meta["max_length"] == 64 and meta["task"] == "causal-lm"
    assert meta["tokenizer"]["kind"] == "byte"
    text = generated(capsys, llama / "export-onnx", "--temperature", "0", "--max-new-tokens", "5")
    assert text == generated(capsys, llama, "--temperature", "0", "--max-new-tokens", "5")


def test_sampling_from_the_cli_repeats_with_a_seed_and_mistakes_exit_2(runs, capsys):
    out, _, gpt2, _ = runs
    args = ("--temperature", "0.9", "--top-p", "0.9", "--seed", "3", "--num-return-sequences", "2")
    first = generated(capsys, gpt2, *args)
    assert first == generated(capsys, gpt2, *args) and first.count("--- ") == 2
    code, _, err = keel(capsys, "generate", str(gpt2), "--prompt", PROMPT, "--max-new-tokens", "80")
    assert code == 2 and "max_new_tokens is too large" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    code, _, err = keel(capsys, "generate", str(gpt2), "--prompt", PROMPT, "--top-p", "0")
    assert code == 2 and "top_p must be in (0, 1]" in err


def test_model_json_of_an_lm_export_references_its_tokenizer(runs):
    _, _, gpt2, _ = runs
    meta = json.loads((gpt2 / "export-onnx" / "model.json").read_text())
    assert meta["tokenizer"]["file"] == "tokenizer.json" and (gpt2 / "export-onnx" / "tokenizer.json").is_file()
    assert meta["tokenizer"]["eos_token"] == "<|endoftext|>" and meta["tokenizer"]["vocab_size"] == 384


CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A small local model as users have one: a GPT-2 built from a config (nothing downloaded),
    saved with ``save_pretrained`` beside its BPE tokenizer and a chat template."""
    out = tmp_path_factory.mktemp("pretrained")
    base = trained_tokenizer(corpus(out), out / "base")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(base)
    eos = tokenizer.eos_token_id
    config = transformers.AutoConfig.for_model(
        "gpt2",
        n_layer=1,
        n_head=2,
        n_embd=32,
        n_positions=64,
        vocab_size=len(tokenizer),
        eos_token_id=eos,
        bos_token_id=eos,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base)
    return out, base


@pytest.mark.parametrize("data", ["token-ids", "text"])
def test_a_fine_tune_of_a_local_model_exports_with_its_tokenizer_and_chat_template_and_serves(pretrained, capsys, data):
    from serveproc import Server

    out, base = pretrained
    name = f"fine-tune-{data}"
    sources = {
        "token-ids": {"target": "tokens:make_data", "args": {"num_train": 32, "num_val": 8}, "collate": "pad"},
        "text": {"format": "text", "train": str(out / "text" / "train"), "val": str(out / "text" / "val"),
                 "tokenizer": str(base), "block_size": 32},
    }  # fmt: skip
    config = {
        "name": name,
        "out_dir": str(out),
        "model": {"hf": {"path": str(base)}},
        "data": {**sources[data], "num_workers": 0},
        "loss": {"count_key": "labels"},
        "train": {"max_steps": 2, "batch_size": 8},
    }
    (out / f"{name}.yaml").write_text(json.dumps(config))
    assert keel(capsys, "train", str(out / f"{name}.yaml"))[0] == 0
    code, _, err = keel(capsys, "export", str(out / name), "--format", "hf")
    assert code == 0, err
    export = out / name / "export-hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    original = transformers.AutoTokenizer.from_pretrained(base)
    assert tokenizer.chat_template == CHAT and tokenizer(PROMPT)["input_ids"] == original(PROMPT)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
    meta = json.loads((export / "model.json").read_text())
    assert (
        meta["task"] == "causal-lm" and meta["parity"]["passed"] and meta["tokenizer"]["eos_token"] == "<|endoftext|>"
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    [expected] = tk.generate(model, tokenizer, PROMPT, max_new_tokens=8, temperature=0)
    server = Server(export)
    try:
        body = json.dumps({"text_input": PROMPT, "parameters": {"max_tokens": 8, "temperature": 0}})
        status, raw, _ = server.request("POST", f"/v2/models/{name}/generate", body)
    finally:
        assert server.stop() == 0
    assert status == 200, raw
    assert json.loads(raw)["text_output"] == expected.text
