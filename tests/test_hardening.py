"""Every input a careless client or an attacker sent that once answered a plain-text 500, froze the server,
held memory without bound, crashed on a crafted model file or leaked the file system: each a regression
test, answered now with a JSON error that says what was wrong, while the server keeps serving."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import requests
from gguf import GGUFReader

from pyplugin.cli import main as cli_main
from pyplugin.errors import ModelError, OptionsError, StrategyError
from pyplugin.model import chat, load_model
from pyplugin.model.chat import ChatTemplate, ChatTemplateError
from pyplugin.model.synth import write_gguf
from pyplugin.runtime.plan import parse_size
from pyplugin.serving import Engine, GenerationRequest, ServerBusyError
from pyplugin.store import Strategy
from server_patch import create_app
from server_patch.local import serving

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
GREEDY = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    write_gguf(root / "broken.gguf", **TINY, metadata={"llama.attention.head_count": 0})
    secret = tmp_path_factory.mktemp("elsewhere") / "secret.txt"
    secret.write_text("s3cr3t:x:0:0")
    (root / "outside.gguf").symlink_to(secret)
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    app = create_app(models_dir=models_dir)
    with serving(app) as url:
        yield url, app.state.engine


@pytest.fixture
def url(server):
    return server[0]


def post(url: str, path: str = "/api/generate", *, raw: str | None = None, headers=None, **body):
    data = raw if raw is not None else json.dumps({"model": "tiny", "prompt": "Hello", "stream": False,
                                                    "options": GREEDY, **body})
    return requests.post(url + path, data=data, headers=headers or {}, timeout=60)


def assert_json_error(r, status: int, *needles: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    for needle in needles:
        assert needle in message, message
    return message


def test_the_server_still_answers_a_correct_request(url):
    r = post(url)
    assert r.status_code == 200 and r.json()["eval_count"] == 2


# ---------------------------------------------------------------------------------------------------
# values that overflowed or slipped through


@pytest.mark.parametrize("body", [
    '{"model":"tiny","prompt":"a\\ud800b","stream":false,"options":{"temperature":0,"num_predict":2}}',
    '{"model":"tiny","prompt":"ab","system":"\\udfff","stream":false,"options":{"num_predict":2}}',
    '{"model":"tiny","messages":[{"role":"user","content":"x\\udc00"}],"stream":false,"options":{"num_predict":2}}',
    '{"model":"tiny","prompt":"ab","stream":false,"options":{"num_predict":2,"stop":["\\ud83d"]}}',
])
def test_a_lone_surrogate_is_read_as_a_replacement_character(url, body):
    r = post(url, "/api/chat" if "messages" in body else "/api/generate", raw=body)
    assert r.status_code == 200, r.text[:300]


def test_a_lone_surrogate_in_a_model_name_is_a_json_error(url):
    assert_json_error(post(url, raw='{"model":"ti\\udc00ny","prompt":"x"}'), 400, "invalid model name", "\ufffd")


@pytest.mark.parametrize("limit,needle", [("1e400", "finite"), ("1" * 400, "larger than any device"),
                                          ('"1e400GiB"', "must be bytes"), ("-1", "negative")])
def test_memory_limits_that_overflowed_are_refused(url, limit, needle):
    raw = '{"model":"tiny","prompt":"x","stream":false,"options":{"pebbling_memory_limit":' + limit + '}}'
    assert_json_error(post(url, raw=raw), 400, "pebbling_memory_limit", needle)


@pytest.mark.parametrize("strategy", ["every:²", "every:٢", "every:" + "9" * 5000, "every:-1", "every:"])
def test_every_n_takes_ascii_digits_only(url, strategy):
    assert_json_error(post(url, options={"pebbling_strategy": strategy}), 400, "every:N", "ASCII")


def test_parsers_refuse_without_overflow():
    with pytest.raises(OptionsError, match="finite"):
        parse_size(float("inf"))
    with pytest.raises(OptionsError, match="larger than any device"):
        parse_size(10**400)
    assert parse_size(2**64 - 1) == 2**64 - 1 and parse_size("1.5GiB") == 3 * 2**29
    with pytest.raises(StrategyError):
        Strategy.parse("every:٢")
    assert Strategy.parse("every:007").arg == 7


@pytest.mark.parametrize("flags", [["--pebbling-memory-limit", "1e400"], ["--pebbling-strategy", "every:²"],
                                   ["--pebbling-memory-limit", "9" * 400]])
def test_the_cli_prints_one_line_for_the_same_values(models_dir, capsys, flags):
    assert cli_main(["run", str(models_dir / "tiny.gguf"), "hi", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pebbling: error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("option", [{"temperature": 1e400}, {"top_p": float("inf")}, {"temperature": 10**400}])
def test_numbers_past_floats_range_are_refused(url, option):
    raw = json.dumps({"model": "tiny", "prompt": "x", "stream": False, "options": option})
    assert_json_error(post(url, raw=raw.replace("Infinity", "1e400")), 400, "accepted")


# ---------------------------------------------------------------------------------------------------
# bounds before expensive work


def test_a_huge_prompt_is_cut_without_being_tokenized_in_full(models_dir, monkeypatch):
    engine = Engine(models_dir)
    try:
        engine.submit(GenerationRequest("tiny", prompt="x", options=GREEDY)).result()  # loaded
        model = next(iter(engine._loaded.values())).model
        encoded, encode = [], model.tokenizer.encode
        monkeypatch.setattr(model.tokenizer, "encode", lambda text, **k: encoded.append(len(text)) or encode(text, **k))
        start = time.perf_counter()
        job = engine.submit(GenerationRequest("tiny", prompt="y" * (7 << 20), options=GREEDY))
        text, final = job.result()
        seconds = time.perf_counter() - start
        # num_ctx is the file's 256 and num_predict 2: the prompt keeps num_keep (4) tokens at the start
        # and 250 at the end, room for the 2 to generate, and only text that could hold them was tokenized.
        assert len(job.tokens) == 254 and final.eval_count == 2
        assert final.report["prompt_truncated"] == "kept the first 4 and the last 250 tokens"
        assert max(encoded) < 256 * 64 and seconds < 2.0
    finally:
        engine.close()


def test_num_ctx_is_capped_by_the_server_as_well_as_the_file(models_dir):
    engine = Engine(models_dir, max_context=128)
    try:
        job = engine.submit(GenerationRequest("tiny", prompt="x", options={**GREEDY, "num_ctx": 200}))
        assert job.options.num_ctx == 128  # lowered, as Ollama lowers it, not refused
        text, final = job.result()
        assert final.eval_count == 2
    finally:
        engine.close()


def test_requests_past_the_queue_limit_are_refused_with_503(models_dir):
    engine = Engine(models_dir, max_queue=1)
    with serving(create_app(engine)) as url:
        assert post(url).status_code == 200
        entry = next(iter(engine._loaded.values()))
        with engine._lock:
            entry.active += 1  # a request queued or running holds the only place
        try:
            assert_json_error(post(url), 503, "busy", "PEBBLING_MAX_QUEUE")
            with pytest.raises(ServerBusyError):
                engine.submit(GenerationRequest("tiny", prompt="x"))
        finally:
            with engine._lock:
                entry.active -= 1
        assert post(url).status_code == 200  # a place again: served


@pytest.mark.parametrize("source,needle", [
    ("{{ 'x' * 300000000 }}", "sequence of 300000000"),
    ("{{ [0] * 100000000 }}", "sequence of 100000000"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "more than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
])
def test_a_chat_template_cannot_allocate_or_spin_without_bound(monkeypatch, source, needle):
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.3)
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=needle):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 3.0
    assert ChatTemplate("{{ messages[0]['content'] }}").render([{"role": "user", "content": "ok"}]) == "ok"


# ---------------------------------------------------------------------------------------------------
# crafted model files


@pytest.mark.parametrize("metadata,needle", [
    ({"llama.attention.head_count": 0}, "'llama.attention.head_count' is 0"),
    ({"llama.block_count": "four"}, "'llama.block_count' is 'four'"),
    ({"llama.context_length": -5}, "'llama.context_length' is -5"),
    ({"llama.context_length": 0}, "'llama.context_length' is 0"),
    ({"llama.rope.dimension_count": 7}, "must be even"),
    ({"llama.rope.dimension_count": 4096}, "'llama.rope.dimension_count' is 4096"),
    ({"llama.attention.head_count_kv": 3}, "cannot share 3 KV heads"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "finite number above 0"),
])
def test_crafted_hyperparameters_are_refused_at_load_naming_the_key(tmp_path, metadata, needle):
    path = write_gguf(tmp_path / "crafted.gguf", **TINY, metadata=metadata)
    with pytest.raises(ModelError, match=needle.replace("(", r"\(")):
        load_model(path, progress=False)


def test_a_tensor_offset_off_the_alignment_is_refused(tmp_path):
    path = write_gguf(tmp_path / "base.gguf", **TINY)
    reader = GGUFReader(path)
    offset = reader.tensors[0].field.parts[-1]  # the first tensor's data offset, inside the file
    at = offset.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
    del reader, offset
    data = bytearray(path.read_bytes())
    data[at:at + 8] = (int.from_bytes(data[at:at + 8], "little") + 4).to_bytes(8, "little")
    (tmp_path / "unaligned.gguf").write_bytes(data)
    with pytest.raises(ModelError, match="not a multiple of the file's alignment"):
        load_model(tmp_path / "unaligned.gguf", progress=False)


def test_a_model_that_cannot_load_is_a_400_naming_the_model_not_a_path(url, models_dir):
    message = assert_json_error(post(url, model="broken"), 400, "model 'broken'", "head_count")
    assert str(models_dir) not in message and "/" not in message.split("cannot be served:")[1]
    assert post(url).status_code == 200


# ---------------------------------------------------------------------------------------------------
# exposure


def test_show_names_the_model_not_its_path(url, models_dir):
    show = requests.post(f"{url}/api/show", json={"model": "tiny"}, timeout=30).json()
    assert "\nFROM tiny:latest\n" in show["modelfile"] and str(models_dir) not in json.dumps(show)


def test_a_link_out_of_the_models_directory_is_refused_without_echoing_its_target(url, models_dir):
    message = assert_json_error(post(url, model="outside"), 400, "link to a file outside")
    assert "s3cr3t" not in message and str(models_dir) not in message


def test_a_file_that_is_not_gguf_is_not_echoed(tmp_path):
    (tmp_path / "x.gguf").write_text("s3cr3t:x:0:0")
    with pytest.raises(ModelError) as caught:
        load_model(tmp_path / "x.gguf", progress=False)
    assert "s3cr3t" not in str(caught.value) and "GGUF" in str(caught.value)


def test_foreign_origins_and_host_names_are_refused(url):
    assert_json_error(post(url, headers={"Origin": "https://evil.example"}), 403, "PEBBLING_ORIGINS")
    r = requests.get(f"{url}/api/tags", headers={"Host": "attacker.example"}, timeout=10)
    assert_json_error(r, 403, "not a loopback name")
    r = post(url, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = requests.options(f"{url}/api/chat", headers={"Origin": "http://127.0.0.1:8080",
                                                      "Access-Control-Request-Method": "POST"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://127.0.0.1:8080"


def test_more_origins_can_be_allowed(models_dir, monkeypatch):
    monkeypatch.setenv("PEBBLING_ORIGINS", "https://app.example, chrome-extension://*")
    with serving(create_app(models_dir=models_dir)) as url:
        assert post(url, headers={"Origin": "https://app.example"}).status_code == 200
        assert post(url, headers={"Origin": "chrome-extension://abc"}).status_code == 200
        assert post(url, headers={"Origin": "https://other.example"}).status_code == 403


def test_a_bug_is_a_json_500_with_a_request_id_and_the_server_keeps_serving(server, monkeypatch):
    url, engine = server
    monkeypatch.setattr(engine, "list_models", lambda: 1 / 0)
    message = assert_json_error(requests.get(f"{url}/api/tags", timeout=10), 500, "ZeroDivisionError", "request ")
    assert "Traceback" not in message
    monkeypatch.undo()
    assert requests.get(f"{url}/api/tags", timeout=10).status_code == 200
    assert post(url).status_code == 200


def test_no_response_names_a_path_of_this_machine(url, models_dir):
    home = os.path.expanduser("~")
    for r in (post(url, model="broken"), post(url, model="absent"), post(url, model="outside"),
              requests.get(f"{url}/api/tags", timeout=10), requests.get(f"{url}/api/ps", timeout=10)):
        assert str(models_dir) not in r.text and home not in r.text, r.text[:300]


@pytest.mark.parametrize("options,expected", [
    ({"temperature": 1e-320}, 3),                               # the limit of a vanishing temperature: argmax
    ({"temperature": 1e-30, "repeat_penalty": 1e-300}, 1),      # a vanishing penalty sends seen logits to +inf
    ({"temperature": 0.5, "repeat_penalty": 1e300}, 3),
])
def test_sampling_takes_the_limit_at_extreme_but_accepted_values(options, expected):
    import warnings

    import numpy as np

    from pyplugin.runtime.options import Options
    from pyplugin.runtime.sampling import Sampler

    sampler = Sampler(Options(seed=1, **options))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow, no NaN on the way
        assert {sampler(np.array([1.0, 3.0, -2.0, 3.5], np.float32), [1, 2]) for _ in range(8)} == {expected}


def test_an_undecodable_command_line_argument_is_read_as_a_replacement_character(models_dir, capsys):
    assert cli_main(["run", str(models_dir / "tiny.gguf"), "a\udcffb", "--num-predict", "2", "--temperature", "0"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_crafted_huge_context_length_cannot_make_a_request_reserve_it(tmp_path):
    write_gguf(tmp_path / "wide.gguf", **{**TINY, "n_ctx": 1 << 21})
    engine = Engine(tmp_path, max_context=4096)
    try:
        job = engine.submit(GenerationRequest("wide", prompt="x", options={**GREEDY, "num_ctx": 1 << 21}))
        assert job.options.num_ctx == 4096  # the server's limit, not the file's 2^21
        job.result()
        text, final = engine.submit(GenerationRequest("wide", prompt="x", options=GREEDY)).result()
        assert final.eval_count == 2
    finally:
        engine.close()
