"""`GET /metrics` in Prometheus's format after a few requests, parsed by prometheus_client's own parser,
and the log line each finished generation writes."""

from __future__ import annotations

import logging

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
    with serving(create_app(models_dir=root)) as url:
        yield url


def samples(url: str) -> dict:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_tokens_bytes_and_memory(url, caplog, monkeypatch):
    # Host memory computes streamed layers in place, restoring nothing: the copies a GPU makes are made
    # here as there, so that the restored bytes the metric adds up are more than none.
    from pyplugin.store import select_backend
    monkeypatch.setattr(type(select_backend()), "arrays_on_device", True)
    body = {"model": "tiny", "prompt": "Hello", "stream": False,
            "options": {"temperature": 0, "num_predict": 4, "pebbling_strategy": "minimal"}}
    with caplog.at_level(logging.INFO, logger="pebbling.server"):
        answers = [requests.post(f"{url}/api/generate", json=body, timeout=60).json() for _ in range(3)]
    requests.post(f"{url}/api/generate", json={"model": "absent", "prompt": "x"}, timeout=60)
    m = samples(url)
    assert m[("pebbling_requests_total", (("route", "/api/generate"), ("status", "200")))] == 3
    assert m[("pebbling_requests_total", (("route", "/api/generate"), ("status", "404")))] == 1
    assert m[("pebbling_generated_tokens_total", (("model", "tiny"),))] == sum(a["eval_count"] for a in answers) == 12
    assert m[("pebbling_prompt_tokens_total", (("model", "tiny"),))] == sum(a["prompt_eval_count"] for a in answers)
    restored = sum(a["pebbling"]["bytes_restored"] for a in answers)
    assert m[("pebbling_bytes_restored_total", (("model", "tiny"),))] == restored > 0
    assert m[("pebbling_peak_device_bytes", (("model", "tiny"),))] == answers[-1]["pebbling"]["measured_peak_bytes"]
    assert m[("pebbling_models_loaded", ())] == 1 and m[("pebbling_requests_active", ())] == 0
    assert m[("pebbling_request_seconds_count", (("route", "/api/generate"),))] == 4
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model=tiny")]
    assert len(lines) == 3 and "strategy=minimal" in lines[0] and "generated=4" in lines[0]


def test_unmatched_paths_share_one_label(url):
    for path in ("/nothing", "/api/nothing", "/a/b/c"):
        requests.get(url + path, timeout=10)
    m = samples(url)
    assert m[("pebbling_requests_total", (("route", "unmatched"), ("status", "404")))] >= 3
    assert not any("nothing" in str(key) for key in m)
