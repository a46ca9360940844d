"""Experts as pebbles in the plan and the decode step (runtime.experts): the budget holds each layer's dense
part by the strategy and a cache of experts in the rest (a smaller budget caches fewer, never an error above
the smallest budget), and the accounted device bytes stay within it; speculative prefetch and the
least-often-used policy change what is restored, never the tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import store_backend_params
from test_moe import path_of, prompt, run_steps
from pyplugin.errors import OptionsError
from pyplugin.model import load_model
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions, make_plan, smallest_footprint

BACKENDS = store_backend_params(("host", "stub"))
OPTIONS = Options(temperature=0, num_predict=7, num_ctx=48, num_batch=4)


def moe_model():
    return load_model(path_of("qwen3moe", weight_type="Q8_0", n_layer=4), weights="quantized", progress=False)


def generate(pebbled, tokens, **options):
    gen = pebbled.generation(OPTIONS, PebblingOptions.from_options(options), len(tokens))
    return list(gen.tokens(tokens)), gen.report()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_budget_holds_the_dense_part_and_caches_experts_in_the_rest(backend):
    """Under each budget from the smallest up, the plan caches as many experts per layer as the rest of the
    budget holds (at most what was asked), the tokens are those of the experts kept in their layers, and the
    byte-accounted peak (store device tier, slots, the decoder's expert slots ...) stays within the budget."""
    model = moe_model()
    cfg, tokens = model.config, prompt(7)
    pebbled = PebbledModel(model, backend=backend)
    try:
        expected, _ = generate(pebbled, tokens, pebbling_strategy="none")
        memory = pebbled.memory_model(OPTIONS, len(tokens), 1, PebblingOptions(expert_cache=cfg.n_expert))
        e, floor = memory.experts, smallest_footprint(memory)
        assert floor == make_plan(memory, "minimal").estimated_peak_bytes
        assert e.device_bytes(0) == e.slot_bytes  # the smallest budget: minimal's dense part and one expert slot
        dense_resident = make_plan(memory, "none", None).estimated_peak_bytes - e.device_bytes(cfg.n_expert)
        seen = []
        for strategy, budget, want in [
            ("minimal", floor, 0),
            ("adaptive", floor, 0),
            ("none", dense_resident + e.device_bytes(0), 0),
            ("none", dense_resident + e.device_bytes(1) + e.slot_bytes - 1, 1),
            ("none", dense_resident + e.device_bytes(3), 3),
            ("sqrt", dense_resident + e.device_bytes(3), None),  # 2 resident and 2 slots: room for as many or more
            ("adaptive", dense_resident + e.device_bytes(5), 5),
            ("adaptive", 10 * dense_resident, cfg.n_expert),
        ]:
            got, report = generate(pebbled, tokens, pebbling_strategy=strategy, pebbling_memory_limit=budget,
                                   pebbling_expert_cache=cfg.n_expert)
            assert got == expected, (strategy, budget)
            cached = report["experts"]["cache_per_layer"]
            assert want is None and cached >= 3 or cached == want, (strategy, budget, cached)
            assert report["estimated_peak_bytes"] <= budget
            assert report["measured_peak_bytes"] <= budget, report["measured_peak_how"]
            assert report["experts"]["cache_bytes"] == e.device_bytes(cached)
            seen.append(cached)
        assert seen[-1] == cfg.n_expert and report["resident_layers"] == cfg.n_layer
        got, report = generate(pebbled, tokens, pebbling_strategy="none", pebbling_memory_limit=dense_resident
                               + e.device_bytes(2), pebbling_expert_cache=1)  # room for 2, asked for 1
        assert report["experts"]["cache_per_layer"] == 1 and got == expected
        with pytest.raises(OptionsError, match="smallest footprint"):
            pebbled.plan(OPTIONS, PebblingOptions.from_options({"pebbling_memory_limit": floor - 1,
                                                                "pebbling_expert_cache": 4}), len(tokens))
        with pytest.raises(OptionsError, match="strategy none needs"):  # the dense part's rule is kept
            pebbled.plan(OPTIONS, PebblingOptions.from_options({"pebbling_strategy": "none", "pebbling_expert_cache": 4,
                                                                "pebbling_memory_limit": dense_resident - 1}),
                         len(tokens))
    finally:
        pebbled.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", ["none", "minimal"])
def test_prefetch_gives_the_tokens_of_none_at_every_cache_size(backend, strategy):
    """Speculative prefetch (each layer's router on the hidden state entering it names experts restored
    early) costs bandwidth where it guesses wrong, never a token: at every cache size the tokens are those of
    the experts kept in their layers, and the report gives the guesses and their accuracy."""
    model = moe_model()
    cfg, tokens = model.config, prompt(7)
    pebbled = PebbledModel(model, backend=backend)
    try:
        expected, _ = generate(pebbled, tokens, pebbling_strategy="none")
        decoded = len(expected) - 1
        for cache in (0, 1, 2, cfg.n_expert):
            for prefetch in (False, True):
                got, report = generate(pebbled, tokens, pebbling_strategy=strategy, pebbling_expert_cache=cache,
                                       pebbling_expert_prefetch=prefetch)
                e = report["experts"]
                assert got == expected, (cache, prefetch)
                uses = decoded * cfg.n_layer * cfg.n_expert_used
                assert e["hits"] + e["misses"] == uses and e["prefetch"] is prefetch
                if not prefetch:
                    assert e["prefetch_guesses"] == e["prefetched"] == 0 and e["prefetch_accuracy"] is None
                    continue
                assert e["prefetch_guesses"] == uses  # a layer guesses as many as a token runs
                assert 0 <= e["prefetch_right"] <= e["prefetch_guesses"]
                assert 0.0 <= e["prefetch_accuracy"] <= 1.0
                assert e["prefetch_accuracy"] == round(e["prefetch_right"] / e["prefetch_guesses"], 4)
                assert 0 <= e["prefetched_used"] <= e["prefetched"] <= e["prefetch_guesses"]
                # what was restored: the misses at use and every prefetch
                assert e["bytes_restored_per_token"] * decoded == pytest.approx(
                    (e["misses"] + e["prefetched"]) * e["expert_bytes"], rel=0.01)
                # a prefetched expert the layer ran is a hit; a cache hits besides
                assert e["hits"] >= e["prefetched_used"]
                held = 0 if strategy == "minimal" else cache
                slot = -(-e["expert_bytes"] // 256) * 256
                assert e["cache_bytes"] == slot * (cfg.n_layer * held + cfg.n_expert_used)
    finally:
        pebbled.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_with_prefetch_decodes_what_each_sequence_decodes_alone(backend):
    """Guesses for a batch are the experts of the highest probability summed over its tokens; whatever they
    are, each sequence gets its tokens alone."""
    from test_batching import PROMPTS, alone, together
    model = moe_model()
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "none", "pebbling_expert_cache": 2,
                                             "pebbling_expert_prefetch": True})
    prompts = [p[:6] for p in PROMPTS[:4]]
    expected = [alone(model, backend, OPTIONS, pebbling, p)[0] for p in prompts]
    got, reports = together(model, backend, OPTIONS, pebbling, prompts)
    assert got == expected
    assert all(0.0 <= r["experts"]["prefetch_accuracy"] <= 1.0 for r in reports)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_least_often_used_policy_changes_what_is_restored_not_the_tokens(backend):
    """At the decoder: with the frequency-based victim the logits are those of the merged experts, every
    use is a hit or a miss, and a cache as large as the layer's experts restores each expert once at most."""
    from pyplugin.store import backend_named
    from test_moe import expert_store, FIRST_EXPERT
    be = backend_named(backend)
    model = load_model(path_of("qwen2moe", weight_type="Q8_0"), weights="quantized", progress=False)
    cfg = model.config
    merged, _ = run_steps(be.kernels, model, 16, 8, 3)
    store = expert_store(be, model)
    try:
        counts = {}
        for policy in ("lru", "lfu"):
            for cache in (1, 2, cfg.n_expert):
                experts = {i: (FIRST_EXPERT, cache) for i in range(cfg.n_layer)}
                logits, stats = run_steps(be.kernels, model, 16, 8, 3, store=store, experts=experts,
                                          expert_store=store, expert_policy=policy)
                np.testing.assert_array_equal(logits, merged)
                counts[policy, cache] = (stats["expert_hits"], stats["expert_misses"])
                if cache == cfg.n_expert:
                    assert stats["expert_misses"] <= cfg.n_layer * cfg.n_expert
        uses = {sum(c) for c in counts.values()}
        assert len(uses) == 1  # the same experts run, whatever the policy
        assert counts["lru", cfg.n_expert] == counts["lfu", cfg.n_expert]  # nothing evicted: no choice made
    finally:
        store.close()


def test_the_expert_options_are_checked():
    options = PebblingOptions.from_options({"pebbling_expert_cache": 8, "pebbling_expert_prefetch": True,
                                            "pebbling_expert_policy": "lfu"})
    assert (options.expert_cache, options.expert_prefetch, options.expert_policy) == (8, True, "lfu")
    for bad in ({"pebbling_expert_cache": 2, "pebbling_expert_prefetch": "yes"},
                {"pebbling_expert_cache": 2, "pebbling_expert_policy": "fifo"},
                {"pebbling_expert_prefetch": True}):  # without experts as pebbles
        with pytest.raises(OptionsError, match="pebbling_expert_"):
            PebblingOptions.from_options(bad)


def test_estimate_plans_experts_as_pebbles(capsys):
    """--expert-cache: each strategy's dense part by its rule and as many experts per layer as the limit
    leaves room for; restored/token counts the routed experts the cache misses (uniform routing), on a
    backend that restores no layer too."""
    import json

    from pyplugin.cli import main
    path = str(path_of("qwen3moe", weight_type="Q8_0", n_layer=4))
    flags = ["--num-ctx", "64", "--num-batch", "8", "--backend", "stub", "--json"]
    assert main(["estimate", path, *flags]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["experts_as_pebbles"] is False
    assert {s["experts_cached_per_layer"] for s in plain["strategies"].values()} == {None}
    assert main(["estimate", path, *flags, "--expert-cache", "8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["experts_as_pebbles"] is True and r["strategies"]["none"]["experts_cached_per_layer"] == 8
    assert r["strategies"]["minimal"]["experts_cached_per_layer"] == 0
    assert {s["restored_bytes_per_token_estimate"] for s in plain["strategies"].values()} == {0}  # stub: in place
    routed, n_expert = r["experts"]["routed_bytes_per_token"], r["experts"]["n_expert"]
    assert r["strategies"]["minimal"]["restored_bytes_per_token_estimate"] == routed  # no cache: every one
    assert r["strategies"]["none"]["restored_bytes_per_token_estimate"] == round(routed * (1 - 8 / n_expert))
    caches = {c["cache_per_layer"]: c for c in r["experts"]["caches"]}
    limit = caches[1]["budget_none"]
    assert main(["estimate", path, *flags, "--expert-cache", "8", "--memory-limit", str(limit)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["strategies"]["none"]["experts_cached_per_layer"] == 1 and r["strategies"]["none"]["fits"]
    assert r["strategies"]["none"]["estimated_peak_bytes"] < plain["strategies"]["none"]["estimated_peak_bytes"]
    assert r["smallest_footprint_bytes"] == r["experts"]["smallest_budget_bytes"]


@pytest.mark.skipif(len([p for p in BACKENDS if not p.marks]) < 2, reason="needs the host library and the stub")
@pytest.mark.parametrize("case", ["qwen2moe", "mixtral"])
def test_the_stub_and_the_host_library_decide_the_same(case):
    """ExpertSlots (the stub) and native/cuda/experts.cu (the host library) make the same choices: the same hits,
    misses, guesses, prefetches and bytes, under each policy, with and without prefetch."""
    from pyplugin.store import backend_named
    from test_moe import expert_store, FIRST_EXPERT
    model = load_model(path_of(case, weight_type="Q8_0"), weights="quantized", progress=False)
    seen = {}
    for name in ("host", "stub"):
        be = backend_named(name)
        store = expert_store(be, model)
        try:
            for policy in ("lru", "lfu"):
                for prefetch in (False, True):
                    _, stats = run_steps(be.kernels, model, 16, 8, 3, store=store, expert_store=store,
                                         experts={i: (FIRST_EXPERT, 2) for i in range(model.config.n_layer)},
                                         expert_policy=policy, expert_prefetch=prefetch)
                    seen.setdefault((policy, prefetch), []).append(
                        {k: v for k, v in stats.items() if k.startswith("expert_")})
        finally:
            store.close()
    for key, (host, stub) in seen.items():
        assert host == stub, key
    assert seen["lru", True][0]["expert_prefetches"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_block_files_are_the_files_quantize_writes_but_made_directly(tmp_path, backend):
    """synth's random_blocks (the large benchmark files): the same tensors, types and shapes as the file
    quantized from floats, values finite and of about the scale asked for, and a model that decodes the
    tokens of none with experts as pebbles and prefetch."""
    from gguf import GGUFReader

    from pyplugin.model.gguf_file import dequantize_bytes
    from pyplugin.model.synth import write_gguf
    spec = dict(arch="qwen3moe", vocab="qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, key_length=64,
                n_ff=512, n_ff_exp=256, n_expert=8, n_expert_used=2, n_merges=150, n_ctx=128, weight_type="Q4_K",
                tensor_types={"attn_v": "Q6_K", "blk.1.ffn_down_exps": "Q6_K", "attn_q": "Q8_0", "attn_k": "Q5_0",
                              "attn_output": "Q4_0", "token_embd": "Q6_K"})
    quantized = GGUFReader(write_gguf(tmp_path / "q.gguf", **spec))
    blocks = GGUFReader(write_gguf(tmp_path / "b.gguf", **spec, random_blocks=True))
    layout = lambda r: [(t.name, t.tensor_type, tuple(t.shape)) for t in r.tensors]  # noqa: E731
    assert layout(blocks) == layout(quantized)
    for t in blocks.tensors:
        values = dequantize_bytes(np.asarray(t.data), t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
        assert np.isfinite(values).all(), t.name
        if t.name.endswith(("attn_q.weight", "ffn_down_exps.weight", "attn_output.weight", "attn_v.weight")):
            cols = int(t.shape[0])
            assert 0.3 < float(values.std()) * cols ** 0.5 < 3, t.name
    model = load_model(tmp_path / "b.gguf", weights="quantized", progress=False)
    pebbled = PebbledModel(model, backend=backend)
    try:
        tokens = prompt(6)
        expected, _ = generate(pebbled, tokens, pebbling_strategy="none")
        got, report = generate(pebbled, tokens, pebbling_strategy="minimal", pebbling_expert_cache=2,
                               pebbling_expert_prefetch=True)
        assert got == expected and report["experts"]["prefetch_guesses"] > 0
    finally:
        pebbled.close()
