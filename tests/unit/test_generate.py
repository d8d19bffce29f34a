"""``torchkeel.generate``: greedy decoding gives transformers' ``generate(do_sample=False)``
tokens, sampling repeats with its seed, batches decode as their rows alone would, and the text
ends where the rules say."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchkeel.data.sources.tokenizer import ByteTokenizer  # noqa: E402
from torchkeel.lm import GenerationError, generate  # noqa: E402
from torchkeel.lm.decoding import CachedDecoder, RecomputeDecoder, Sequence  # noqa: E402
from torchkeel.lm.sampling import SamplingParams, filtered_logits  # noqa: E402

CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 96, "vocab_size": 257},
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 96,
        "vocab_size": 257,
    },
}


def model_of(kind: str):
    """A model as a user builds one from a config: unseeded, random weights."""
    values = dict(CONFIGS[kind])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), eos_token_id=256, bos_token_id=256, **values)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_decoding_gives_the_tokens_of_transformers_generate(kind):
    model, tokenizer = model_of(kind), ByteTokenizer()
    for prompt in ("Hello, world. ", "é"):
        [out] = generate(model, tokenizer, prompt, max_new_tokens=40, temperature=0)
        ids = torch.tensor([list(prompt.encode())])
        expected = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=256)[0, ids.shape[1] :].tolist()
        if 256 in expected:
            expected = expected[: expected.index(256)]
        assert out.tokens == expected
        assert out.text == tokenizer.decode(expected)


def test_the_cache_gives_the_logits_of_the_whole_sequence_run_again():
    model = model_of("gpt2")
    cached, again = CachedDecoder(model), RecomputeDecoder.of_module(model)
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    a, b = cached.start(prompts), again.start(prompts)
    for step in range(5):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        tokens = [int(t) for t in a.argmax(-1)]
        a, b = cached.step(tokens), again.step(tokens)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_prompts_decoded_together_give_what_each_gives_alone(kind):
    model, tokenizer = model_of(kind), ByteTokenizer()
    prompts = ["Hi", "A longer prompt than the first", "mid"]
    together = generate(model, tokenizer, prompts, max_new_tokens=12, temperature=0)
    alone = [generate(model, tokenizer, p, max_new_tokens=12, temperature=0)[0].tokens for p in prompts]
    assert [g.tokens for g in together] == alone
    assert [g.prompt for g in together] == prompts


def test_sampling_repeats_with_its_seed_and_each_return_sequence_draws_its_own():
    model, tokenizer = model_of("gpt2"), ByteTokenizer()
    kwargs = dict(max_new_tokens=24, temperature=1.5, top_k=100, top_p=0.95, num_return_sequences=3)
    first = [g.tokens for g in generate(model, tokenizer, "seed", seed=7, **kwargs)]
    again = [g.tokens for g in generate(model, tokenizer, "seed", seed=7, **kwargs)]
    other = [g.tokens for g in generate(model, tokenizer, "seed", seed=8, **kwargs)]
    assert first == again and len(first) == 3
    assert len({tuple(t) for t in first}) == 3 and other != first


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    model, tokenizer = model_of("llama"), ByteTokenizer()
    greedy = generate(model, tokenizer, "abc", max_new_tokens=10, temperature=0)[0].tokens
    assert generate(model, tokenizer, "abc", max_new_tokens=10, top_k=1, seed=1)[0].tokens == greedy
    assert generate(model, tokenizer, "abc", max_new_tokens=10, top_p=1e-9, seed=1)[0].tokens == greedy


def test_top_k_and_top_p_keep_the_tokens_transformers_keeps():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.5, 2.5])
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_k=3)).isfinite()
    assert kept.tolist() == [True, False, True, False, True]
    probs = logits.softmax(-1)  # 0.43, 0.06, 0.16, 0.04, 0.26: 0.43 + 0.26 < 0.8 <= + 0.16
    assert probs.sort(descending=True).values[:2].sum() < 0.8
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).isfinite()
    assert kept.tolist() == [True, False, True, False, True]


class Scripted:
    """A model of ``input_ids`` → logits that answers the token ids of ``text`` one by one, then
    end-of-text: what the decoding loop does with the text is then known exactly."""

    def __init__(self, answer: list[int], vocab: int = 257) -> None:
        self.answer, self.vocab = answer, vocab

    def __call__(self, feed):
        ids = feed["input_ids"]
        out = np.zeros((*ids.shape, self.vocab), dtype=np.float32)
        lengths = (feed["attention_mask"] if "attention_mask" in feed else np.ones_like(ids)).sum(1)
        for row, length in enumerate(lengths):
            for t in range(ids.shape[1]):
                done = t - (self.prompt_length - 1)
                token = self.answer[done] if 0 <= done < len(self.answer) else 256
                out[row, t, token] = 10.0
        return out


def scripted_generate(text_bytes: bytes, prompt: str = "ab", **kwargs):
    script = Scripted(list(text_bytes))
    script.prompt_length = len(prompt.encode())
    decoder = RecomputeDecoder(script, ["input_ids", "attention_mask"], max_length=200)
    return generate(None, ByteTokenizer(), prompt, temperature=0, decoder=decoder, **kwargs)[0]


def test_generation_stops_at_end_of_text_at_a_stop_string_or_at_max_new_tokens():
    out = scripted_generate(b"hello world")
    assert (out.text, out.finish_reason) == ("hello world", "stop")
    out = scripted_generate(b"hello world. more", stop=[". "])
    assert (out.text, out.finish_reason) == ("hello world", "stop")
    out = scripted_generate(b"hello world", max_new_tokens=4)
    assert (out.text, out.finish_reason, len(out.tokens)) == ("hell", "length", 4)


def test_streamed_text_never_takes_back_what_it_gave():
    """A character of several bytes, or a stop string still open, is held until it is whole."""
    sequence = Sequence([1], SamplingParams(max_new_tokens=50, stop=("END",)), ByteTokenizer())
    given = [sequence.add(b) for b in "héllo wörld EN and END x".encode()]
    assert "".join(given) == "héllo wörld EN and " and sequence.finish_reason == "stop"
    plain = Sequence([1], SamplingParams(max_new_tokens=50), ByteTokenizer())
    assert [plain.add(b) for b in "hé!".encode()] == ["h", "", "é", "!"]  # é is two bytes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 200}, "max_new_tokens"),
        ({"num_return_sequences": 0}, "num_return_sequences"),
    ],
)
def test_settings_out_of_range_are_errors_naming_the_setting(kwargs, field):
    model = model_of("gpt2")
    with pytest.raises(GenerationError) as caught:
        generate(model, ByteTokenizer(), "prompt", **kwargs)
    assert caught.value.field == field and caught.value.exit_code == 2
    with pytest.raises(GenerationError, match=r"prompt is empty"):
        generate(model, ByteTokenizer(), "", max_new_tokens=3)


def test_the_byte_tokenizer_as_transformers_loads_it(tmp_path):
    from transformers import AutoTokenizer

    from torchkeel.data.sources.tokenizer import TokenizerSpec
    from torchkeel.lm.tokenizer import write_tokenizer

    recorded = write_tokenizer(TokenizerSpec(), tmp_path, max_length=96)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo\n\tworld 🙂 <not special>"
    assert loaded(text)["input_ids"] == list(text.encode())
    assert loaded.decode(list(text.encode())) == text
    assert (loaded.eos_token, loaded.eos_token_id, loaded.model_max_length) == ("<|endoftext|>", 256, 96)
    assert recorded == {
        "file": "tokenizer.json",
        "kind": "byte",
        **{f"{kind}_token": "<|endoftext|>" for kind in ("eos", "bos", "pad")},
        **{f"{kind}_id": 256 for kind in ("eos", "bos", "pad")},
        "vocab_size": 257,
    }


def test_generate_takes_the_tokenizers_users_have_through_one_adapter(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from torchkeel.data.sources.tokenizer import TokenizerSpec
    from torchkeel.lm.tokenizer import write_tokenizer

    write_tokenizer(TokenizerSpec(), tmp_path, max_length=96)
    model = model_of("gpt2")
    tokenizers = [
        ByteTokenizer(),
        AutoTokenizer.from_pretrained(tmp_path),
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
    ]
    prompts = ["Hello, wörld", "x"]
    outs = [generate(model, t, prompts, max_new_tokens=12, temperature=0) for t in tokenizers]
    assert all([(g.text, g.tokens) for g in out] == [(g.text, g.tokens) for g in outs[0]] for out in outs)
    assert all(len(g.tokens) == 12 or g.finish_reason == "stop" for g in outs[0])
    with pytest.raises(TypeError, match="generate takes a torchkeel, transformers or tokenizers tokenizer, got dict"):
        generate(model, {}, "x", max_new_tokens=2)
    for tokenizer in tokenizers:  # text no tokenizer reads is a GenerationError naming where, for every kind
        with pytest.raises(GenerationError, match=r"prompt\[1\] holds a lone surrogate '\\ud800' at character 0"):
            generate(model, tokenizer, ["x", "\ud800x"], max_new_tokens=2)
        with pytest.raises(GenerationError, match=r"stop\[0\] holds a lone surrogate"):
            generate(model, tokenizer, "x", max_new_tokens=2, stop=["\udfff"])


def test_the_generate_code_blocks_of_the_language_models_guide_run_as_written(tmp_path, monkeypatch, capsys):
    """Each Python block and ``keel generate`` line of docs/language-models.md, run in a directory
    that holds what their paths name: a text run and its ``--format hf`` and ONNX exports."""
    import re
    import shlex
    from pathlib import Path

    from textrun import train_text_lm
    from torchkeel.cli.main import main
    from torchkeel.export import export_run
    from torchkeel.export.export import export_pretrained

    text = (Path(__file__).resolve().parents[2] / "docs" / "language-models.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "generate(" in b]
    lines = [line.split("#")[0] for line in re.findall(r"^keel generate .*$", text, re.M)]
    assert blocks and len(lines) >= 4
    run = train_text_lm(tmp_path / "runs", "gpt2-bytes")
    export_pretrained(run)
    export_run(run, "onnx")
    monkeypatch.chdir(tmp_path)
    for n, block in enumerate(blocks):
        capsys.readouterr()
        exec(compile(block, f"docs/language-models.md block {n}", "exec"), {})
        assert capsys.readouterr().out.strip()
    printed = {}
    for line in lines:
        capsys.readouterr()
        assert main(shlex.split(line)[1:]) == 0, line
        printed[line.split()[2]] = capsys.readouterr().out
        assert "def main(" in printed[line.split()[2]]
    assert printed["runs/gpt2-bytes/export-hf"] == printed["runs/gpt2-bytes/export-onnx"]  # "the same text"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_rows_that_join_the_cache_mid_way_decode_as_they_would_alone(kind):
    model = model_of(kind)
    decoder = CachedDecoder(model)
    logits = decoder.start([[5, 6, 7, 8, 9, 10]])
    first = [int(logits.argmax(-1)[0])]
    for _ in range(3):
        first.append(int(decoder.step(first[-1:]).argmax(-1)[0]))
    assert decoder.can_join
    joined = decoder.join([[40, 41]])
    late = [int(joined.argmax(-1)[0])]
    for _ in range(4):
        both = decoder.step([first[-1], late[-1]]).argmax(-1).tolist()
        first.append(both[0])
        late.append(both[1])
    alone = generate(
        model,
        ByteTokenizer(),
        [bytes([5, 6, 7, 8, 9, 10]).decode(), bytes([40, 41]).decode()],
        max_new_tokens=8,
        temperature=0,
    )
    assert first == alone[0].tokens[:8] and late == alone[1].tokens[:5]


def test_the_engine_serves_a_request_of_more_rows_than_its_batch_and_those_queued_behind_it():
    import asyncio

    from torchkeel.serve.generation import GenerationEngine

    class NoEnd(ByteTokenizer):
        eos_id = -1  # a random model may draw end-of-text; here every row runs to its length

    model = model_of("gpt2")
    engine = GenerationEngine(CachedDecoder(model), NoEnd(), max_rows=2)
    engine.start()

    async def ask():
        wide = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.9, seed=1), n=3)
        after = engine.submit([4, 5], SamplingParams(max_new_tokens=4, temperature=0))
        return await asyncio.wait_for(wide.finished(), 60), await asyncio.wait_for(after.finished(), 60)

    try:
        wide, after = asyncio.run(ask())
    finally:
        engine.stop()
    assert [len(r.tokens) for r in wide] == [5, 5, 5] and [r.finish_reason for r in wide] == ["length"] * 3
    assert (
        after[0].tokens
        == generate(model, ByteTokenizer(), bytes([4, 5]).decode(), max_new_tokens=4, temperature=0)[0].tokens
    )
