"""Structured output: a JSON schema (or "json") masks the logits at every step, so that what a model writes
always parses and validates, whatever its weights; on Ollama's `format` and OpenAI's `response_format`,
under every strategy and backend."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from helpers import store_backend_params, tiny_model
from pyplugin.errors import OptionsError
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import Generation, Options, PebbledModel, PebblingOptions
from pyplugin.runtime.constraint import Constraint, closed_objects
from pyplugin.store import Strategy
from server_patch import create_app
from server_patch.local import serving

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}, "label": NAME},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", 3, None]}},
     "required": ["ok", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "name": NAME},
        "required": ["id", "name"], "additionalProperties": False}}}, "required": ["rows"],
     "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"choice": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3},
                                                           {"type": "string", "maxLength": 4}]}},
     "required": ["choice"], "additionalProperties": False},
]
ARCHS = ("llama", "qwen2", "phi3")


def constrained_text(model, fmt, seed: int, *, layers=None) -> tuple[str, str]:
    gen = Generation(model, Options(temperature=1.0, seed=seed, num_predict=400, num_ctx=512),
                     layers=layers, constraint=Constraint.from_format(model.tokenizer, fmt))
    ids = list(gen.tokens(model.tokenizer.encode("Answer in JSON:")))
    return model.tokenizer.decode(ids), gen.stats.done_reason


@pytest.mark.parametrize("arch", ARCHS)
def test_two_hundred_objects_all_parse_and_validate(arch):
    """200 across the three architectures' tokenizers (67 + 67 + 66), every schema many times over."""
    model = tiny_model(arch, n_layer=1)
    count = {"llama": 67, "qwen2": 67, "phi3": 66}[arch]
    for n in range(count):
        schema = SCHEMAS[n % len(SCHEMAS)]
        text, reason = constrained_text(model, schema, seed=n)
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_gives_an_object():
    """"json" bounds nothing, and a random model writes strings as long as num_predict lets it: every
    output starts an object, and every one that ends is one."""
    model = tiny_model("llama", n_layer=1)
    ended = 0
    for seed in range(30):
        text, reason = constrained_text(model, "json", seed)
        assert text.startswith("{")
        if reason == "stop":
            ended += 1
            assert isinstance(json.loads(text), dict), text
    assert ended >= 5


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("strategy", ["none", "minimal", "every:2"])
def test_every_strategy_and_backend_follows_the_schema_with_the_same_tokens(backend, strategy):
    model = tiny_model("qwen2", weights="quantized", n_layer=4)
    pebbled = PebbledModel(model, backend=backend)
    try:
        options = Options(temperature=0.7, seed=5, num_predict=300, num_ctx=512)
        outputs = []
        for s in ("none", strategy):
            gen = pebbled.generation(options, PebblingOptions(Strategy.parse(s)), 8,
                                     constraint=Constraint.from_format(model.tokenizer, SCHEMAS[5]))
            outputs.append(model.tokenizer.decode(list(gen.tokens(model.tokenizer.encode("JSON please")))))
        assert outputs[0] == outputs[1]
        jsonschema.validate(json.loads(outputs[1]), SCHEMAS[5])
    finally:
        pebbled.close()


@pytest.mark.parametrize("fmt,needle", [("yaml", "accepted: \"json\", or a JSON schema"), (3, "accepted"),
                                        ({"type": "nonsense"}, "format"), ({"$ref": "#/nowhere"}, "format")])
def test_a_bad_format_is_refused_naming_it(fmt, needle):
    with pytest.raises(OptionsError, match=needle):
        Constraint.from_format(tiny_model("llama", n_layer=1).tokenizer, fmt)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=512)
    with serving(create_app(models_dir=root)) as url:
        yield url


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_ollamas_format_on_both_routes(url, path):
    schema = SCHEMAS[0]
    body = {"model": "tiny", "stream": False, "format": schema, "options": {"seed": 3, "num_predict": 300}}
    body.update({"prompt": "Who?"} if path == "/api/generate" else {"messages": [{"role": "user", "content": "Who?"}]})
    r = requests.post(url + path, json=body, timeout=60)
    text = r.json()["response"] if path == "/api/generate" else r.json()["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    streamed = requests.post(url + path, json={**body, "stream": True}, timeout=60)
    pieces = [json.loads(line) for line in streamed.text.splitlines()]
    joined = "".join(p.get("response") or p.get("message", {}).get("content", "") for p in pieces)
    assert joined == text and pieces[-1]["done"]


@pytest.mark.parametrize("response_format,check", [
    ({"type": "json_object"}, lambda v: isinstance(v, dict)),
    ({"type": "json_schema", "json_schema": {"name": "tags", "strict": True, "schema": SCHEMAS[1]}},
     lambda v: jsonschema.validate(v, SCHEMAS[1]) is None),
])
def test_openais_response_format(url, response_format, check):
    r = requests.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": response_format,
        "max_tokens": 300, "seed": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert check(json.loads(r.json()["choices"][0]["message"]["content"]))
    bad = requests.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, timeout=60)
    assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]


# Pydantic's form of a model with a nested model: objects that list properties and say nothing of others.
OPEN = {"$defs": {"Inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["n"]}},
        "type": "object", "properties": {"color": {"enum": ["red", "green"]}, "inner": {"$ref": "#/$defs/Inner"}},
        "required": ["color", "inner"]}


def test_objects_that_list_their_properties_take_no_others_as_in_ollama():
    """llama.cpp's converter (and so Ollama) adds other keys only where additionalProperties allows them."""
    closed = closed_objects(OPEN)
    assert closed["additionalProperties"] is False and closed["$defs"]["Inner"]["additionalProperties"] is False
    assert "additionalProperties" not in OPEN  # the request's schema is not changed in place
    kept = closed_objects({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}})
    assert kept["additionalProperties"] == {"type": "integer"}
    assert closed_objects({"type": "object"}) == {"type": "object"}  # lists nothing: any object, as "json"
    model = tiny_model("phi3", n_layer=1)
    for seed in range(6):
        text, reason = constrained_text(model, OPEN, seed)
        value = json.loads(text)
        assert reason == "stop" and set(value) == {"color", "inner"} and set(value["inner"]) == {"n"}
