"""A model's memory goes with it: loaded and unloaded again and again at a large num_ctx (keep_alive 0, through
the HTTP server), the process ends within a few MiB of where it began. Once, each sequence's KV caches were
kept alive by the kernels' table of cache pointers (shared by every model) after the model had gone:
+256 MB a request at num_ctx 16384 on the demo model."""

from __future__ import annotations

import gc
import json

import pytest
import requests

from pyplugin.model.synth import write_gguf
from pyplugin.runtime.layout import process_memory
from server_patch import create_app
from server_patch.local import serving

from helpers import store_backend_params

NUM_CTX = 16384
CYCLES = 20
TOLERANCE = 32 << 20
# Wide enough that one load's caches (2 layers x K and V x 16384 rows x 64 float32) are 16 MiB: a leak of
# even a few of the 20 would pass the tolerance.
SHAPE = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=128, n_ctx=NUM_CTX)


def _rss() -> int:
    gc.collect()
    rss = process_memory()["process_rss_bytes"]
    if rss is None:
        pytest.skip("this system's /proc does not report VmRSS")
    return rss


@pytest.mark.parametrize("backend", store_backend_params())
def test_loading_and_unloading_a_model_20_times_ends_where_it_began(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("PEBBLING_BACKEND", backend)
    write_gguf(tmp_path / "long.gguf", **SHAPE)
    app = create_app(models_dir=tmp_path)
    # A prompt of one token (a context, no text) is computed by the kernels' attention of one query, the
    # path whose table of cache pointers held the caches; the tokens after it by the decode step.
    body = json.dumps({"model": "long", "prompt": "", "context": [300], "raw": True, "stream": False,
                       "keep_alive": 0, "options": {"temperature": 0, "num_predict": 3, "num_ctx": NUM_CTX}})
    with serving(app) as url:
        def cycle() -> None:
            r = requests.post(url + "/api/generate", data=body, timeout=120)
            assert r.status_code == 200, r.text[:300]
            assert (r.json()["prompt_eval_count"], r.json()["eval_count"]) == (1, 3)
            assert requests.get(url + "/api/ps", timeout=10).json()["models"] == []  # unloaded

        for _ in range(2):  # warm-up: allocators, thread pools and imports reach their steady state
            cycle()
        before = _rss()
        for _ in range(CYCLES):
            cycle()
        after = _rss()
    app.state.engine.close()
    growth = after - before
    print(f"\n{backend}: RSS {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB after {CYCLES} loads and "
          f"unloads at num_ctx {NUM_CTX} (measured, VmRSS): {growth / 2**20:+.1f} MiB")
    assert growth < TOLERANCE, f"RSS grew by {growth / 2**20:.1f} MiB over {CYCLES} load/unload cycles"
