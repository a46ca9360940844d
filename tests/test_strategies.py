"""Strategies end to end: plan, store and loop on a 16-layer model, on every backend present (CuPy
with the cuda backend where a GPU is).

Every strategy must give exactly the greedy tokens of `none`, stay within its budget, and cost what
its estimate says.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers import store_backend_params, tiny_model
from pyplugin.errors import OptionsError, StrategyError
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.layout import WEIGHT_IDS
from pyplugin.runtime.plan import MEASURED_MARGIN_BYTES, PebblingOptions, make_plan, peak_for, smallest_footprint
from pyplugin.store.abi import aligned, paged
from pyplugin.store.strategy import ADAPTIVE, resident_layers

N_LAYER = 16
PROMPT = [5, 17, 42, 8, 99, 3, 61, 7, 250, 12, 33]
OPTIONS = Options(temperature=0, num_predict=8, num_ctx=64, num_batch=4)  # several prefill chunks
STRATEGIES = ["none", "sqrt", "minimal", "every:3", "every:1", "adaptive"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", n_layer=N_LAYER)


@pytest.fixture(scope="module", params=store_backend_params())
def pebbled(request, model):
    pm = PebbledModel(model, backend=request.param)
    yield pm
    pm.close()


def run(model, pebbled, strategy: str, limit: int | None = None, options: Options = OPTIONS):
    pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, "pebbling_memory_limit": limit})
    gen = pebbled.generation(options, pebbling, len(PROMPT))
    tokens = list(gen.tokens(PROMPT))
    return tokens, gen.report(), gen.layers.plan


@pytest.fixture(scope="module")
def reference_tokens(model):
    """All layers resident, no store at all."""
    tokens = list(Generation(model, OPTIONS).tokens(PROMPT))
    assert len(tokens) == OPTIONS.num_predict  # the comparison below means something
    return tokens


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_the_tokens_of_full_residency(model, pebbled, reference_tokens, strategy):
    tokens, report, plan = run(model, pebbled, strategy)
    assert tokens == reference_tokens
    assert report["resident_layers"] == len(plan.resident)
    assert report["resident"] == list(plan.resident)  # which ones: what the web page's layer map draws


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_is_close_to_the_estimate(model, pebbled, strategy):
    """Byte-accounted on host and stub: within 2%. Measured by NVML on the GPU: within 5%."""
    _, report, _ = run(model, pebbled, strategy)
    estimate, measured = report["estimated_peak_bytes"], report["measured_peak_bytes"]
    on_gpu = pebbled.backend.measures_memory
    assert abs(measured - estimate) <= (0.05 if on_gpu else 0.02) * estimate, (measured, estimate)
    assert report["measured_peak_how"].startswith("measured" if on_gpu else "byte-accounted")


def test_minimal_below_sqrt_below_none(model, pebbled):
    reports = {s: run(model, pebbled, s)[1] for s in ("none", "sqrt", "minimal")}
    peaks = {s: r["measured_peak_bytes"] for s, r in reports.items()}
    if pebbled.backend.measures_memory:
        # NVML counts in pages of MiBs, coarser than this tiny model's layers: the order must hold
        # in the estimate and must not be reversed in the measurement (`benchmarks/memory.py streaming`
        # shows it strictly on a model of a size NVML resolves).
        estimates = {s: r["estimated_peak_bytes"] for s, r in reports.items()}
        assert estimates["minimal"] < estimates["sqrt"] < estimates["none"]
        assert peaks["minimal"] <= peaks["sqrt"] <= peaks["none"]
    else:
        assert peaks["minimal"] < peaks["sqrt"] < peaks["none"]


def test_the_report_gives_the_process_memory_beside_the_accounted_peak(model, pebbled):
    report = run(model, pebbled, "minimal")[1]
    rss, peak = report["process_rss_bytes"], report["process_peak_rss_bytes"]
    if rss is None:
        pytest.skip("this system's /proc does not give VmRSS")
    # the interpreter, numpy and the model alone hold more than this tiny model's accounted bytes
    assert 0 < rss <= peak and peak > report["measured_peak_bytes"]


def test_streaming_strategies_restore_and_full_residency_does_not(model, pebbled):
    assert run(model, pebbled, "none")[1]["bytes_restored"] == 0
    _, report, plan = run(model, pebbled, "minimal")
    weights = sum(plan.memory.layer_weight_bytes)
    if pebbled.backend.arrays_on_device:
        assert report["restores"] > 0
        assert report["bytes_restored_per_token"] >= 0.99 * weights  # every layer's weights, every token
    else:  # host memory: weights and KV caches computed from the host tier in place, nothing copied
        assert report["restores"] == 0 and report["bytes_restored"] == 0


@pytest.mark.parametrize("fraction", [0.35, 0.6, 0.85])
def test_adaptive_fits_any_budget_above_the_smallest_footprint(model, pebbled, reference_tokens, fraction):
    memory = pebbled.memory_model(OPTIONS, len(PROMPT))
    floor, full = smallest_footprint(memory), make_plan(memory, "none").estimated_peak_bytes
    budget = int(floor + fraction * (full - floor))
    tokens, report, plan = run(model, pebbled, "adaptive", budget)
    assert tokens == reference_tokens
    assert report["measured_peak_bytes"] <= budget, (report["measured_peak_how"], report["estimated_peak_bytes"],
                                                     plan.memory.overhead_bytes)
    assert 0 < len(plan.resident) < N_LAYER
    # one more resident layer would not have fitted
    one_more = resident_layers(ADAPTIVE, len(plan.resident) + 1, N_LAYER)
    assert peak_for(memory, one_more)[0] > budget


def test_where_memory_is_measured_plans_keep_two_pages_over_the_bytes(model, pebbled):
    """NVML counts a process's GPU memory in whole 2 MiB pages, each allocation's rounded up apart: every
    estimate and the floor keep two pages over the bytes there (so a budget adaptive fits is one the
    measured peak keeps), and nothing where bytes are accounted."""
    memory = pebbled.memory_model(OPTIONS, len(PROMPT))
    assert memory.margin_bytes == (MEASURED_MARGIN_BYTES if pebbled.backend.measures_memory else 0)
    bare, wide = replace(memory, margin_bytes=0), replace(memory, margin_bytes=MEASURED_MARGIN_BYTES)
    for strategy in ("none", "sqrt", "minimal"):
        assert (make_plan(wide, strategy).estimated_peak_bytes
                == make_plan(bare, strategy).estimated_peak_bytes + MEASURED_MARGIN_BYTES)
    assert smallest_footprint(wide) == smallest_footprint(bare) + MEASURED_MARGIN_BYTES


def test_where_the_device_holds_pages_the_plan_counts_each_entry_and_slot_in_them(pebbled, monkeypatch):
    """cuda's device tier counts a copy of half a page or more in whole pages, as the driver backs it (pebble.h,
    PEBBLE_DEVICE_PAGE_BYTES): the plan counts each weight and K/V entry of the tier so, and each slot (one
    buffer) so; the bytes a token restores stay bytes. A page of 6 KiB makes this tiny model's entries (4 to 32
    KiB, powers of two) cross it."""
    page = 6144
    monkeypatch.setattr(pebbled.backend, "device_page_bytes", 0)
    flat = pebbled.memory_model(OPTIONS, len(PROMPT))
    monkeypatch.setattr(pebbled.backend, "device_page_bytes", page)
    paged_memory = pebbled.memory_model(OPTIONS, len(PROMPT))
    assert not any(flat.weight_page_bytes) and not any(flat.kv_page_bytes)
    for i, layout in enumerate(pebbled.layouts):
        assert paged_memory.weight_page_bytes[i] == sum(max(0, paged(t.nbytes, page) - aligned(t.nbytes)) for t in layout)
    rows = [paged_memory.kv_rows(i, OPTIONS.num_ctx) * paged_memory.kv_bytes_per_token // 2 for i in range(N_LAYER)]
    assert paged_memory.kv_page_bytes == tuple(2 * max(0, paged(n, page) - aligned(n)) for n in rows)
    pages = sum(paged_memory.weight_page_bytes) + sum(paged_memory.kv_page_bytes)
    assert pages > 0
    none_flat, none_paged = make_plan(flat, "none"), make_plan(paged_memory, "none")
    assert none_paged.store_limit - none_flat.store_limit == pages
    assert none_paged.estimated_peak_bytes - none_flat.estimated_peak_bytes == pages
    low_flat, low_paged = make_plan(flat, "minimal"), make_plan(paged_memory, "minimal")
    assert low_paged.slot_bytes == low_flat.slot_bytes and low_flat.n_slots == 2
    assert (low_paged.estimated_peak_bytes - low_flat.estimated_peak_bytes
            == 2 * (paged(low_flat.slot_bytes, page) - low_flat.slot_bytes) > 0)
    assert low_paged.restored_bytes_per_token(40) == low_flat.restored_bytes_per_token(40)


def test_adaptive_interleaves_streamed_layers_between_resident_ones(model, pebbled):
    memory = pebbled.memory_model(OPTIONS, len(PROMPT))
    floor, full = smallest_footprint(memory), make_plan(memory, "none").estimated_peak_bytes
    plan = make_plan(memory, "adaptive", int(floor + 0.8 * (full - floor)))
    streamed = plan.streamed
    assert streamed and len(plan.resident) >= N_LAYER // 2
    assert all(b - a > 1 for a, b in zip(streamed, streamed[1:])), streamed


def test_plan_and_native_answer_agree(model, pebbled):
    for strategy in STRATEGIES:
        _, _, plan = run(model, pebbled, strategy)
        answers = [pebbled.store.should_checkpoint(i) for i in range(N_LAYER)]
        assert answers == [i in plan.resident for i in range(N_LAYER)], strategy


def test_changing_strategy_reuses_the_saved_weights(model, pebbled, reference_tokens, monkeypatch):
    run(model, pebbled, "minimal")
    saved = []  # every save the store takes from here on, the strategy change included
    real_save = pebbled.store.save
    monkeypatch.setattr(pebbled.store, "save", lambda layer, tensor_id, *a, **k: (
        saved.append((layer, tensor_id)), real_save(layer, tensor_id, *a, **k))[1])
    tokens, _, plan = run(model, pebbled, "sqrt")
    assert tokens == reference_tokens and plan.resident  # the change made layers resident
    assert [key for key in saved if key[1] in WEIGHT_IDS.values()] == []  # no weight was saved again


def test_a_new_context_size_rebuilds_only_the_kv_entries(model, pebbled):
    options = Options(temperature=0, num_predict=3, num_ctx=32, num_batch=8)
    tokens, report, _ = run(model, pebbled, "sqrt", options=options)
    assert len(tokens) == 3 and report["estimated_peak_bytes"] < run(model, pebbled, "sqrt")[1][
        "estimated_peak_bytes"]


def test_budget_below_the_smallest_footprint_names_that_footprint(model, pebbled):
    floor = smallest_footprint(pebbled.memory_model(OPTIONS, len(PROMPT)))
    with pytest.raises(OptionsError, match=f"{floor} bytes"):
        run(model, pebbled, "adaptive", floor - 1)


def test_a_fixed_strategy_over_budget_says_what_would_fit(model, pebbled):
    floor = smallest_footprint(pebbled.memory_model(OPTIONS, len(PROMPT)))
    with pytest.raises(OptionsError, match="needs about .* more than the limit"):
        run(model, pebbled, "none", floor + 1)


@pytest.mark.parametrize("options,error,message", [
    ({"pebbling_strategy": "fastest"}, StrategyError, "valid: none, sqrt, adaptive, minimal, every:N"),
    ({"pebbling_strategy": "every:0"}, StrategyError, "N >= 1"),
    ({"pebbling_strategy": 3}, StrategyError, "must be a string"),
    ({"pebbling_memory_limit": -5}, OptionsError, "must not be negative"),
    ({"pebbling_memory_limit": "lots"}, OptionsError, "6GiB"),
    ({"pebbling_memory_limit": "5 parsecs"}, OptionsError, "unknown unit"),
    ({"pebbling_enabled": "yes"}, OptionsError, "true or false"),
])
def test_bad_pebbling_options_say_what_is_accepted(options, error, message):
    with pytest.raises(error, match=message):
        PebblingOptions.from_options(options)


def test_disabled_pebbling_keeps_every_layer_resident(model, pebbled, reference_tokens):
    pebbling = PebblingOptions.from_options({"pebbling_enabled": False, "pebbling_strategy": "minimal"})
    gen = pebbled.generation(OPTIONS, pebbling)
    assert list(gen.tokens(PROMPT)) == reference_tokens
    report = gen.report()
    assert report["enabled"] is False and report["resident_layers"] == N_LAYER


def test_a_store_can_take_over_the_host_weights(reference_tokens):
    from helpers import tiny_path
    from pyplugin.errors import ModelError
    from pyplugin.model import load_model

    model = load_model(tiny_path("llama", n_layer=N_LAYER), progress=False)  # a copy of its own
    pebbled = PebbledModel(model, backend="stub", keep_host_weights=False)
    try:
        assert model.layers == []  # held once, by the store
        with pytest.raises(ModelError, match="handed over to a pebble store"):
            model.resident_layers(pebbled.kernels)
        assert run(model, pebbled, "sqrt")[0] == reference_tokens
    finally:
        pebbled.close()


def test_adaptive_budget_leaves_out_what_the_other_loaded_models_hold():
    from pyplugin.store.gpu import DeviceUse
    from pyplugin.runtime.plan import adaptive_budget

    assert adaptive_budget(None, DeviceUse(5, True), 0) is None          # NVML cannot say
    assert adaptive_budget(1000, DeviceUse(400, True), 0, reserve=0) == 1400
    assert adaptive_budget(1000, DeviceUse(400, True), 300, reserve=0) == 1100
    assert adaptive_budget(1000, DeviceUse(400, True), 900, reserve=0) == 1000  # never less than what is free
    assert adaptive_budget(1000, DeviceUse(400, False), 0, reserve=0) == 1000   # whole device: not this process's
    assert adaptive_budget(1000, DeviceUse(0, True), 0) == 950                   # the default 5% reserve


def test_a_model_says_what_it_holds_on_the_device_between_requests(model):
    pm = PebbledModel(model, backend="stub")
    try:
        assert pm.device_bytes_held() == 0                    # saved to the host tier only
        run(model, pm, "none")
        held = pm.device_bytes_held()
        assert held == pm.store.stats().device_bytes > 0      # every layer resident, and its KV cache
        run(model, pm, "minimal")
        assert pm.device_bytes_held() < held
    finally:
        pm.close()
    assert pm.device_bytes_held() == 0
