"""A GGUF file whose tensor shapes do not fit their type is refused when it is opened, naming the tensor:
a dimension of 0 (once a ZeroDivisionError where rows were counted), a Q8_0 matrix of 33 columns or a Q8_0
vector of 17 elements (once numpy's ValueError from a reshape). Through the server, a 400 naming the model
and the tensor, never a 500, and the server serves on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import requests

from helpers import craft
from pyplugin.errors import ModelError
from pyplugin.model import GGUFFile, load_model
from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
Q8_0 = 8

# name: (tensor, new GGUF type id or None to keep it, new ne in GGUF order, what the error must say)
CRAFTED = {
    "zero-dimension": ("blk.0.attn_q.weight", None, (64, 0), "dimension of 0"),
    "q8_0-33-columns": ("blk.0.attn_q.weight", Q8_0, (33, 64), "33 elements"),
    "q8_0-17-element-vector": ("blk.0.attn_norm.weight", Q8_0, (17,), "17 elements"),
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crafted")
    base = write_gguf(tmp_path_factory.mktemp("base") / "base.gguf", **TINY)
    shutil.copy(base, root / "tiny.gguf")
    for name, (tensor, qtype, ne, _) in CRAFTED.items():
        craft(base, root / f"{name}.gguf", tensor, qtype, ne)
    return root


@pytest.mark.parametrize("name", list(CRAFTED))
@pytest.mark.parametrize("weights", ["quantized", "f16"])
def test_a_tensor_whose_shape_does_not_fit_its_type_is_refused_at_open_naming_it(models_dir, name, weights):
    tensor, _, ne, needle = CRAFTED[name]
    with pytest.raises(ModelError) as caught:
        GGUFFile(models_dir / f"{name}.gguf")
    message = str(caught.value)
    assert tensor in message and needle in message and str(list(ne)) in message, message
    with pytest.raises(ModelError, match=tensor):
        load_model(models_dir / f"{name}.gguf", weights=weights, progress=False)


def test_rows_of_whole_blocks_are_accepted(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", **TINY, weight_type="Q8_0")
    with GGUFFile(path) as f:
        assert f.tensors["blk.0.attn_q.weight"].shape == (64, 64)


@pytest.fixture(scope="module")
def url(models_dir):
    app = create_app(models_dir=models_dir)
    with serving(app) as url:
        yield url
    app.state.engine.close()


@pytest.mark.parametrize("name", list(CRAFTED))
def test_the_server_answers_a_crafted_shape_with_a_400_naming_the_tensor(url, models_dir, name):
    tensor, _, _, needle = CRAFTED[name]
    for path, body in (("/api/generate", {"model": name, "prompt": "hi", "stream": False}),
                       ("/api/chat", {"model": name, "messages": [{"role": "user", "content": "hi"}],
                                      "stream": False}),
                       ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}]})):
        r = requests.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        error = r.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert f"model '{name}'" in message and tensor in message and needle in message, message
        assert str(models_dir) not in message
    r = requests.post(url + "/api/show", json={"model": name}, timeout=60)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])  # the header alone, or its refusal
    assert requests.get(url + "/api/tags", timeout=60).status_code == 200
    r = requests.post(url + "/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 1}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 1
