"""The OpenAI API's fields that were silently ignored: `n` gives n choices, `content: null` is read as
empty, and fields asking for what pebbling does not do (yet) are refused naming them. (tools, tool_choice
and think are honoured: test_tools.py, test_thinking.py.)"""

from __future__ import annotations

import pytest
import requests

from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
    with serving(create_app(models_dir=root)) as url:
        yield url


def chat(url, **body):
    return requests.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **body}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_gives_n_choices_each_reproducible_by_its_seed(url, path):
    body = {"model": "tiny", "max_tokens": 6, "n": 3, "seed": 7, "temperature": 1.0}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Once"})
    r = requests.post(url + path, json=body, timeout=60).json()
    texts = [c["message"]["content"] if "chat" in path else c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    assert r["usage"]["completion_tokens"] == 18 and r["usage"]["prompt_tokens"] > 0
    one = requests.post(url + path, json={**body, "n": 1, "seed": 8}, timeout=60).json()["choices"][0]
    assert (one["message"]["content"] if "chat" in path else one["text"]) == texts[1]  # choice 1 is seed + 1


def test_content_null_is_read_as_empty(url):
    r = requests.post(f"{url}/api/chat", json={"model": "tiny", "stream": False, "options": {"num_predict": 2},
                                               "messages": [{"role": "system", "content": None},
                                                            {"role": "user", "content": "Hi"}]}, timeout=60)
    assert r.status_code == 200
    messages = [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}]
    assert chat(url, messages=messages).status_code == 200


@pytest.mark.parametrize("field", [{"top_logprobs": 3}, {"logprobs": "yes"}, {"logit_bias": {"5": 10}},
                                   {"functions": [{"name": "f"}]}, {"function_call": {"name": "f"}},
                                   {"reasoning_effort": "high"}, {"n": 2, "stream": True}])
def test_fields_pebbling_does_not_do_are_refused_naming_them(url, field):
    r = chat(url, **field)
    assert r.status_code == 400
    assert next(iter(field)) in r.json()["error"]["message"]


@pytest.mark.parametrize("field", [{"logprobs": False}, {"tool_choice": "none"}, {"logit_bias": {}},
                                   {"user": "someone"}, {"reasoning_effort": "none"}, {"think": False},
                                   {"parallel_tool_calls": True}])
def test_their_neutral_values_are_accepted(url, field):
    assert chat(url, **field).status_code == 200


@pytest.mark.parametrize("field", [{"think": True}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}])
def test_ollama_routes_refuse_them_too(url, field):
    r = requests.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "x", "stream": False, **field},
                      timeout=60)
    assert r.status_code == 400 and next(iter(field)) in r.json()["error"]
    ok = requests.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "x", "stream": False, "think": False,
                                                    "options": {"num_predict": 1}}, timeout=60)
    assert ok.status_code == 200
