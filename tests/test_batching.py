"""Decoding a batch: sequences at different positions, each with its own KV entries, share one pass over
the layers, and each produces exactly the tokens it produces alone, while a streamed layer is restored
once per step for all of them."""

from __future__ import annotations

import pytest

from helpers import store_backend_params, tiny_model
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.batch import decode_batch
from pyplugin.runtime.generation import Generation
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.runtime.store_layers import StoreLayers

PROMPTS = ([5, 17, 42, 8], [99, 3], [61, 7, 250, 12, 33, 71, 4], [150], [9, 28, 77],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40], [300, 301])


def alone(model, backend, options, pebbling, prompt, fused=False):
    pebbled = PebbledModel(model, backend=backend, fused_decode=fused)
    gen = pebbled.generation(options, pebbling, len(prompt))
    return list(gen.tokens(prompt)), gen.report()


def together(model, backend, options, pebbling, prompts, fused=False):
    """Every prompt prefilled, then decoded in steps over all the sequences still going."""
    pebbled = PebbledModel(model, backend=backend, fused_decode=fused)
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
@pytest.mark.parametrize("strategy,fused", [("minimal", False), ("every:2", False), ("none", False),
                                            ("minimal", True)])
def test_a_batch_of_eight_decodes_what_each_decodes_alone(backend, weights, strategy, fused):
    model = tiny_model("qwen2", weights=weights, n_layer=3)
    options = Options(temperature=0, num_predict=10, num_ctx=96)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
    expected = [alone(model, backend, options, pebbling, p, fused)[0] for p in PROMPTS]
    got, reports = together(model, backend, options, pebbling, PROMPTS, fused)
    assert got == expected
    assert all(len(tokens) == 10 for tokens in got)  # every sequence decoded in every step
    assert {r["batch"]["largest"] for r in reports} == {8}


@pytest.mark.parametrize("backend", store_backend_params())
def test_a_streamed_layer_is_restored_once_per_step_for_the_whole_batch(backend):
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
    kv = one.memory.layer_kv_bytes * model.config.n_layer
    assert four.store_limit - one.store_limit == 3 * kv
    assert four.estimated_peak_bytes >= one.estimated_peak_bytes + 3 * kv
    # adaptive fits weights and the batch's KV together: a budget that holds every layer for one sequence
    # holds fewer for four.
    budget = one.estimated_peak_bytes
    adaptive = PebblingOptions.from_options({"pebbling_strategy": "adaptive", "pebbling_memory_limit": budget})
    assert len(pebbled.plan(options, adaptive, n_seqs=1).resident) == model.config.n_layer
    batch = pebbled.plan(options, adaptive, n_seqs=4)
    assert len(batch.resident) < model.config.n_layer and batch.estimated_peak_bytes <= budget
