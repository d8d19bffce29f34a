"""``keel serve`` of a language model's export: text in and text out over Triton's generate
extension and OpenAI's completions (the ``openai`` client, unchanged), the same text as ``keel
generate``, requests decoded together, and every client mistake a 4xx naming the field."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from lmruns import GPT2, PROMPT, corpus, train_lm, trained_tokenizer  # noqa: E402
from serveproc import Server, metric  # noqa: E402

from torchkeel import generate, open_language_model  # noqa: E402
from torchkeel.export import export_run  # noqa: E402
from torchkeel.export.export import export_pretrained  # noqa: E402

NAME = "served-lm"
PROMPTS = ["The function returns", "Return the", "import", "A list of", "If the", "x", "This module", "def"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-serve")
    tokenizer = trained_tokenizer(corpus(out), out / "tokenizer")
    run = train_lm(out, NAME, GPT2 % 384, f"data.tokenizer={tokenizer}")
    export_run(run, "onnx")
    export_pretrained(run)
    return out, run


@pytest.fixture(scope="module")
def server(export):
    server = Server(export[1] / "export-onnx")
    yield server
    assert server.stop() == 0


def cli_text(export, prompt: str, tokens: int) -> str:
    """What ``keel generate --temperature 0`` gives: the library call behind it."""
    lm = open_language_model(export[1])
    return generate(lm.model, lm.tokenizer, prompt, max_new_tokens=tokens, temperature=0, decoder=lm.decoder)[0].text


def post(server, path: str, body) -> tuple[int, dict]:
    status, raw, _ = server.request("POST", path, json.dumps(body) if not isinstance(body, str) else body)
    return status, json.loads(raw)


def client(server):
    return openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_every_protocol_gives_the_greedy_text_of_keel_generate(export, server):
    expected = cli_text(export, PROMPT, 20)
    assert expected
    greedy = {"max_tokens": 20, "temperature": 0}
    status, answer = post(server, f"/v2/models/{NAME}/generate", {"text_input": PROMPT, "parameters": greedy})
    assert status == 200 and answer["text_output"] == expected and answer["model_name"] == NAME

    status, raw, headers = server.request(
        "POST", f"/v2/models/{NAME}/generate_stream", json.dumps({"text_input": PROMPT, "parameters": greedy})
    )
    events = [json.loads(line[len("data: ") :]) for line in raw.decode().split("\n\n") if line]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert "".join(e["text_output"] for e in events) == expected and events[-1]["finish_reason"] == "length"

    openai_client = client(server)
    done = openai_client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 20 and done.usage.prompt_tokens > 0
    stream = openai_client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected


def test_concurrent_requests_decode_together_and_each_gets_its_own_text(export, server):
    alone = {p: cli_text(export, p, 16) for p in PROMPTS[:3]}
    openai_client = client(server)

    def ask(prompt: str) -> str:
        return openai_client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, PROMPTS * 2))
    assert answers[: len(PROMPTS)] == answers[len(PROMPTS) :]
    assert {p: a for p, a in zip(PROMPTS, answers)}.items() >= alone.items()
    several = openai_client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=16, temperature=0, n=2)
    assert [c.text for c in several.choices] == [answers[0], answers[0], answers[1], answers[1]]


def test_sampling_repeats_with_a_seed_over_http(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    first, again = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert first[0] == 200 and first[1]["choices"][0]["text"] == again[1]["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v2/models/{m}/generate", {"text_input": ""}, 400, "text_input is empty"),
        (
            "/v2/models/{m}/generate",
            {"text_input": "x", "parameters": {"max_tokens": 64}},
            400,
            "parameters.max_tokens is too large",
        ),
        (
            "/v2/models/{m}/generate",
            {"text_input": "x", "parameters": {"temperature": -1}},
            400,
            "parameters.temperature must be >= 0",
        ),
        (
            "/v2/models/{m}/generate",
            {"text_input": "x", "parameters": {"top_p": 0}},
            400,
            "parameters.top_p must be in (0, 1]",
        ),
        ("/v2/models/{m}/generate", {"text_input": "x", "parameters": {"top_p": 1.5}}, 400, "parameters.top_p"),
        (
            "/v2/models/{m}/generate",
            {"text_input": "x", "parameters": {"beams": 2}},
            400,
            "parameters has no ['beams']",
        ),
        ("/v2/models/{m}/generate", {"text_input": 5}, 400, "text_input must be a string"),
        ("/v2/models/{m}/generate", "not json", 400, "not JSON"),
        ("/v2/models/nope/generate", {"text_input": "x"}, 404, "unknown model 'nope'"),
        ("/v1/completions", {"model": "{m}", "prompt": [1, 384]}, 400, "token id 384, outside [0, 383]"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "logprobs": 2}, 400, "logprobs is not supported"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "n": 99}, 400, "n must be an integer in [1, 16]"),
        ("/v1/completions", {"prompt": "x"}, 400, "model is required"),
        ("/v1/chat/completions", {"model": "{m}", "messages": []}, 404, "chat template"),
    ],
)
def test_client_mistakes_are_4xx_naming_the_field(server, path, body, status, says):
    path = path.replace("{m}", NAME)
    if isinstance(body, dict) and body.get("model") == "{m}":
        body = {**body, "model": NAME}
    got, answer = post(server, path, body)
    message = answer["error"]["message"] if isinstance(answer["error"], dict) else answer["error"]
    assert got == status and says in message, answer


def test_tensor_requests_the_model_cannot_take_are_400_not_500(server):
    def infer(shape, data):
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": shape, "data": data}
        return post(server, f"/v2/models/{NAME}/infer", {"inputs": [tensor]})

    status, answer = infer([1, 0], [])
    assert status == 400 and "axis 1 is empty" in answer["error"]
    status, answer = infer([1, 65], [1] * 65)
    assert status == 400 and "at most 64" in answer["error"]
    status, answer = infer([1, 3], [1, 2, 384])
    assert status == 400 and "outside [0, 383]" in answer["error"]
    assert infer([1, 64], [1] * 64)[0] == 200


def test_the_openai_client_reads_errors_in_its_own_shape(server):
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client(server).completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens is too large") as caught:
        client(server).completions.create(model=NAME, prompt="x", max_tokens=500)
    assert caught.value.body["param"] == "max_tokens"


def test_generation_is_counted_in_prometheus(server):
    before = metric(server, "torchkeel_generation_tokens_total", model=NAME)
    first = metric(server, "torchkeel_time_to_first_token_seconds_count", model=NAME)
    post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 7, "temperature": 0})
    assert metric(server, "torchkeel_generation_tokens_total", model=NAME) == before + 7
    assert metric(server, "torchkeel_time_to_first_token_seconds_count", model=NAME) == first + 1
    assert metric(server, "torchkeel_time_per_output_token_seconds_count", model=NAME) >= 6
    assert metric(server, "nv_inference_request_success", model=NAME) > 0


class Gated:
    """The model's decoder, one step per ``release``: what the engine does between steps is then
    seen step by step."""

    def __init__(self, decoder) -> None:
        self.decoder, self.max_length = decoder, decoder.max_length
        self.allowed = threading.Semaphore(0)

    def start(self, prompts):
        return self.decoder.start(prompts)

    def step(self, tokens):
        self.allowed.acquire()
        return self.decoder.step(tokens)

    def keep(self, rows):
        self.decoder.keep(rows)


def test_a_client_gone_mid_stream_frees_its_row(export):
    import uvicorn
    from serveproc import free_port

    from torchkeel.serve.app import create_app
    from torchkeel.serve.model import ServeOptions

    app = create_app(export[1] / "export-onnx", ServeOptions(warmup_batch_sizes=()))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        engine = app.state.server.repository.models[NAME].generation
        gated = Gated(engine.decoder)
        engine.decoder = gated
        rows = []
        original = engine._deliver

        def deliver(active, chosen):
            rows.extend(row for _, row in active if row not in rows)
            original(active, chosen)

        engine._deliver = deliver
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"text_input": PROMPT, "parameters": {"max_tokens": 50, "temperature": 0}})
        conn.request("POST", f"/v2/models/{NAME}/generate_stream", body)
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # the first token
        conn.sock.shutdown(2)  # gone mid-stream, as a closed browser tab is
        conn.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and rows[0].finish_reason != "abandoned":
            gated.allowed.release()
            time.sleep(0.05)
        assert rows[0].finish_reason == "abandoned" and len(rows[0].tokens) < 50
    finally:
        for _ in range(60):
            gated.allowed.release()
        server.should_exit = True
        thread.join(timeout=30)


SURROGATE = "\ud800x"  # what JSON's "\ud800x" decodes to: a lone surrogate, no UTF-8 tokenizer takes it


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": "{m}", "prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"model": "{m}", "prompt": ["ok", SURROGATE]}, "prompt[1]"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "stop": SURROGATE}, "stop"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "stop": ["ok", SURROGATE]}, "stop[1]"),
        ("/v1/completions", {"model": "{m}", "prompt": SURROGATE, "stream": True}, "prompt"),
        ("/v1/completions", {"model": SURROGATE, "prompt": "x"}, "model"),
        ("/v2/models/{m}/generate", {"text_input": SURROGATE}, "text_input"),
        ("/v2/models/{m}/generate_stream", {"text_input": SURROGATE}, "text_input"),
        ("/v2/models/{m}/generate", {"text_input": "x", "parameters": {"stop": [SURROGATE]}}, "parameters.stop[0]"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "seed": 2**64}, "seed"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "seed": 2**63, "stream": True}, "seed"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "seed": True}, "seed"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "temperature": 10**400}, "temperature"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "top_p": -(10**400)}, "top_p"),
        ("/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v2/models/{m}/generate", {"text_input": "x", "parameters": {"seed": 2**64}}, "parameters.seed"),
        ("/v2/models/{m}/generate", {"text_input": "x", "parameters": {"top_k": 1.5}}, "parameters.top_k"),
        ("/v2/models/{m}/generate", '{"text_input": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_every_request_field_is_checked_before_the_model_runs(server, path, body, field):
    """The issue's two 500s (a lone surrogate: TypeError in the tokenizer; seed >= 2**64: an
    overflow in torch's generator) and their kin in the other text and integer fields."""
    path = path.replace("{m}", NAME)
    if isinstance(body, dict) and body.get("model") == "{m}":
        body = {**body, "model": NAME}
    status, raw, _ = server.request("POST", path, json.dumps(body) if not isinstance(body, str) else body)
    answer = json.loads(raw)
    message = answer["error"]["message"] if isinstance(answer["error"], dict) else answer["error"]
    assert status == 400 and field in message, answer
    if path == "/v1/completions":
        assert answer["error"]["param"] == field.split("[")[0]


def test_a_temperature_too_small_for_floats_is_greedy_decoding(server):
    """1e-300 divides the logits past float32's range; it is read as its limit, greedy."""
    greedy = post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    for tiny in (1e-30, 1e-300, 5e-324):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": tiny, "seed": 1}
        status, answer = post(server, "/v1/completions", body)
        assert status == 200 and answer["choices"][0]["text"] == greedy[1]["choices"][0]["text"], answer


def test_a_prompt_alone_too_long_is_told_to_shorten_never_to_ask_for_0_tokens(server):
    for prompt in ([1] * 64, [1] * 70):
        status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1})
        message = answer["error"]["message"]
        assert status == 400 and answer["error"]["param"] == "prompt" and message.startswith("prompt is too long")
        assert "context of 64 positions" in message and "at most 63 tokens" in message and "at most 0" not in message
    status, answer = post(server, f"/v2/models/{NAME}/generate", {"text_input": "x " * 80})
    assert status == 400 and answer["error"].startswith("text_input is too long"), answer
    status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": [1] * 60, "max_tokens": 9})
    assert status == 400 and answer["error"]["param"] == "max_tokens" and "at most 4" in answer["error"]["message"]


def test_the_openai_client_lists_and_retrieves_the_models(server):
    models = client(server).models
    listed = models.list()
    assert [m.id for m in listed.data] == [NAME] and listed.data[0].object == "model"
    assert listed.data[0].owned_by == "torchkeel" and listed.data[0].created > 1_600_000_000
    one = models.retrieve(NAME)
    assert (one.id, one.object, one.created) == (NAME, "model", listed.data[0].created)
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'") as caught:
        models.retrieve("nope")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    status, raw, _ = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(raw)["models"] == [NAME]  # KServe v1's list, in the same body
    status, raw, _ = server.request("GET", f"/v1/models/{NAME}")
    assert status == 200 and {"name": NAME, "ready": True}.items() <= json.loads(raw).items()  # and KServe v1's


def test_a_client_gone_mid_stream_is_counted_canceled_and_its_sequence_freed(export):
    """The ``openai`` client reads one chunk of a stream and closes it, as an app whose user
    pressed stop does: ``nv_inference_request_failure{reason="CANCELED"}`` counts it, and the
    engine's batch is empty again (``torchkeel_generation_running_sequences`` 0)."""
    import uvicorn
    from serveproc import free_port

    from torchkeel.serve.app import create_app
    from torchkeel.serve.model import ServeOptions

    app = create_app(export[1] / "export-onnx", ServeOptions(warmup_batch_sizes=()))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gated = None
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        engine = app.state.server.repository.models[NAME].generation
        engine.decoder = gated = Gated(engine.decoder)
        live = _Live(port)
        canceled = {"model": NAME, "reason": "CANCELED"}
        before = live.metric("nv_inference_request_failure", **canceled)
        openai_client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = openai_client.completions.create(model=NAME, prompt=PROMPT, max_tokens=50, temperature=0, stream=True)
        assert next(iter(stream)).choices[0].text is not None  # the first token came
        running = live.metric("torchkeel_generation_running_sequences", model=NAME)
        stream.close()  # gone mid-stream: the engine is held at its next step
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and live.metric("torchkeel_generation_running_sequences", model=NAME):
            gated.allowed.release()
            time.sleep(0.05)
        assert live.metric("nv_inference_request_failure", **canceled) == before + 1
        assert live.metric("nv_inference_request_success", model=NAME) == 0  # not also counted as answered
        assert running == 1 and live.metric("torchkeel_generation_running_sequences", model=NAME) == 0
        assert live.metric("torchkeel_generation_tokens_total", model=NAME) < 50
    finally:
        for _ in range(60 if gated is not None else 0):
            gated.allowed.release()
        server.should_exit = True
        thread.join(timeout=30)


class _Live:
    """/metrics of an in-process server."""

    def __init__(self, port: int) -> None:
        self.port = port

    def metric(self, name: str, **labels: str) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
        )


# Request bodies for the fuzz test: each field often valid (small, so that the model runs), often anything.
texts = st.one_of(
    st.text(max_size=10),
    st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)), max_size=6),
)
integers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, True, False]),
)
numbers = st.one_of(integers, st.floats(), st.sampled_from([1e-300, 5e-324, 1e308, 10**400]))
anything = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
# Valid values, often at their edges (what the model then runs on), and the client mistakes of each field.
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.just(0), st.floats(0, 2), st.sampled_from([1e-300, 5e-324])),
    "top_p": st.floats(1e-9, 1),
    "top_k": st.integers(0, 400),
    "seed": st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), integers),
    "stop": st.one_of(texts.filter(bool), st.lists(texts.filter(bool), max_size=4)),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "prompt": st.one_of(texts, st.lists(texts, min_size=1, max_size=3), st.lists(st.integers(0, 383), max_size=5)),
    "text_input": texts,
}
OPENAI = ["max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "echo", "stream_options"]
V2 = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop"]


@st.composite
def bodies(draw, fields: list[str], required: dict[str, object]) -> dict:
    """A valid body of some of ``fields``, then 0-2 of its fields (or others) made anything."""
    body = {**required, **{k: draw(VALID[k]) for k in draw(st.lists(st.sampled_from(fields), unique=True))}}
    others = st.one_of(st.sampled_from([*fields, *required, "logprobs", "best_of", "user", "id"]), texts)
    for key in draw(st.lists(others, max_size=2)):
        body[key] = draw(anything)
    return body


@st.composite
def requests(draw) -> tuple[str, dict]:
    kind = draw(st.sampled_from(["openai", "generate", "generate_stream", "chat"]))
    if kind == "openai":
        return "/v1/completions", draw(bodies(OPENAI, {"model": NAME, "prompt": draw(VALID["prompt"])}))
    if kind == "chat":
        messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}), max_size=2)
        return "/v1/chat/completions", {"model": NAME, "messages": draw(messages)}
    parameters = draw(bodies(V2, {"max_tokens": draw(VALID["max_tokens"])}))  # the default, 64, fills the context
    body = {"text_input": draw(VALID["text_input"]), "parameters": parameters}
    for key in draw(st.lists(st.one_of(st.sampled_from(["text_input", "parameters", "id"]), texts), max_size=1)):
        body[key] = draw(anything)
    return f"/v2/models/{NAME}/{kind}", body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=requests())
def test_generated_request_bodies_are_answered_or_refused_never_5xx(server, case):
    """Every field of every generation route, generated: each request is answered (200, and a
    stream carries no error event) or refused with a 4xx that names a field; never a 5xx."""
    path, body = case
    status, raw, headers = server.request("POST", path, json.dumps(body))
    assert status < 500, (path, body, raw[:500])
    event(f"{path.rsplit('/', 1)[1]} {status}")
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] if isinstance(error, dict) else error
    elif headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in raw.decode().split("\n\n") if line]
        assert not any("error" in json.loads(e) for e in events if e != "[DONE]"), (path, body, events[-1])
    else:
        json.loads(raw)


def test_an_lm_export_without_a_cache_says_so_and_names_the_export_that_scales(export):
    """An ONNX LM recomputes every stream's whole sequence per token (no key/value cache): the
    server says once at start that streams at once do not scale, and to serve the hf export,
    which decodes with its cache and says nothing."""
    from torchkeel.serve.app import create_app

    [note] = create_app(export[1] / "export-onnx").state.server.repository.notes()
    assert note.startswith(f"{NAME}: this onnx export") and "--format hf" in note and "no key/value cache" in note
    assert create_app(export[1] / "export-hf").state.server.repository.notes() == []


def test_a_long_prompt_is_tokenized_while_other_clients_are_served(server):
    """Tokenizing a prompt of megabytes takes a while: off the event loop, so that health probes
    and other clients are answered meanwhile (the prompt itself is then refused for its length)."""
    body = json.dumps({"model": NAME, "prompt": "word " * 1_000_000, "max_tokens": 2})
    outcome: dict[str, object] = {}

    def long_request() -> None:
        # A busy machine tokenizes slower: the verdict is the answer, not how soon it came.
        status, raw, _ = server.request("POST", "/v1/completions", body, timeout=600)
        outcome["status"], outcome["answer"] = status, json.loads(raw)

    worker = threading.Thread(target=long_request)
    started = time.monotonic()
    worker.start()
    answered = [started]
    while worker.is_alive() and time.monotonic() - started < 600:
        assert server.request("GET", "/v2/health/live", timeout=120)[0] == 200
        answered.append(time.monotonic())
    worker.join(timeout=60)
    duration = time.monotonic() - started
    assert outcome["status"] == 400 and outcome["answer"]["error"]["param"] == "prompt", outcome
    longest_wait = max(b - a for a, b in zip(answered, answered[1:]))
    assert longest_wait < duration / 2, (longest_wait, duration, len(answered))


def test_a_default_max_tokens_is_what_the_prompt_leaves_room_for(server):
    """A client that sends no max_tokens gets the default, or fewer where the model's positions end."""
    status, answer = post(server, f"/v2/models/{NAME}/generate", {"text_input": "x"})
    assert status == 200 and answer["text_output"] is not None, answer
    status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": [1] * 60, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 4, answer
    status, answer = post(server, "/v1/completions", {"model": NAME, "prompt": [1] * 64})
    assert status == 400 and answer["error"]["param"] == "prompt", answer  # the prompt alone fills the context
