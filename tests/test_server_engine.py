"""The engine behind the server, without HTTP: keep_alive, request templates, pebbling options,
queueing and the order in which a job reports its text and its error."""

from __future__ import annotations

import math
import threading

import pytest

from pyplugin.runtime import PebblingOptions
from pyplugin.serving import Engine, Final, GenerationRequest, Job, ModelNotFoundError
from pyplugin.serving.catalogue import format_parameters
from pyplugin.serving.go_template import render_go_template
from pyplugin.serving.jobs import FOREVER, parse_keep_alive
from pyplugin.errors import OptionsError, StrategyError
from pyplugin.serving.ollama_store import InvalidModelName
from pyplugin.runtime.options import Options
from pyplugin.model.synth import write_gguf


@pytest.mark.parametrize("value,seconds", [
    (None, 300.0), (0, 0.0), (30, 30.0), (2.5, 2.5), ("0", 0.0), ("10m", 600.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("300ms", 0.3), ("90", 90.0), (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER),
])
def test_keep_alive_reads_like_ollama(value, seconds):
    assert math.isclose(parse_keep_alive(value), seconds) or parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "10 minutes", "5x", "", True, [1], {"m": 5}, float("nan")])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(OptionsError, match="keep_alive"):
        parse_keep_alive(value)


def test_pebbling_options_are_checked_where_they_arrive():
    parsed = PebblingOptions.from_options({"pebbling_strategy": "every:3", "pebbling_enabled": False,
                                           "pebbling_memory_limit": "1GiB"})
    assert (parsed.strategy.name, parsed.strategy.arg, parsed.enabled, parsed.memory_limit) == \
        ("every:3", 3, False, 1 << 30)
    assert PebblingOptions.from_options({}) == PebblingOptions()
    with pytest.raises(StrategyError, match="valid: none, sqrt"):
        PebblingOptions.from_options({"pebbling_strategy": "most"})
    with pytest.raises(OptionsError, match="pebbling_enabled"):
        PebblingOptions.from_options({"pebbling_enabled": 1})
    with pytest.raises(OptionsError, match="pebbling_memory_limit"):
        PebblingOptions.from_options({"pebbling_memory_limit": "lots"})


def test_request_templates_render_variables_and_conditions():
    values = {"System": "Be brief.", "Prompt": "Hi", "Response": ""}
    template = "{{ if .System }}<s>{{ .System }}</s>\n{{- end }}\n{{ .Prompt }}{{ .Response }}"
    assert render_go_template(template, values) == "<s>Be brief.</s>\nHi"
    assert render_go_template(template, {**values, "System": ""}) == "\nHi"
    assert render_go_template("{{ if .System }}a{{ else }}b{{ end }} {{- /* note */ -}} !", values) == "a!"
    for bad, message in (("{{ template \"x\" }}", "not supported"), ("{{ if .System }}x", "no {{ end }}"),
                         ("{{ .System.Name }}", "can't evaluate field Name"), ("{{ nope 1 }}", "'nope' is not defined"),
                         ("{{ end }}", "without an if")):
        with pytest.raises(OptionsError, match=message):
            render_go_template(bad, values)


def test_parameter_sizes_read_like_ollamas():
    assert [format_parameters(n) for n in (8_030_000_000, 494_032_768, 54_496, 12)] == \
        ["8.0B", "494.03M", "54.50K", "12"]


def test_a_jobs_error_comes_after_the_text_before_it():
    job = Job(GenerationRequest("m"), [1], Options(), PebblingOptions(), 0.0, 0)
    for item in ("a", "b", ValueError("boom"), Job._END):
        job._put(item)
    assert job.drain() == ["a", "b"]
    with pytest.raises(ValueError, match="boom"):
        job.drain()
    assert job.finished and job.drain() == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=256)
    eng = Engine(root)
    yield eng
    eng.close()


def test_names_are_checked_then_resolved(engine):
    with pytest.raises(InvalidModelName):
        engine.submit(GenerationRequest("../tiny", prompt="x"))
    with pytest.raises(ModelNotFoundError, match="model 'absent' not found"):
        engine.submit(GenerationRequest("absent", prompt="x"))
    assert engine.resolve("tiny") == engine.resolve("tiny:latest")


def test_concurrent_submissions_queue_and_each_gets_its_own_answer(engine):
    greedy = {"temperature": 0, "num_predict": 5}
    prompts = [f"Hello {i}" for i in range(8)]
    alone = [engine.submit(GenerationRequest("tiny", prompt=p, options=greedy)).result()[0] for p in prompts]
    results: dict[int, str] = {}

    def ask(i):
        results[i] = engine.submit(GenerationRequest("tiny", prompt=prompts[i], options=greedy)).result()[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(8)] == alone


def test_final_counts_and_durations(engine):
    text, final = engine.submit(GenerationRequest("tiny", prompt="Hello", options={"temperature": 0, "num_predict": 3},
                                        keep_alive=-1)).result()
    assert isinstance(final, Final) and final.eval_count == 3 and final.done_reason == "length"
    assert final.total_duration >= final.prompt_eval_duration + final.eval_duration > 0
    assert len(final.context) == final.report["cached_tokens"] + final.prompt_eval_count + final.eval_count
    (running,) = engine.running()
    assert running.expires_at == FOREVER and running.active == 0


def test_a_models_overhead_is_measured_on_its_own_thread_before_a_request_plans(tmp_path, monkeypatch):
    """On the GPU each thread that multiplies holds a cuBLAS handle of its own while it lives: the model's
    thread computes every request, so its warm-up (what the overhead is measured after) runs there, and the
    load waits for it before the request's first plan."""
    from pyplugin.runtime import PebbledModel

    write_gguf(tmp_path / "tiny.gguf", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=256)
    calls: list[str] = []
    real_measure, real_plan = PebbledModel.measure_overhead, PebbledModel.plan

    def measure(self):
        calls.append(threading.current_thread().name)
        return real_measure(self)

    monkeypatch.setattr(PebbledModel, "measure_overhead", measure)
    monkeypatch.setattr(PebbledModel, "plan", lambda self, *a, **k: (calls.append("plan"), real_plan(self, *a, **k))[1])
    eng = Engine(tmp_path)
    try:
        text, final = eng.submit(GenerationRequest("tiny", prompt="Hello", options={"num_predict": 2})).result()
    finally:
        eng.close()
    assert final.eval_count == 2
    assert calls[:2] == ["pebbling-model-tiny", "plan"], calls
