"""Decoding a batch: sequences at different positions, each with its own KV entries, share one pass over
the layers, and each produces exactly the tokens it produces alone, while a streamed layer is restored
once per step for all of them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import store_backend_params, tiny_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.batch import decode_batch, prefill_batch, prefills_together
from pyplugin.runtime.generation import Generation
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.runtime.store_layers import StoreLayers
from pyplugin.serving import Engine, GenerationRequest

PROMPTS = ([5, 17, 42, 8], [99, 3], [61, 7, 250, 12, 33, 71, 4], [150], [9, 28, 77],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40], [300, 301])


def alone(model, backend, options, pebbling, prompt):
    pebbled = PebbledModel(model, backend=backend)
    gen = pebbled.generation(options, pebbling, len(prompt))
    return list(gen.tokens(prompt)), gen.report()


def together(model, backend, options, pebbling, prompts):
    """Every prompt prefilled, then decoded in steps over all the sequences still going."""
    pebbled = PebbledModel(model, backend=backend)
    source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=len(prompts)), options, pebbling)
    gens = [Generation(model, options, layers=source.sequence(s)) for s in range(len(prompts))]
    out = [[] for _ in prompts]
    for gen, prompt in zip(gens, prompts):
        gen.start(prompt)
    going = list(range(len(prompts)))
    while going:
        forward = []
        for b in going:
            token = gens[b].next_token()
            if token is not None:
                out[b].append(token)
                if gens[b].wants_forward():
                    forward.append((b, token))
        if forward:
            for (b, _), logits in zip(forward, decode_batch(source, [gens[b] for b, _ in forward],
                                                            [t for _, t in forward])):
                gens[b].logits = logits
        going = [b for b, _ in forward]
    return out, [source.report(g.stats, s) for s, g in enumerate(gens)]


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("weights", ["quantized", "f16"])
@pytest.mark.parametrize("strategy", ["minimal", "every:2", "none"])
def test_a_batch_of_eight_decodes_what_each_decodes_alone(backend, weights, strategy):
    model = tiny_model("qwen2", weights=weights, n_layer=3)
    options = Options(temperature=0, num_predict=10, num_ctx=96)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
    expected = [alone(model, backend, options, pebbling, p)[0] for p in PROMPTS]
    got, reports = together(model, backend, options, pebbling, PROMPTS)
    assert got == expected
    assert all(len(tokens) == 10 for tokens in got)  # every sequence decoded in every step
    assert {r["batch"]["largest"] for r in reports} == {8}


@pytest.mark.parametrize("backend", store_backend_params())
def test_sequences_that_shift_their_context_in_a_batch_decode_what_each_decodes_alone(backend):
    """Each sequence of a batch shifts its own KV entries when its context fills, at its own step (prompts
    of 1 to 11 tokens in a context of 24), and goes on decoding with the others."""
    model = tiny_model("qwen2", n_layer=3)
    options = Options(temperature=0, num_predict=40, num_ctx=24)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "every:2"})
    prompts = PROMPTS[3:7]
    expected = [alone(model, backend, options, pebbling, p) for p in prompts]
    got, reports = together(model, backend, options, pebbling, prompts)
    assert got == [tokens for tokens, _ in expected]
    shifts = [r["context_shifts"] for r in reports]
    assert shifts == [r["context_shifts"] for _, r in expected] and min(shifts) >= 2
    assert {r["batch"]["largest"] for r in reports} == {len(prompts)}


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("weights,cached", [("quantized", 0), ("quantized", 3), ("f16", 0)])
def test_prompts_prefilled_together_give_exactly_what_each_prefill_gives_alone(backend, weights, cached):
    """prefill_batch (the prompts of requests joining a batch, in one pass) where prefills_together says
    each row is computed as alone: the host's kernels on stored blocks. Elsewhere (the stub's and a
    GPU's GEMMs, the f16 form's dense products) each request prefills on its own."""
    model = tiny_model("qwen2", weights=weights, n_layer=3, weight_type="Q8_0")
    options = Options(temperature=0, num_predict=4, num_ctx=64)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [p for p in PROMPTS if len(p) > cached][:5]
    pebbled = PebbledModel(model, backend=backend)
    source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=len(prompts)), options, pebbling)
    gens = [Generation(model, options, layers=source.sequence(s)) for s in range(len(prompts))]
    if cached:  # a conversation going on: its first tokens are in the cache already
        for g, p in zip(gens, prompts):
            g.start(p[:cached])
    chunks = [g.begin(p, cached) for g, p in zip(gens, prompts)]
    if not prefills_together(source, gens):
        # Each request prefills on its own there, which the engine's tests cover: only kernels that do not
        # tile, or the f16 form's dense products, may refuse (not a skip: on a GPU that would hide the case)
        assert not pebbled.kernels.tiled_matmul or weights == "f16", (backend, weights)
        assert (backend, weights) != ("host", "quantized")
        return
    got = prefill_batch(source, gens, chunks)
    for g, p, row in zip(gens, prompts, got):
        solo = PebbledModel(model, backend=backend).generation(options, pebbling, len(p))
        if cached:
            solo.start(p[:cached])
        expected = solo.prefill(p[cached:])
        np.testing.assert_array_equal(row, expected)
        assert g.pos == len(p)
        g.logits, solo.logits = row, expected
        assert g.next_token() == solo.next_token()


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_block_kv_caches_batch_as_they_run_alone(backend, kv_type):
    """8-bit and 4-bit caches (a head of whole blocks): each sequence of a batch gets its tokens alone."""
    model = tiny_model("llama", weights="quantized", n_layer=3, n_embd=128, n_head=4, n_head_kv=2)
    options = Options(temperature=0, num_predict=6, num_ctx=64, kv_type=kv_type)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "every:2"})
    expected = [alone(model, backend, options, pebbling, p)[0] for p in PROMPTS]
    got, reports = together(model, backend, options, pebbling, PROMPTS)
    assert got == expected and all(len(tokens) == 6 for tokens in got)
    assert {r["kv_type"] for r in reports} == {kv_type}


@pytest.mark.parametrize("case", ["qwen3", "gemma3", "gemma2", "granite-scales"])
def test_every_architecture_decodes_in_a_batch_what_it_decodes_alone(case):
    """Q/K norms, the Gemmas' norms and GELU, a window's ring crossed on the way, capped scores and logits,
    Granite's scales: each sequence of a batched step (one native call) gets its tokens alone."""
    from test_architectures import path_of
    from pyplugin.model import load_model
    model = load_model(path_of(case), weights="quantized", progress=False)
    options = Options(temperature=0, num_predict=9, num_ctx=64)  # gemma3's window (5) is crossed
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [p[:6] for p in PROMPTS[:4]]
    expected = [alone(model, "host", options, pebbling, p)[0] for p in prompts]
    got, _ = together(model, "host", options, pebbling, prompts)
    assert got == expected and all(len(tokens) == 9 for tokens in got)


@pytest.mark.parametrize("backend", store_backend_params())
def test_a_streamed_layer_is_restored_once_per_step_for_the_whole_batch(backend, monkeypatch):
    # Host memory computes a streamed layer's weights from the host tier in place, copying nothing; the
    # copy into working slots, which a GPU makes and a batch shares, is run here as the GPU runs it.
    from pyplugin.store import backend_named
    monkeypatch.setattr(type(backend_named(backend)), "arrays_on_device", True)
    model = tiny_model("llama", weights="quantized", n_layer=3)
    options = Options(temperature=0, num_predict=8, num_ctx=64)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [[7, 8, 9]] * 8
    _, single = alone(model, backend, options, pebbling, prompts[0])
    _, batched = together(model, backend, options, pebbling, prompts)
    weights = sum(t.nbytes for layout in PebbledModel(model, backend=backend).layouts for t in layout)
    # Alone a token restores every layer's weights and its KV rows; in a batch of 8 each sequence pays an
    # eighth of the weights and still its own KV rows.
    assert single["bytes_restored_per_token"] >= weights
    for report in batched:
        assert report["bytes_restored_per_token"] <= weights / 8 + single["bytes_restored_per_token"] - weights
        assert report["bytes_restored_per_token"] * 6 < single["bytes_restored_per_token"]
        assert report["batch"] == {"n_parallel": 8, "largest": 8, "mean": 8.0}
    assert sum(r["bytes_restored"] for r in batched) < 2 * single["bytes_restored"]


def test_the_plan_of_a_batch_holds_every_sequences_kv_within_the_limit():
    model = tiny_model("llama", weights="quantized", n_layer=4)
    pebbled = PebbledModel(model, backend="stub")
    options = Options(num_ctx=128)
    none = PebblingOptions.from_options({"pebbling_strategy": "none"})
    one, four = (pebbled.plan(options, none, n_seqs=n) for n in (1, 4))
    kv = sum(one.memory.kv_bytes(i) for i in range(model.config.n_layer))
    assert four.store_limit - one.store_limit == 3 * kv
    assert four.estimated_peak_bytes >= one.estimated_peak_bytes + 3 * kv
    # adaptive fits weights and the batch's KV together: a budget that holds every layer for one sequence
    # holds fewer for four.
    budget = one.estimated_peak_bytes
    adaptive = PebblingOptions.from_options({"pebbling_strategy": "adaptive", "pebbling_memory_limit": budget})
    assert len(pebbled.plan(options, adaptive, n_seqs=1).resident) == model.config.n_layer
    batch = pebbled.plan(options, adaptive, n_seqs=4)
    assert len(batch.resident) < model.config.n_layer and batch.estimated_peak_bytes <= budget


# ---------------------------------------------------------------------------------------------------
# the engine: requests of one model decode together


def _requests(prompts, strategies, stops):
    return [GenerationRequest("tiny", prompt=p, raw=True, options={
        "temperature": 0, "num_predict": 6 + 3 * (n % 4), "pebbling_cache_prompt": False, "stop": stops[n],
        **({"pebbling_strategy": strategies[n]} if strategies[n] else {})}) for n, p in enumerate(prompts)]


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("mixed", [False, True], ids=["one-strategy", "mixed-strategies"])
def test_eight_requests_at_once_answer_what_each_answers_alone(tmp_path, backend, mixed, slow_tokens):
    write_gguf(tmp_path / "tiny.gguf", arch="llama", n_layer=3, n_embd=32, n_head=2, n_head_kv=1, n_ff=64,
               n_ctx=256)
    prompts = ["Hello", "Why is the sky blue?", "a", "The quick brown fox jumps", "12 and 345", "Café au lait",
               "one two three four five six seven", "?"]
    strategies = ["minimal", "every:2", None, "minimal", "none", "sqrt", "minimal", "every:2"] if mixed \
        else ["minimal"] * 8
    engine = Engine(tmp_path, backend=backend, num_parallel=8)
    try:
        texts = [j.result()[0] for j in map(engine.submit, _requests(prompts, strategies, [[]] * 8))]
        # Stop strings that cut some answers short: a piece from the middle of their text.
        stops = [[t[len(t) // 2:len(t) // 2 + 2]] if n % 3 == 0 and len(t) > 3 else [] for n, t in enumerate(texts)]
        requests_ = _requests(prompts, strategies, stops)
        alone = [engine.submit(r).result() for r in requests_]
        jobs = [engine.submit(r) for r in _requests(prompts, strategies, stops)]
        together = [job.result() for job in jobs]
    finally:
        engine.close()
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert [f.context for _, f in together] == [f.context for _, f in alone]
    assert [f.done_reason for _, f in together] == [f.done_reason for _, f in alone]
    assert any(stops) and any(len(t) < len(full) for (t, _), full in zip(alone, texts))  # a stop did cut
    largest = max(f.report["batch"]["largest"] for _, f in together)
    assert largest >= (6 if not mixed else 2)
    assert all(f.report["batch"]["n_parallel"] == 8 for _, f in together)


@pytest.fixture
def models_dir(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", arch="llama", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64,
               n_ctx=256)
    return tmp_path


def _ask(engine, prompt, strategy="minimal", n=8, **options):
    return engine.submit(GenerationRequest("tiny", prompt=prompt, raw=True, options={
        "temperature": 0, "num_predict": n, "pebbling_strategy": strategy, **options}))


def test_a_request_cancelled_in_a_batch_leaves_it_and_the_others_go_on(models_dir, slow_tokens):
    engine = Engine(models_dir, backend="host", num_parallel=4)
    try:
        alone = [_ask(engine, p, n=12).result() for p in ("one", "two", "three")]
        jobs = [_ask(engine, p, n=12) for p in ("one", "two", "three")]
        time.sleep(0.06)  # a few steps in
        jobs[1].cancel()
        results = [job.result() for job in jobs]
    finally:
        engine.close()
    assert results[1][1].done_reason == "cancelled" and results[1][1].eval_count < 12
    for n in (0, 2):
        assert results[n][0] == alone[n][0] and results[n][1].eval_count == 12
        assert results[n][1].report["batch"]["largest"] == 3  # it decoded beside the cancelled one
    assert engine.counts["cancelled"] == 1


def test_groups_take_turns_so_a_request_of_another_plan_does_not_starve(models_dir, slow_tokens):
    engine, ended = Engine(models_dir, backend="host", num_parallel=4), []
    engine.on_final(lambda final: ended.append(final.context[-9:]))
    try:
        first = _ask(engine, "first", n=10)
        time.sleep(0.03)  # running
        other = _ask(engine, "other plan", strategy="none", n=3)
        later = [_ask(engine, f"later {n}", n=3) for n in range(3)]  # minimal, like the running one
        finals = [job.result()[1] for job in [first, other] + later]
    finally:
        engine.close()
    # The later requests of the running group did not join it while `other` waited: `other` ran next.
    order = [next(i for i, tail in enumerate(ended) if tail == f.context[-9:]) for f in finals]
    assert order[0] < order[1] < min(order[2:])
    assert finals[0].report["batch"]["largest"] == 1
    assert [f.report["batch"]["largest"] for f in finals[2:]] == [3, 3, 3]  # then together


def test_a_conversation_keeps_its_cache_while_another_request_runs_between_its_turns(models_dir):
    engine, fresh = Engine(models_dir, backend="host", num_parallel=2), Engine(models_dir, backend="host")
    try:
        first = _ask(engine, "Once upon a time", n=6)
        _, f1 = first.result()
        _ask(engine, "something else entirely", n=6).result()  # takes the other sequence
        follow = GenerationRequest("tiny", prompt=" there was", raw=True, context=f1.context,
                                   options={"temperature": 0, "num_predict": 6, "pebbling_strategy": "minimal"})
        text, f2 = engine.submit(follow).result()
        alone_text, alone = fresh.submit(follow).result()
    finally:
        engine.close()
        fresh.close()
    assert f2.report["cached_tokens"] == len(f1.context) - 1
    assert f2.prompt_eval_count < alone.prompt_eval_count
    assert text == alone_text and f2.context == alone.context


def test_num_parallel_reads_pebblings_variable_then_ollamas(monkeypatch):
    from pyplugin.errors import PebblingError
    from pyplugin.serving.settings import DEFAULT_NUM_PARALLEL, parallel_limit

    monkeypatch.delenv("PEBBLING_NUM_PARALLEL", raising=False)
    monkeypatch.delenv("OLLAMA_NUM_PARALLEL", raising=False)
    assert parallel_limit() == DEFAULT_NUM_PARALLEL == 4
    monkeypatch.setenv("OLLAMA_NUM_PARALLEL", "0")  # Ollama's "choose for me"
    assert parallel_limit() == 4
    monkeypatch.setenv("OLLAMA_NUM_PARALLEL", "2")
    assert parallel_limit() == 2
    monkeypatch.setenv("PEBBLING_NUM_PARALLEL", "6")
    assert parallel_limit() == 6
    monkeypatch.setenv("PEBBLING_NUM_PARALLEL", "many")
    with pytest.raises(PebblingError, match="PEBBLING_NUM_PARALLEL"):
        parallel_limit()
