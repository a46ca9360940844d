"""Issue 44's third round of hardening, each a regression test: a request field of the wrong kind that reached
a dict lookup (a 500) is a 400 from the schema naming its place and what is accepted; a GGUF whose per-token
tokenizer arrays disagree with its vocabulary is refused where the tokenizer is read, by create and by a
generate alike, never a 500 later; create refuses a Modelfile layer that the store's reader would refuse,
by the reader's own check, instead of making a model that is never listed; and a call forced by tool_choice
that the token limit cuts short never comes back as text."""

from __future__ import annotations

import hashlib
import json

import pytest
import requests

from helpers import script_replies, tiny_spec
from pyplugin.errors import ModelError
from pyplugin.model import GGUFFile, Tokenizer, load_model
from pyplugin.model.synth import write_gguf
from pyplugin.serving import ollama_store
from pyplugin.serving.tool_calls import LLAMA3, QWEN, CutCall, ToolCall, ToolCallParser
from server_patch import create_app
from server_patch.local import serving

TINY = dict(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=512)
LIMIT = ollama_store.MAX_LAYER_BYTES
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def token_arrays(**spec) -> dict:
    """The tokenizer arrays of the tiny model `spec` makes, to craft shorter or longer ones from."""
    with GGUFFile(write_gguf(spec.pop("path"), **TINY, **spec)) as f:
        return {k: v for k, v in f.metadata.items() if isinstance(v, list)}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict[str, tuple]:
    """name -> (spec, the key the file gets wrong): files whose tokenizer arrays do not fit the vocabulary."""
    root = tmp_path_factory.mktemp("arrays")
    bpe = token_arrays(path=root / "bpe.gguf")
    spm = token_arrays(path=root / "spm.gguf", arch="phi3", vocab="spm")
    types, scores, merges = (bpe["tokenizer.ggml.token_type"], spm["tokenizer.ggml.scores"],
                             bpe["tokenizer.ggml.merges"])
    return {
        "short-types": ({"metadata": {"tokenizer.ggml.token_type": types[:-5]}}, "'tokenizer.ggml.token_type' has "
                        f"{len(types) - 5} entries and 'tokenizer.ggml.tokens' {len(types)}: expected one per token"),
        "long-types": ({"metadata": {"tokenizer.ggml.token_type": types + [1] * 3}},
                       f"'tokenizer.ggml.token_type' has {len(types) + 3} entries"),
        "short-scores": ({"arch": "phi3", "vocab": "spm", "metadata": {"tokenizer.ggml.scores": scores[:-3]}},
                         f"'tokenizer.ggml.scores' has {len(scores) - 3} entries and 'tokenizer.ggml.tokens' "
                         f"{len(scores)}: expected one per token"),
        "stray-merge": ({"metadata": {"tokenizer.ggml.merges": merges + ["zq xj"]}},
                        f"'tokenizer.ggml.merges'[{len(merges)}] is 'zq xj': expected two tokens of the vocabulary"),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory, crafted):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    write_gguf(root / "llama.gguf", tiny_spec("llama", **TINY))   # calls as bare JSON
    write_gguf(root / "qwen.gguf", tiny_spec("qwen2", **TINY))    # calls in <tool_call> tags
    for name, (spec, _) in crafted.items():
        write_gguf(root / f"{name}.gguf", **{**TINY, **spec})
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def url(models, store):
    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    with serving(create_app(models_dir=models)) as url:
        yield url
    patch.undo()


def assert_400(r, *needles: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:400])
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    for needle in needles:
        assert needle in message, message
    return message


def still_serves(url: str) -> None:
    r = requests.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "Hi", "stream": False,
                                                  "options": {"num_predict": 2}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 2


# ---------------------------------------------------------------------------------------------------
# a field of the wrong kind


ACCEPTED_ROLES = "'user', 'assistant', 'system' or 'developer'"


@pytest.mark.parametrize("item,needles", [
    ({"role": {"name": "user"}, "content": "hi"}, ["'input.0.role'", ACCEPTED_ROLES]),
    ({"role": ["user"], "content": "hi"}, ["'input.0.role'", ACCEPTED_ROLES]),
    ({"type": "message", "role": [{"a": 1}], "content": "hi"}, ["'input.0.role'", ACCEPTED_ROLES]),
    ({"type": {"message": 1}, "role": "user", "content": "hi"}, ["'input.0.type'", "'message', 'function_call'"]),
    ({"type": "function_call", "name": ["f"], "call_id": "c", "arguments": "{}"}, ["'input.0.name'", "string"]),
    ({"type": "function_call", "name": "f", "call_id": {"id": 1}}, ["'input.0.call_id'", "string"]),
    ({"type": "function_call_output", "call_id": ["c"], "output": "x"}, ["'input.0.call_id'", "string"]),
    ({"type": "function_call_output", "call_id": "c", "output": {"x": 1}}, ["'input.0.output'", "string"]),
])
def test_a_responses_input_item_field_of_the_wrong_kind_is_a_400_naming_it(url, item, needles):
    r = requests.post(f"{url}/v1/responses", json={"model": "tiny", "input": [item], "max_output_tokens": 2},
                      timeout=60)
    assert_400(r, *needles)
    still_serves(url)


@pytest.mark.parametrize("field,value", [("role", {"r": 1}), ("role", ["user"]), ("name", ["bob"]),
                                         ("tool_call_id", {"id": 1}), ("reasoning_content", ["x"])])
def test_a_chat_completions_message_field_of_the_wrong_kind_is_a_400_naming_it(url, field, value):
    message = {"role": "user", "content": "hi", field: value}
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [message], "max_tokens": 2},
                      timeout=60)
    assert_400(r, f"'messages.0.{field}'", "string")


# ---------------------------------------------------------------------------------------------------
# tokenizer arrays that do not fit the vocabulary


@pytest.mark.parametrize("name", ["short-types", "long-types", "short-scores", "stray-merge"])
def test_a_tokenizer_array_that_does_not_fit_the_vocabulary_is_refused_where_it_is_read(models, crafted, name):
    with pytest.raises(ModelError, match=crafted[name][1].replace("[", r"\[").replace("]", r"\]")):
        load_model(models / f"{name}.gguf", progress=False)
    with GGUFFile(models / f"{name}.gguf") as f, pytest.raises(ModelError, match="tokenizer.ggml."):
        Tokenizer.from_metadata(f.metadata, name)


@pytest.mark.parametrize("name", ["short-types", "long-types", "short-scores", "stray-merge"])
def test_a_generate_of_such_a_file_is_a_400_naming_the_key_not_a_500(url, crafted, name):
    for _ in range(2):  # the second, too: nothing half-loaded is left to fail differently
        r = requests.post(f"{url}/api/generate", json={"model": name, "prompt": "Hello there", "stream": False,
                                                      "options": {"num_predict": 3}}, timeout=60)
        message = assert_400(r, f"model '{name}'", crafted[name][1])
        assert "/" not in message.split("cannot be served:")[1]  # the file named as the model, not by path
    still_serves(url)


def upload(url: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert requests.post(f"{url}/api/blobs/{digest}", data=data, timeout=60).status_code == 201
    return digest


def listed(url: str) -> set[str]:
    return {m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}


@pytest.mark.parametrize("name", ["short-types", "long-types", "short-scores", "stray-merge"])
def test_create_refuses_such_a_file_with_a_400_naming_the_key(url, models, crafted, name):
    digest = upload(url, (models / f"{name}.gguf").read_bytes())
    r = requests.post(f"{url}/api/create", json={"model": f"made-{name}", "files": {"m.gguf": digest},
                                                "stream": False}, timeout=60)
    message = assert_400(r, "'files': m.gguf", crafted[name][1])
    assert str(models) not in message
    r = requests.post(f"{url}/api/create", json={"model": f"from-{name}", "from": name, "stream": False}, timeout=60)
    assert_400(r, f"'from': model '{name}'", crafted[name][1])
    assert not {f"made-{name}:latest", f"from-{name}:latest"} & listed(url)


# ---------------------------------------------------------------------------------------------------
# layers the store's reader would refuse


@pytest.mark.parametrize("fields,field", [
    ({"parameters": {"stop": [f"stop-{i:06d}" for i in range(200_000)]}}, "'parameters'"),
    ({"messages": [{"role": "user", "content": "x" * LIMIT}]}, "'messages'"),
    ({"system": "s" * (LIMIT + 1)}, "'system'"),
    ({"license": ["MIT", "l" * (LIMIT + 1)]}, "'license'"),
])
def test_create_refuses_a_layer_the_store_could_not_read_back(url, models, store, fields, field):
    digest = upload(url, (models / "tiny.gguf").read_bytes())
    r = requests.post(f"{url}/api/create", json={"model": "too-big", "files": {"tiny.gguf": digest},
                                                "stream": False, **fields}, timeout=120)
    assert_400(r, field, f"over {LIMIT} bytes")
    assert "too-big:latest" not in listed(url)
    assert not (store / "manifests" / "registry.ollama.ai" / "library" / "too-big").exists()
    still_serves(url)


def test_create_checks_the_parameters_as_merged_with_the_base_models(url, models):
    digest = upload(url, (models / "tiny.gguf").read_bytes())
    stops = [f"stop-{i:06d}" for i in range(45_000)]  # about 0.6 MiB as JSON: a layer the store reads
    r = requests.post(f"{url}/api/create", json={"model": "base-stops", "files": {"tiny.gguf": digest},
                                                "parameters": {"stop": stops}, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert "base-stops:latest" in listed(url)
    # tfs_z is Ollama's and not applied by pebbling: kept as given, here 0.6 MiB of it
    more = {"tfs_z": "e" * (600 << 10)}
    r = requests.post(f"{url}/api/create", json={"model": "more-stops", "from": "base-stops", "parameters": more,
                                                "stream": False}, timeout=120)
    assert_400(r, "'parameters'", f"over {LIMIT} bytes")
    assert "more-stops:latest" not in listed(url)


def test_the_store_reader_and_create_share_one_check():
    assert ollama_store.check_layer("params", b'{"stop": ["x"]}') == '{"stop": ["x"]}'
    for kind, data, says in [("params", b"[1]", "is not a JSON object"), ("messages", b"[1]", "list of objects"),
                             ("messages", b"{", "is not valid JSON"), ("system", b"s" * (LIMIT + 1), "over")]:
        with pytest.raises(ValueError, match=says):
            ollama_store.check_layer(kind, data)


# ---------------------------------------------------------------------------------------------------
# a forced call cut by the token limit


def test_a_forced_call_cut_short_is_kept_apart_from_the_content():
    bare = ToolCallParser(LLAMA3, [WEATHER, ADD], forced=[WEATHER])
    assert bare.feed('{"name":"get_weather","parameters":{"city":"Par') == ("", [])
    assert bare.finish() == ("", []) and bare.cut == CutCall("get_weather", '{"city":"Par')
    tagged = ToolCallParser(QWEN, [WEATHER, ADD], forced=[WEATHER, ADD])
    assert tagged.feed('<tool_call>\n{"name":"ad') == ("", [])
    assert tagged.finish() == ("", []) and tagged.cut == CutCall("", "")
    # the model chose (auto): what it wrote stays its text, as before
    chosen = ToolCallParser(LLAMA3, [WEATHER, ADD])
    chosen.feed('{"name":"get_weather","par')
    assert chosen.finish() == ('{"name":"get_weather","par', []) and chosen.cut is None


@pytest.mark.parametrize("forced", [None, [ADD]])
def test_a_call_whole_but_for_its_closing_tag_is_a_call(forced):
    parser = ToolCallParser(QWEN, [WEATHER, ADD], forced=forced)
    parser.feed('<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_')
    assert parser.finish() == ("", [ToolCall("add", {"a": 1})]) and parser.cut is None


CALLS = {"llama": '{"name":"get_weather","parameters":{"city":"Paris in the spring"}}',
         "qwen": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris in the spring"}}\n</tool_call>'}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def cut_call(monkeypatch, models):
    """`cut(model)`: the model's next replies write a get_weather call; returns the token limit that cuts it
    inside its arguments, just past "Paris"."""
    write = script_replies(monkeypatch, models)

    def cut(model: str) -> int:
        write(model, CALLS[model])
        with GGUFFile(models / f"{model}.gguf") as f:
            tokenizer = Tokenizer.from_metadata(f.metadata, model)
        ids = tokenizer.encode_fragment(CALLS[model])
        return next(n for n in range(len(ids)) if '"city":"Paris' in tokenizer.decode(ids[:n]))
    return cut


def check_cut_item(item: dict) -> None:
    assert item["type"] == "function_call" and item["status"] == "incomplete" and item["name"] == "get_weather"
    assert item["arguments"].startswith('{"city":"Paris') and item["arguments"] != '{"city":"Paris in the spring"}'
    assert '{"city":"Paris in the spring"}'.startswith(item["arguments"])


@pytest.mark.parametrize("model", CALLS)
def test_a_forced_call_cut_by_the_token_limit_is_no_text_on_chat_completions(url, cut_call, model):
    body = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": cut_call(model)}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"], choice
    assert "tool_calls" not in choice["message"]
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "" and not any("tool_calls" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("model", CALLS)
def test_a_forced_call_cut_by_the_token_limit_is_an_incomplete_function_call_item(url, cut_call, model):
    body = {"model": model, "input": ASK, "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": "required", "max_output_tokens": cut_call(model)}
    r = requests.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = r["output"]
    check_cut_item(item)
    r = requests.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert not [e for e in events if e["type"] == "response.output_text.delta"]
    (item,) = events[-1]["response"]["output"]
    check_cut_item(item)
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == item


def test_a_message_the_token_limit_cuts_is_an_incomplete_item(url, monkeypatch, models):
    script_replies(monkeypatch, models)("tiny", "The weather in Paris is mild in the spring.")
    body = {"model": "tiny", "input": "Weather?", "max_output_tokens": 3}
    r = requests.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert r["status"] == "incomplete" and [item["status"] for item in r["output"]] == ["incomplete"]
    events = [json.loads(line[6:]) for line in requests.post(f"{url}/v1/responses", json={**body, "stream": True},
                                                             timeout=60).text.splitlines() if line.startswith("data: ")]
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["status"] == "incomplete" and events[-1]["response"]["output"] == [done]
    whole = requests.post(f"{url}/v1/responses", json={**body, "max_output_tokens": 100}, timeout=60).json()
    assert whole["status"] == "completed" and [item["status"] for item in whole["output"]] == ["completed"]


@pytest.mark.parametrize("method,path", [("POST", "/v1/nothing"), ("GET", "/v1/files"), ("POST", "/v1/")])
def test_an_unknown_v1_path_is_not_found_not_a_missing_model(url, method, path):
    r = requests.request(method, url + path, json={}, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert "no such endpoint" in error["message"] and error["code"] != "model_not_found"


def test_a_missing_model_on_v1_is_model_not_found(url):
    r = requests.post(url + "/v1/chat/completions", timeout=30,
                      json={"model": "absent", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
