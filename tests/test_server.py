"""The HTTP API, end to end: a real uvicorn server on a free loopback port, driven with `requests`.

Every bad request is followed by a good one, to pin down that no error leaves the server (or the
model's queue) in a bad state.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from pyplugin.runtime import Generation
from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving

TINY = dict(arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=4096)
GREEDY = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    app = create_app(models_dir=models_dir)
    with serving(app) as url:
        yield url, app.state.engine


@pytest.fixture
def url(server):
    return server[0]


@pytest.fixture
def engine(server):
    return server[1]


def generate(url, **body):
    return requests.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "Hello",
                                                      "stream": False, "options": GREEDY, **body},
                         timeout=60)


def assert_good(url):
    """A good request after whatever came before: it must succeed."""
    r = generate(url)
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True and r.json()["eval_count"] >= 1


def ndjson(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


# ---------------------------------------------------------------------------------------------------
# Ollama's API


def test_root_and_version_answer(url):
    r = requests.get(f"{url}/", timeout=10)
    assert r.status_code == 200 and r.text == "pebbling is running"
    assert requests.head(f"{url}/", timeout=10).status_code == 200
    assert requests.get(f"{url}/api/version", timeout=10).json()["version"]


def test_generate_streams_ndjson_whose_pieces_make_the_non_streamed_response(url):
    body = {"model": "tiny", "prompt": "Why is the sky blue?",
            "options": {"temperature": 0, "num_predict": 6}}
    r = requests.post(f"{url}/api/generate", json=body, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r)
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"] is True
    final = lines[-1]
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                "eval_count", "eval_duration"):
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert final["eval_count"] == 6 and final["done_reason"] == "length"
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    assert "pebbling" in final and final["created_at"].endswith("Z")
    assert len(final["context"]) == final["prompt_eval_count"] + final["eval_count"]

    whole = requests.post(f"{url}/api/generate", json={**body, "stream": False}, timeout=60).json()
    assert whole["response"] == "".join(line["response"] for line in lines)
    assert whole["context"] == final["context"]


def test_context_continues_a_previous_response(url):
    first = generate(url).json()
    second = generate(url, prompt="And then?", context=first["context"]).json()
    assert second["context"][:len(first["context"])] == first["context"]
    assert second["prompt_eval_count"] > len(first["context"])


def test_raw_and_template_prompts_skip_the_chat_template(url):
    raw = generate(url, prompt="The quick brown fox", raw=True).json()
    templated = generate(url, prompt="The quick brown fox", template="{{ .Prompt }}").json()
    chat = generate(url, prompt="The quick brown fox").json()
    assert raw["context"] == templated["context"]
    assert raw["prompt_eval_count"] < chat["prompt_eval_count"]  # no header tokens
    with_system = generate(url, prompt="x", system="Be brief.",
                           template="{{ if .System }}S:{{ .System }} {{ end }}{{ .Prompt }}")
    assert with_system.status_code == 200


def test_chat_streams_and_returns_the_assistant_message(url):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}], "options": GREEDY}
    lines = ndjson(requests.post(f"{url}/api/chat", json=body, stream=True, timeout=60))
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4 and "pebbling" in lines[-1]
    assert all(line["message"]["role"] == "assistant" for line in lines)
    whole = requests.post(f"{url}/api/chat", json={**body, "stream": False}, timeout=60).json()
    assert whole["message"]["content"] == "".join(line["message"]["content"] for line in lines)
    assert whole["done_reason"] == "length" and "context" not in whole


@pytest.mark.parametrize("path,body", [("generate", {"prompt": "Hi"}),
                                       ("chat", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_full_context_shifts_unless_the_request_says_shift_false(url, path, body):
    options = {"temperature": 0, "num_predict": 60, "num_ctx": 32}
    shifted, ended = (requests.post(f"{url}/api/{path}", json={"model": "tiny", "stream": False, **body,
                                                                "options": options, **extra}, timeout=60).json()
                      for extra in ({}, {"shift": False}))
    assert shifted["eval_count"] == 60 and shifted["pebbling"]["context_shifts"] >= 1, shifted
    assert ended["done_reason"] == "length" and ended["pebbling"]["context_shifts"] == 0
    assert ended["pebbling"]["cached_tokens"] + ended["prompt_eval_count"] + ended["eval_count"] == 32 + 1


def test_tags_show_and_ps_describe_the_models(url, models_dir):
    report = generate(url).json()["pebbling"]
    tags = requests.get(f"{url}/api/tags", timeout=30).json()["models"]
    names = {m["name"] for m in tags}
    assert {"tiny:latest", "pebbling-demo:latest"} <= names  # with the tag, as Ollama shows names
    for name in names:  # each name as listed is one a client can ask for (LangChain checks this way)
        assert requests.post(f"{url}/api/show", json={"model": name}, timeout=30).status_code == 200, name
    tiny = next(m for m in tags if m["name"] == "tiny:latest")
    assert tiny["size"] == (models_dir / "tiny.gguf").stat().st_size
    assert tiny["details"]["family"] == "llama" and tiny["details"]["format"] == "gguf"
    assert tiny["details"]["quantization_level"] == "F32"

    show = requests.post(f"{url}/api/show", json={"model": "tiny"}, timeout=30).json()
    assert show["model_info"]["llama.block_count"] == 4
    assert "start_header_id" in show["template"] and show["details"] == tiny["details"]

    ps = requests.get(f"{url}/api/ps", timeout=10).json()["models"]
    loaded = next(m for m in ps if m["name"] == "tiny:latest")
    assert loaded["size"] > 0 and loaded["expires_at"].endswith("Z")
    # Device memory as measured at the last request; where nothing is measured (host, stub), none.
    measured = report["measured_peak_how"].startswith("measured")
    assert loaded["size_vram"] == (report["measured_peak_bytes"] if measured else 0)


def test_a_strategy_change_keeps_the_loaded_model_and_its_tokens(url):
    reference = generate(url, options={**GREEDY, "pebbling_strategy": "none"}).json()
    assert reference["pebbling"]["resident_layers"] == reference["pebbling"]["n_layers"]
    for strategy in ("sqrt", "minimal", "every:2", "adaptive"):
        r = generate(url, options={**GREEDY, "pebbling_strategy": strategy})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["load_duration"] == 0, strategy  # no reload for a residency change
        assert body["response"] == reference["response"], strategy
        assert body["pebbling"]["strategy"].split(":")[0] == strategy.split(":")[0]
        if strategy == "every:2":  # which layers stay: every second one, from the first
            assert body["pebbling"]["resident"] == [0, 2]
    minimal = generate(url, options={**GREEDY, "pebbling_strategy": "minimal"}).json()["pebbling"]
    # streamed layers are copied where the arrays live on a device; host memory computes them in place
    from pyplugin.store import backend_named
    copies = backend_named(minimal["backend"]).arrays_on_device
    assert minimal["resident_layers"] == 0 and (minimal["bytes_restored"] > 0) == copies
    assert minimal["estimated_peak_bytes"] < reference["pebbling"]["estimated_peak_bytes"]


# Where the forms' greedy tokens may part: the native libraries multiply the quantized form by x quantized to
# 8-bit blocks (pebble.h), the f16 form by x as it is, and that rounding can turn a near-tie of this random
# model's logits (as it does llama.cpp's). The forms parted here only where the f16 form's two best tokens
# stood 0.001-0.002 apart in log-probability; a tie is taken as anything under ten times that.
NEAR_TIE = 0.02


def same_tokens_up_to_a_near_tie(a: list[dict], b: list[dict]) -> bool:
    """Equal tokens until the first difference, and that one a near tie in `b` between the two tokens."""
    for x, y in zip(a, b):
        if x["token"] != y["token"]:
            best, second = y["top_logprobs"][:2]
            return x["token"] == second["token"] and best["logprob"] - second["logprob"] <= NEAR_TIE
    return len(a) == len(b)


def gaps(a: dict, b: dict) -> list:
    """Each token of two replies beside b's two best and their distance, for a failure's message."""
    return [(x["token"], [(t["token"], round(t["logprob"], 4)) for t in y["top_logprobs"][:2]])
            for x, y in zip(a["logprobs"], b["logprobs"])]


def test_pebbling_weights_picks_the_form_and_both_forms_give_the_same_tokens(url, models_dir):
    write_gguf(models_dir / "tiny-q8.gguf", **{**TINY, "weight_type": "Q8_0"})
    options = {**GREEDY, "num_predict": 12, "pebbling_strategy": "minimal"}
    quantized = generate(url, model="tiny-q8", options=options, logprobs=True, top_logprobs=2).json()
    f16 = generate(url, model="tiny-q8", options={**options, "pebbling_weights": "f16"}, logprobs=True,
                   top_logprobs=2).json()
    assert quantized["pebbling"]["weights"] == "quantized" and f16["pebbling"]["weights"] == "f16"
    assert quantized["eval_count"] == 12
    assert same_tokens_up_to_a_near_tie(quantized["logprobs"], f16["logprobs"]), gaps(quantized, f16)
    assert f16["load_duration"] > 0  # another form is another load, as a load-time option in Ollama
    # Q8_0 is 34 bytes per 32 weights: each decoded token restores far fewer bytes than the GPU's fp16 form
    # (8.5 bits a weight against 16, the norms in float32 in both); on host memory streamed weights and KV
    # caches are computed from the host tier in place: nothing is copied in either form
    restored = quantized["pebbling"]["bytes_restored_per_token"], f16["pebbling"]["bytes_restored_per_token"]
    if quantized["pebbling"]["backend"] == "cuda":
        assert restored[0] < 0.6 * restored[1]
    else:
        assert restored[0] == restored[1] == 0
    assert quantized["pebbling"]["estimated_peak_bytes"] < f16["pebbling"]["estimated_peak_bytes"]
    # The same request again, the model loaded: its prompt's cache is reused, so its last prompt token
    # is computed by a decode step where the first request's was a prefill's (both quantize x on the
    # native libraries, each from its own fp16 activations): equal up to a near tie.
    again = generate(url, model="tiny-q8", options=options, logprobs=True, top_logprobs=2).json()
    assert again["load_duration"] == 0
    assert same_tokens_up_to_a_near_tie(again["logprobs"], quantized["logprobs"]), gaps(again, quantized)
    ps = requests.get(f"{url}/api/ps", timeout=10).json()["models"]
    forms = sorted(m["details"]["pebbling_weights"] for m in ps if m["name"] == "tiny-q8:latest")
    assert forms == ["f16", "quantized"]


def test_a_response_says_its_decode_steps_were_one_native_call_each(url):
    reply = generate(url, options={**GREEDY, "num_predict": 10, "pebbling_strategy": "every:2"}).json()
    backend = reply["pebbling"]["backend"]
    assert reply["pebbling"]["decode_step"] == ("python" if backend == "stub" else "native")
    assert reply["eval_count"] == 10

def test_keep_alive_zero_unloads_and_negative_keeps_forever(url):
    generate(url, keep_alive=0)
    assert "tiny:latest" not in [m["name"] for m in requests.get(f"{url}/api/ps", timeout=10).json()["models"]]
    r = generate(url, keep_alive="-1")
    assert r.json()["load_duration"] > 0  # it had been unloaded
    (entry,) = [m for m in requests.get(f"{url}/api/ps", timeout=10).json()["models"] if m["name"] == "tiny:latest"]
    assert entry["expires_at"].startswith("9999")
    generate(url, keep_alive=0.2)
    deadline = time.monotonic() + 5
    while "tiny:latest" in [m["name"] for m in requests.get(f"{url}/api/ps", timeout=10).json()["models"]]:
        assert time.monotonic() < deadline, "keep_alive 0.2 s did not unload the model"
        time.sleep(0.05)
    assert_good(url)


def test_empty_prompt_loads_and_keep_alive_zero_unloads(url):
    r = generate(url, prompt="")
    assert r.json()["done_reason"] == "load" and r.json()["response"] == ""
    r = generate(url, prompt="", keep_alive=0)
    assert r.json()["done_reason"] == "unload"
    assert "tiny:latest" not in [m["name"] for m in requests.get(f"{url}/api/ps", timeout=10).json()["models"]]
    assert_good(url)


def test_models_in_ollamas_store_resolve_by_name_and_tag(url, models_dir, tmp_path, monkeypatch):
    data = (models_dir / "tiny.gguf").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / f"sha256-{digest}").write_bytes(data)
    for namespace, model in (("library", "tinyllama"), ("someone", "tiny")):
        manifest = tmp_path / "manifests" / "registry.ollama.ai" / namespace / model / "q8"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                    "digest": f"sha256:{digest}", "size": len(data)}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    for name in ("tinyllama:q8", "someone/tiny:q8"):
        r = generate(url, model=name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
    assert generate(url, model="tinyllama:other").status_code == 404
    names = [m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]]
    assert "tinyllama:q8" in names and "someone/tiny:q8" in names


# ---------------------------------------------------------------------------------------------------
# bad input: a status, an {"error"} that says what was wrong, and a server that still works


BAD_GENERATE = [
    pytest.param({"model": "nope", "prompt": "x"}, 404, "model 'nope' not found", id="unknown-model"),
    pytest.param({"prompt": "x"}, 400, "'model' is required", id="missing-model"),
    pytest.param({"model": "../../etc/passwd", "prompt": "x"}, 400, "invalid model name", id="dotdot"),
    pytest.param({"model": "/etc/passwd", "prompt": "x"}, 400, "invalid model name", id="absolute-path"),
    pytest.param({"model": "a\\b", "prompt": "x"}, 400, "invalid model name", id="backslash"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}}, 400,
                 "option 'temperature'", id="option-type"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"seed": 1.5}}, 400, "option 'seed'",
                 id="option-float-seed"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"stop": 5}}, 400, "option 'stop'",
                 id="stop-type"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"num_predict": -3}}, 400,
                 "option 'num_predict'", id="num-predict-below-minus-two"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_strategy": "lazy"}}, 400,
                 "unknown strategy 'lazy'", id="unknown-strategy"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_strategy": "every:0"}}, 400,
                 "every:N", id="every-zero"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_memory_limit": "-1GiB"}}, 400,
                 "pebbling_memory_limit", id="negative-limit"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_enabled": "yes"}}, 400,
                 "pebbling_enabled", id="enabled-type"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_weights": "q4"}}, 400,
                 "option 'pebbling_weights': got 'q4'; accepted: 'quantized', 'f16'", id="weights-form"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_kv_type": "q5_1"}}, 400,
                 "option 'pebbling_kv_type': got 'q5_1'; accepted: f16, q8_0, q4_0, f32", id="kv-type"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_kv_type": "q8_0"}}, 400,
                 "needs a head_dim that is a multiple of 32; this model's is 16", id="kv-type-blocks"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"pebbling_memory_limit": "1KiB"}}, 400,
                 "smallest footprint", id="limit-below-footprint"),
    pytest.param({"model": "tiny", "prompt": "x", "options": "hot"}, 400, "'options'", id="options-type"),
    pytest.param({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "'stream'", id="stream-type"),
    pytest.param({"model": "tiny", "prompt": "x", "shift": "no"}, 400, "'shift'", id="shift-type"),
    pytest.param({"model": "tiny", "prompt": "x", "options": {"shift": False}}, 400,
                 "option 'shift' is not an option", id="shift-is-no-option"),
    pytest.param({"model": "tiny", "prompt": 5}, 400, "'prompt'", id="prompt-type"),
    pytest.param({"model": "tiny", "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive", id="keep-alive"),
    pytest.param({"model": "tiny", "prompt": "x", "context": [10 ** 9]}, 400, "vocabulary", id="context-ids"),
    pytest.param({"model": "tiny", "prompt": "x", "template": "{{ range .Messages }}"}, 400, "template",
                 id="unsupported-template"),
    pytest.param({"model": "tiny", "prompt": "x", "format": "yaml"}, 400, "format: got", id="format"),
]


@pytest.mark.parametrize("body,status,message", BAD_GENERATE)
def test_bad_generate_request_says_what_was_wrong(url, body, status, message):
    r = requests.post(f"{url}/api/generate", json={"stream": False, **body}, timeout=30)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert_good(url)


def test_a_model_with_a_tensor_type_without_kernels_is_a_400_naming_the_tensor_and_the_types(url, models_dir):
    """A file with one matrix of a type pebbling does not compute (IQ2_XXS) says so in /api/show, and is refused
    when a request loads it: a 400 naming the model (never its path), the tensor, its type and every type
    pebbling computes."""
    from pyplugin.ggml_types import SUPPORTED_NAMES

    path = models_dir / "iq2.gguf"
    write_gguf(path, **dict(TINY, n_embd=256, n_ff=64), weight_type="Q8_0", tensor_types={"blk.2.attn_q": "IQ2_XXS"})
    try:
        # said before any request loads it: /api/show's notes name the type and a tensor of it
        show = requests.post(f"{url}/api/show", json={"model": "iq2"}, timeout=60).json()
        assert any("tensor type IQ2_XXS (tensor blk.2.attn_q.weight) is not computed by pebbling" in note
                   and "cannot be served" in note for note in show.get("pebbling_notes", [])), show.get("pebbling_notes")
        r = requests.post(f"{url}/api/generate", json={"model": "iq2", "prompt": "x", "stream": False}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "model 'iq2' cannot be served" in error and str(models_dir) not in error, error
        assert "tensor blk.2.attn_q.weight has type IQ2_XXS, which is not supported" in error, error
        assert sorted(error.rpartition("supported types: ")[2].split(", ")) == sorted(SUPPORTED_NAMES), error
    finally:
        path.unlink()
    assert_good(url)


@pytest.mark.parametrize("data,message", [
    (b'{"model": "tiny",', "invalid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "request body is empty"),
    (b"\xff\xfe", "invalid JSON"),
])
def test_malformed_body_is_a_400_with_an_error(url, data, message):
    r = requests.post(f"{url}/api/generate", data=data, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]
    assert_good(url)


def test_curl_style_form_content_type_is_read_as_json(url):
    r = requests.post(f"{url}/api/generate", data=json.dumps({"model": "tiny", "prompt": "x", "stream": False,
                                                              "options": GREEDY}),
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200 and r.json()["done"]


def test_oversized_body_is_a_413(url):
    r = requests.post(f"{url}/api/generate", data=b'{"model": "tiny", "prompt": "' + b"x" * (9 << 20) + b'"}',
                      timeout=60)
    assert r.status_code == 413 and "larger than the limit" in r.json()["error"]
    assert_good(url)


@pytest.mark.parametrize("body,status,message", [
    ({"model": "nope", "messages": []}, 404, "model 'nope' not found"),
    ({"model": "tiny", "messages": [{"content": "hi"}]}, 400, "'messages.0.role' is required"),
    ({"model": "tiny", "messages": "hi"}, 400, "'messages'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"top_p": 2}}, 400,
     "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, 400, "images"),
])
def test_bad_chat_request_says_what_was_wrong(url, body, status, message):
    r = requests.post(f"{url}/api/chat", json={"stream": False, **body}, timeout=30)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert_good(url)


def test_show_of_unknown_model_is_404_and_unknown_route_is_404(url):
    r = requests.post(f"{url}/api/show", json={"model": "nope"}, timeout=10)
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
    r = requests.get(f"{url}/api/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    assert_good(url)


# ---------------------------------------------------------------------------------------------------
# a client that leaves


@pytest.fixture
def endless_slow_generation(monkeypatch):
    """Generations that never reach end-of-generation and take 20 ms a token, so one is surely still
    running when its client leaves."""
    generation = Generation
    real_sample = generation.sample

    def sample(self, logits, history):  # every token is sampled, alone or in a batch
        time.sleep(0.02)
        logits = np.array(logits, dtype=np.float32)
        logits[list(self.model.tokenizer.eog_ids)] = -np.inf
        return real_sample(self, logits, history)

    monkeypatch.setattr(generation, "sample", sample)


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_idle(engine, before: int, deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while engine.counts["cancelled"] <= before or any(m.active for m in engine.running()):
        assert time.monotonic() < deadline, f"the generation went on after its client left: {engine.counts}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_stops_the_generation(url, engine, endless_slow_generation, stream):
    generate(url)  # loaded, so the wait below is the generation's
    before = engine.counts["cancelled"]
    sock = _raw_post(url, "/api/generate", {"model": "tiny", "prompt": "Hello", "stream": stream,
                                            "options": {"temperature": 0, "num_predict": 1000}})
    if stream:
        received = b""
        while received.count(b'"done":false') < 2:  # two tokens have come
            received += sock.recv(4096)
    else:
        time.sleep(0.3)
    sock.close()
    _wait_idle(engine, before)
    assert_good(url)


def test_a_client_that_leaves_while_queued_is_never_run(url, engine, endless_slow_generation):
    generate(url)
    before, dropped = engine.counts["cancelled"], engine.counts["dropped"]
    busy = _raw_post(url, "/api/generate", {"model": "tiny", "prompt": "Hello", "stream": True,
                                            "options": {"temperature": 0, "num_predict": 1000}})
    busy.recv(1)  # the first is running
    # Another strategy, so another plan: it cannot join the running batch and waits in the queue.
    queued = _raw_post(url, "/api/generate", {"model": "tiny", "prompt": "Hello", "stream": True,
                                              "options": {"temperature": 0, "num_predict": 1000,
                                                          "pebbling_strategy": "minimal"}})
    time.sleep(0.2)
    queued.close()
    busy.close()
    _wait_idle(engine, before)
    assert engine.counts["dropped"] == dropped + 1
    assert_good(url)


# ---------------------------------------------------------------------------------------------------
# OpenAI's API


def test_openai_chat_completion(url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5 and "pebbling" in r

    stream = requests.post(f"{url}/v1/chat/completions", timeout=60, stream=True,
                           json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [line for line in stream.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == r["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []


def test_openai_text_completion_continues_the_prompt(url):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 4
    raw = generate(url, prompt="The quick brown fox", raw=True,
                   options={"temperature": 0, "num_predict": 4, "top_p": 1.0}).json()
    assert r["choices"][0]["text"] == raw["response"]
    events = [line for line in requests.post(f"{url}/v1/completions", json={**body, "stream": True},
                                             stream=True, timeout=60).iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    pieces = [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == r["choices"][0]["text"]


def test_openai_models_and_errors(url):
    data = requests.get(f"{url}/v1/models", timeout=30).json()
    assert data["object"] == "list" and "tiny:latest" in [m["id"] for m in data["data"]]
    r = requests.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["message"] == "model 'nope' not found"
    r = requests.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "x", "pebbling_strategy": "lazy"})
    assert r.status_code == 400 and "unknown strategy" in r.json()["error"]["message"]
    r = requests.post(f"{url}/v1/chat/completions", data=b"{", timeout=30)
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    assert_good(url)


def test_openapi_schema_is_published(url):
    schema = requests.get(f"{url}/openapi.json", timeout=10).json()
    assert {"/api/generate", "/api/chat", "/v1/chat/completions"} <= set(schema["paths"])


# ---------------------------------------------------------------------------------------------------
# the command


def test_pebbling_serve_listens_on_loopback_and_serves_the_models_dir(models_dir, tmp_path):
    from pyplugin.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.models) == ("127.0.0.1", 11435, None)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PEBBLING_MODELS": str(tmp_path)}  # --models must win over the environment
    proc = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--port", str(port),
                             "--models", str(models_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
        while True:
            try:
                if requests.get(url, timeout=1).text == "pebbling is running":
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "pebbling serve did not answer"
            time.sleep(0.1)
        assert_good(url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
