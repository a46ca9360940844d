"""Mixture-of-experts models (qwen3moe, qwen2moe with its shared expert, Mixtral-style llama files, gpt-oss):
the synthetic files' layout and metadata as gguf-py names them, the float64 reference (tests/reference.py,
its routing as llama.cpp's build_moe_ffn computes it), every strategy and backend giving the
tokens of `none`, a batch of sequences equal to each alone, and files asking for what is not computed
refused by name.
"""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGUFReader

from helpers import store_backend_params, tiny_path
from reference import reference_logits
from pyplugin.errors import ModelError
from pyplugin.model import load_model
from pyplugin.model.gguf_file import GGUFFile
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

SHAPE = dict(n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_ctx=128, n_merges=150, n_layer=2, n_expert=8,
             n_expert_used=3)
CASES = {
    "qwen3moe": dict(arch="qwen3moe", vocab="qwen3", key_length=32, n_ff_exp=32),
    "qwen2moe": dict(arch="qwen2moe", vocab="chatml", n_ff_exp=32, n_ff_shexp=64),
    "mixtral": dict(arch="llama", vocab="llama3", n_expert=4, n_expert_used=2),
    # sinks, biases, the clamped SwiGLU, a softmax over the chosen; q wider than the model; every other layer
    # sliding over 4 positions (the 11-token prompt crosses it)
    "gpt-oss": dict(arch="gpt-oss", vocab="chatml", key_length=32, n_ff_exp=32, sliding_window=4),
}
PROMPT_LEN, DECODED = 11, 5


def path_of(case: str, **extra):
    spec = {**SHAPE, **CASES[case], **extra}
    return tiny_path(spec.pop("arch"), **spec)


def prompt(n: int = PROMPT_LEN) -> list[int]:
    return [(5 * i + 2) % 250 + 1 for i in range(n)]


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------------
# the files


@pytest.mark.parametrize("case", CASES)
def test_synthetic_files_lay_experts_out_as_gguf_py_names_them(case):
    spec = {**SHAPE, **CASES[case]}
    reader = GGUFReader(path_of(case))
    arch = spec["arch"]
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields[f"{arch}.expert_count"] == spec["n_expert"]
    assert fields[f"{arch}.expert_used_count"] == spec["n_expert_used"]
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}   # GGUF's ne order
    E, e = spec["n_expert"], spec["n_embd"]
    ff = spec.get("n_ff_exp", spec["n_ff"])
    assert shapes["blk.0.ffn_gate_inp.weight"] == (e, E)
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (e, ff, E)
    assert shapes["blk.1.ffn_down_exps.weight"] == (ff, e, E)
    assert "blk.0.ffn_gate.weight" not in shapes and "blk.0.ffn_down.weight" not in shapes
    assert ("blk.0.ffn_gate_shexp.weight" in shapes) == (arch == "qwen2moe")
    if arch == "qwen2moe":
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (e,)
        assert shapes["blk.0.ffn_down_shexp.weight"] == (spec["n_ff_shexp"], e)
        assert fields["qwen2moe.expert_shared_feed_forward_length"] == spec["n_ff_shexp"]
    if arch == "qwen3moe":
        assert "blk.0.attn_q_norm.weight" in shapes and fields["qwen3moe.expert_feed_forward_length"] == ff


def test_configs_read_as_llama_cpp_reads_them():
    q3 = load_model(path_of("qwen3moe"), progress=False).config
    assert (q3.n_expert, q3.n_expert_used, q3.n_ff_exp, q3.n_ff_shexp, q3.expert_norm) == (8, 3, 32, 0, True)
    q2 = load_model(path_of("qwen2moe"), progress=False).config
    assert (q2.n_ff_exp, q2.n_ff_shexp, q2.expert_norm) == (32, 64, False)
    mx = load_model(path_of("mixtral"), progress=False).config
    assert (mx.n_expert, mx.n_expert_used, mx.n_ff_exp, mx.expert_norm) == (4, 2, 96, True)
    flagged = load_model(path_of("qwen2moe", expert_weights_norm=True), progress=False).config
    assert flagged.expert_norm


# ---------------------------------------------------------------------------------------------------
# the forward pass against the reference


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_batch", [4, 16])
def test_prefill_matches_the_float64_reference(case, num_batch):
    path = path_of(case)
    model = load_model(path, weights="f16", progress=False)
    tokens = prompt(PROMPT_LEN)
    ref = reference_logits(path, tokens)
    gen = Generation(model, Options(temperature=0, num_ctx=64, num_batch=num_batch, kv_type="f32"))  # K, V unrounded
    assert rel(gen.prefill(tokens), ref[-1]) < 1e-4


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("case", CASES)
def test_decode_steps_match_the_float64_reference(backend, case):
    """The decode step (one native call per token on host, the stub's forward pass) through the KV cache. The
    stub rounds every matrix product's input to fp16 (as the GPU's kernels do), a dense model's decode step
    there too is ~4e-4 from the reference; the host's takes float32 inputs for float weights."""
    from pyplugin.store import backend_named
    path = path_of(case)
    model = load_model(path, weights="f16", progress=False)
    tokens = prompt(PROMPT_LEN + DECODED)
    ref = reference_logits(path, tokens)
    from pyplugin.runtime.generation import ResidentLayers
    layers = ResidentLayers(model, 64, backend_named(backend).kernels, kv_type="f32")
    gen = Generation(model, Options(temperature=0, num_ctx=64, num_batch=8, kv_type="f32"), layers=layers)
    gen.prefill(tokens[:PROMPT_LEN])
    tolerance = 1e-4 if backend == "host" else 2e-3
    for n, token in enumerate(tokens[PROMPT_LEN:]):
        assert rel(gen.decode_one(token), ref[PROMPT_LEN + n]) < tolerance, (case, n)


def test_the_reference_sees_the_routing():
    """Renormalising the chosen experts' weights changes the logits: the flag is not dead."""
    tokens = prompt(6)
    plain = reference_logits(path_of("qwen2moe"), tokens)
    normed = reference_logits(path_of("qwen2moe", expert_weights_norm=True), tokens)
    assert rel(plain, normed) > 1e-3


# ---------------------------------------------------------------------------------------------------
# strategies, backends, weight forms, batches

FORMS = {"Q8_0": dict(weight_type="Q8_0"), "F16": dict(weight_type="F16"),
         # Q4_K_M-like: K-quant rows need 256 columns
         "Q4_K_M": dict(weight_type="Q4_K", n_embd=256, n_ff=256, n_ff_exp=256, n_ff_shexp=256,
                        tensor_types={"ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "output": "Q6_K"})}


def formed(case: str, form: str):
    extra = dict(FORMS[form])
    if case == "mixtral":
        extra.pop("n_ff_exp", None)
        extra.pop("n_ff_shexp", None)
    if case in ("qwen3moe", "gpt-oss") and form == "Q4_K_M":
        extra["key_length"] = 64
    return path_of(case, **extra)


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_every_strategy_gives_the_tokens_of_none(backend, case, form):
    options = Options(temperature=0, num_predict=6, num_ctx=48, num_batch=4)
    tokens = prompt(7)
    model = load_model(formed(case, form), weights="quantized", progress=False)
    pebbled = PebbledModel(model, backend=backend)
    try:
        run = lambda strategy: list(pebbled.generation(  # noqa: E731
            options, PebblingOptions.from_options({"pebbling_strategy": strategy}), len(tokens)).tokens(tokens))
        expected = run("none")
        assert len(expected) == 6
        if backend == "host":  # the resident model on the host's kernels: the same decode step
            assert list(Generation(model, options).tokens(tokens)) == expected
        for strategy in ("sqrt", "minimal", "every:2", "adaptive"):
            assert run(strategy) == expected, (case, form, strategy)
    finally:
        pebbled.close()


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("case", CASES)
def test_a_batch_decodes_what_each_sequence_decodes_alone(backend, case):
    """Sequences routed to different experts in one step (each expert's rows read once for the tokens
    routed to it) get exactly their tokens alone."""
    from test_batching import PROMPTS, alone, together
    model = load_model(path_of(case, weight_type="Q8_0"), weights="quantized", progress=False)
    options = Options(temperature=0, num_predict=7, num_ctx=48)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [p[:6] for p in PROMPTS[:5]]
    expected = [alone(model, backend, options, pebbling, p)[0] for p in prompts]
    got, _ = together(model, backend, options, pebbling, prompts)
    assert got == expected and all(len(tokens) == 7 for tokens in got)


# ---------------------------------------------------------------------------------------------------
# experts as pebbles: each expert of each layer an entry of the store, a cache of them per layer

FIRST_EXPERT = 100  # entry id of expert 0 in these tests


def expert_store(backend, model, wrong=()):
    """A store of `backend` holding each expert of each layer as one entry: its gate, up and down rows (64
    bytes for the (layer, expert) pairs of `wrong`)."""
    from pyplugin.model.moe import expert_rows
    cfg = model.config
    store = backend.open_store(0, cfg.n_layer, "minimal")
    for i, lw in enumerate(model.layers):
        for j in range(cfg.n_expert):
            parts = [expert_rows(getattr(lw, name), j, rows).data for name, rows in
                     (("ffn_gate_exps", cfg.n_ff_exp), ("ffn_up_exps", cfg.n_ff_exp), ("ffn_down_exps", cfg.n_embd))]
            data = np.zeros(64, np.uint8) if (i, j) in wrong else np.concatenate([p.ravel() for p in parts])
            store.save(i, FIRST_EXPERT + j, np.ascontiguousarray(data), tier="host")
    return store


MERGED = (200, 201, 202)  # entry ids of the merged gate, up and down expert tensors in these tests


def merged_store(backend, model, short=None):
    """A store of `backend` holding each layer's merged gate, up and down expert tensors as entries MERGED
    (expert j's rows the j-th n_expert-th of each), the one named `short` (layer, name) 64 bytes short."""
    from pyplugin.model.moe import expert_rows
    cfg = model.config
    store = backend.open_store(0, cfg.n_layer, "minimal")
    for i, lw in enumerate(model.layers):
        for tid, (name, rows) in zip(MERGED, (("ffn_gate_exps", cfg.n_ff_exp), ("ffn_up_exps", cfg.n_ff_exp),
                                              ("ffn_down_exps", cfg.n_embd))):
            data = np.concatenate([expert_rows(getattr(lw, name), j, rows).data.ravel() for j in range(cfg.n_expert)])
            store.save(i, tid, np.ascontiguousarray(data[:-64] if short == (i, name) else data), tier="host")
    return store


def run_steps(kernels, model, n_ctx, n_steps, n_seq, **decoder_args):
    """Logits of n_steps decode steps of n_seq sequences (each its own tokens), and the decoder's stats."""
    from pyplugin.model import KVCache, embed
    cfg = model.config
    kvs = [KVCache.allocate(cfg, n_ctx) for _ in range(n_seq)]
    caches = [[(kv.k[i], kv.v[i]) for kv in kvs] for i in range(cfg.n_layer)]
    decoder = kernels.decoder(cfg, model.resident_layers(kernels), caches, model.outer_weights(kernels), n_ctx,
                              **decoder_args)
    out = []
    for t in range(n_steps):
        tokens = [(37 * t + 11 * s + 5) % 250 + 1 for s in range(n_seq)]
        x = np.ascontiguousarray(embed(model.outer, tokens, np), dtype=np.float32)
        out.append(decoder.step(list(range(n_seq)), [t] * n_seq, x).copy())
    stats = decoder.stats()
    decoder.close()
    return np.stack(out), stats


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("case", ["qwen2moe", "mixtral", "gpt-oss"])
@pytest.mark.parametrize("entries", ["per expert", "merged"])
def test_experts_as_pebbles_decode_what_the_merged_experts_decode(backend, case, entries):
    """Whatever the cache (none, some, every expert), a step restores each expert its tokens chose that the
    cache lacks, once for the whole batch, and computes exactly what the merged experts compute; a bigger
    cache (least recently used out first) never restores more. The experts are an entry each
    (experts_stored 1) or read out of the merged tensors' entries (2)."""
    from pyplugin.store import backend_named
    be = backend_named(backend)
    model = load_model(path_of(case, weight_type="Q8_0"), weights="quantized", progress=False)
    cfg = model.config
    merged, stats = run_steps(be.kernels, model, 16, 6, 3)
    assert stats["expert_hits"] == stats["expert_misses"] == 0
    store = expert_store(be, model) if entries == "per expert" else merged_store(be, model)
    first = FIRST_EXPERT if entries == "per expert" else MERGED
    nbytes = sum(store.entry_info(0, tid).nbytes for tid in MERGED) // cfg.n_expert if entries == "merged" else \
        store.entry_info(0, FIRST_EXPERT).nbytes
    used, misses = None, []
    try:
        for cache in (0, 1, 2, cfg.n_expert):
            experts = {i: (first, cache) for i in range(cfg.n_layer)}
            logits, stats = run_steps(be.kernels, model, 16, 6, 3, store=store, experts=experts)
            np.testing.assert_array_equal(logits, merged)
            ran = stats["expert_hits"] + stats["expert_misses"]  # (step, layer, expert chosen) triples
            assert used is None or ran == used
            used = ran
            assert stats["expert_bytes_restored"] == stats["expert_misses"] * nbytes
            misses.append(stats["expert_misses"])
            if cache == 0:
                assert stats["expert_hits"] == 0
            if cache == cfg.n_expert:  # each expert restored once at most
                assert stats["expert_misses"] <= cfg.n_layer * cfg.n_expert
        assert misses == sorted(misses, reverse=True) and misses[0] > misses[-1], misses
        # three sequences choosing k experts each, in two layers, over six steps: never more than that
        assert cfg.n_layer * 6 * cfg.n_expert_used <= used <= cfg.n_layer * 6 * min(cfg.n_expert, 3 * cfg.n_expert_used)
    finally:
        store.close()


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_an_expert_entry_of_the_wrong_size_is_refused_by_name(backend):
    from pyplugin.errors import PebblingError
    from pyplugin.store import backend_named
    be = backend_named(backend)
    model = load_model(path_of("mixtral", weight_type="Q8_0"), weights="quantized", progress=False)
    store = expert_store(be, model, wrong={(1, 2)})
    try:
        with pytest.raises(PebblingError, match=r"layer 1: expert 2 \(tensor 102\)"):
            run_steps(be.kernels, model, 16, 1, 1, store=store, experts={0: (FIRST_EXPERT, 2), 1: (FIRST_EXPERT, 2)})
    finally:
        store.close()
    store = merged_store(be, model, short=(1, "ffn_up_exps"))
    try:
        with pytest.raises(PebblingError, match=r"layer 1: ffn_up_exps \(tensor 201\) is not an entry of \d+ bytes"):
            run_steps(be.kernels, model, 16, 1, 1, store=store, experts={0: (MERGED, 2), 1: (MERGED, 2)})
        with pytest.raises(PebblingError, match=r"layer 0: experts read from merged tensors need the entries of "
                                                r"ffn_gate_exps, ffn_up_exps, ffn_down_exps; got 2"):
            run_steps(be.kernels, model, 16, 1, 1, store=store, experts={0: (MERGED[:2], 2)})
    finally:
        store.close()


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("strategy", ["none", "sqrt", "minimal", "every:2", "adaptive"])
def test_an_expert_cache_gives_the_tokens_of_none_and_reports_what_it_restored(backend, strategy, monkeypatch):
    """pebbling_expert_cache: every cache size gives the tokens of the experts kept in their layers; the
    report counts hits, misses and expert bytes per token, fewer bytes for a bigger cache (minimal caches
    none); the layers' merged experts leave the device tier, the decoder's expert slots hold what the plan says,
    and no copy of an expert is made."""
    model = load_model(path_of("qwen3moe", weight_type="Q8_0"), weights="quantized", progress=False)
    cfg = model.config
    options = Options(temperature=0, num_predict=8, num_ctx=48, num_batch=4)
    tokens = prompt(7)
    pebbled = PebbledModel(model, backend=backend)
    try:
        def run(**extra):
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, **extra})
            gen = pebbled.generation(options, pebbling, len(tokens))
            return list(gen.tokens(tokens)), gen.report()["experts"]
        expected, plain = run()
        assert plain["cache_per_layer"] is None and plain["hits"] == plain["misses"] == 0
        entries, opened = pebbled.store.stats().entries, []
        open_store = pebbled.backend.open_store
        monkeypatch.setattr(pebbled.backend, "open_store", lambda *a, **k: opened.append(a) or open_store(*a, **k))
        resident = [i for i in range(cfg.n_layer) if pebbled.store.should_checkpoint(i)]
        merged = {i: [t for t in pebbled.layouts[i] if t.name.endswith("_exps")] for i in range(cfg.n_layer)}
        assert all(pebbled.store.entry_info(i, t.tensor_id).on_device for i in resident for t in merged[i])
        per_token = []
        for cache in (0, 2, cfg.n_expert):
            got, experts = run(pebbling_expert_cache=cache)
            assert got == expected, cache
            held = 0 if strategy == "minimal" else cache
            assert (experts["cache_asked"], experts["cache_per_layer"]) == (cache, held)
            decoded = len(expected) - 1  # the last token is sampled, not run through the model
            assert experts["hits"] + experts["misses"] == decoded * cfg.n_layer * cfg.n_expert_used
            assert experts["bytes_restored_per_token"] * decoded == pytest.approx(
                experts["misses"] * experts["expert_bytes"], rel=0.01)
            per_token.append(experts["bytes_restored_per_token"])
            slot = -(-experts["expert_bytes"] // 256) * 256
            assert experts["cache_bytes"] == experts["cache_bytes_estimate"] == \
                slot * (cfg.n_layer * held + (1 if held == 0 else 0))
            # the merged experts stay in the host tier, whatever the layer's residency
            assert not any(pebbled.store.entry_info(i, t.tensor_id).on_device for i in range(cfg.n_layer)
                           for t in merged[i])
        if strategy == "minimal":
            assert per_token[0] == per_token[1] == per_token[2]
        else:
            assert per_token[0] > per_token[1] > per_token[2]
            assert experts["misses"] <= cfg.n_layer * cfg.n_expert  # the whole cache: once each
        # no entry was made for an expert: each is read out of its layer's merged tensors, whose bytes the
        # host tier holds once (a copy per expert doubled the host memory of a model's experts)
        assert pebbled.store.stats().entries == entries and not opened
        run()  # experts with their layers again: the merged experts of resident layers back on the device
        assert all(pebbled.store.entry_info(i, t.tensor_id).on_device for i in resident for t in merged[i])
    finally:
        pebbled.close()


def test_the_expert_cache_option_is_checked():
    from pyplugin.errors import OptionsError
    assert PebblingOptions.from_options({"pebbling_expert_cache": 8}).expert_cache == 8
    for bad in (-1, True, "8", 1.5):
        with pytest.raises(OptionsError, match="pebbling_expert_cache"):
            PebblingOptions.from_options({"pebbling_expert_cache": bad})


def test_estimate_shows_the_experts(capsys):
    import json

    from pyplugin.cli import main
    path = str(path_of("qwen2moe", weight_type="Q8_0"))
    assert main(["estimate", path, "--num-ctx", "64", "--num-batch", "8", "--backend", "stub", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["experts"]
    model = load_model(path, progress=False)
    lw, cfg = model.layers[0], model.config
    one = sum(getattr(lw, n).nbytes for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) // cfg.n_expert
    assert (e["n_expert"], e["n_expert_used"], e["expert_layers"], e["expert_bytes"]) == (8, 3, 2, one)
    assert e["experts_bytes"] == 2 * 8 * one and e["routed_bytes_per_token"] == 2 * 3 * one
    slot = -(-one // 256) * 256
    caches = {c["cache_per_layer"]: c for c in e["caches"]}
    assert sorted(caches) == [0, 1, 8]
    assert [caches[c]["slots_bytes"] for c in (0, 1, 8)] == [slot, 2 * slot, 16 * slot]
    assert [caches[c]["prefetch_slots_bytes"] for c in (0, 1, 8)] == [3 * slot, 5 * slot, 19 * slot]
    # the smallest budget: minimal's dense part and one expert slot (one layer's top 3 with prefetch)
    assert e["smallest_budget_prefetch_bytes"] - e["smallest_budget_bytes"] == 2 * slot
    assert caches[8]["budget_minimal"] - caches[0]["budget_minimal"] == 15 * slot  # two layers' 8, less the staging slot
    assert main(["estimate", path, "--num-ctx", "64", "--num-batch", "8", "--backend", "stub"]) == 0
    out = capsys.readouterr().out
    assert "experts: 8 per layer in 2 layers, 3 used per token" in out
    assert "smallest budget" in out and "uniform-routing hit rate" in out


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
@pytest.mark.parametrize("expert_cache", [None, 2])
def test_streamed_layers_of_experts_through_the_decoders_slots(backend, expert_cache, monkeypatch):
    """The GPU's path on the host: a streamed layer's weights copied into the decoder's slots each step (its
    merged experts with it, or, with an expert cache, only its dense part) gives the tokens of `none`."""
    from pyplugin.runtime.store_layers import StoreLayers
    monkeypatch.setattr(StoreLayers, "slots_everywhere", True)
    model = load_model(path_of("qwen2moe", weight_type="Q8_0"), weights="quantized", progress=False)
    options = Options(temperature=0, num_predict=6, num_ctx=48, num_batch=4)
    tokens = prompt(7)
    pebbled = PebbledModel(model, backend=backend)
    try:
        def run(strategy, **extra):
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, **extra})
            gen = pebbled.generation(options, pebbling, len(tokens))
            return list(gen.tokens(tokens)), gen.report()
        expected, _ = run("none")
        extra = {} if expert_cache is None else {"pebbling_expert_cache": expert_cache}
        got, report = run("minimal", **extra)
        assert got == expected
        per_token = report["bytes_restored_per_token"]  # the store's restores: the slots' copies
        dense = sum(t.nbytes for layout in pebbled.layouts for t in layout if not t.name.endswith("_exps"))
        if expert_cache is None:
            assert per_token > pebbled.weight_bytes  # every layer's experts too
        else:
            assert dense < per_token < pebbled.weight_bytes  # the dense part (and KV), not the merged experts
            assert report["experts"]["misses"] > 0
    finally:
        pebbled.close()


@pytest.mark.parametrize("case, key, value", [
    ("qwen3moe", "qwen3moe.expert_gating_func", np.uint32(2)),       # sigmoid gating: not computed
    ("mixtral", "llama.expert_shared_feed_forward_length", np.uint32(64)),  # no shared expert in a llama file
    ("qwen3moe", "qwen3moe.expert_used_count", np.uint32(9)),        # more than its 8 experts
    ("qwen2moe", "qwen2moe.expert_weights_scale", -1.0),
])
def test_expert_keys_pebbling_does_not_compute_are_refused_by_name(case, key, value):
    with pytest.raises(ModelError, match=key.replace(".", r"\.")):
        load_model(path_of(case, metadata={key: value}), progress=False)


def test_an_moe_architecture_without_experts_is_refused():
    with pytest.raises(ModelError, match=r"qwen3moe\.expert_count"):
        load_model(path_of("qwen3moe", metadata={"qwen3moe.expert_count": np.uint32(0)}), progress=False)


def test_expert_weights_scale_multiplies_the_routed_experts():
    """qwen2moe's expert_weights_scale (llama.cpp's w_scale): the reference and the forward pass agree."""
    path = path_of("qwen2moe", metadata={"qwen2moe.expert_weights_scale": 2.5})
    model = load_model(path, weights="f16", progress=False)
    assert model.config.expert_scale == 2.5
    tokens = prompt(PROMPT_LEN)
    with GGUFFile(path) as f:
        assert f.metadata["qwen2moe.expert_weights_scale"] == 2.5
    ref = reference_logits(path, tokens)
    assert rel(ref[-1], reference_logits(path_of("qwen2moe"), tokens)[-1]) > 1e-3   # the scale matters
    gen = Generation(model, Options(temperature=0, num_ctx=64, num_batch=16, kv_type="f32"))  # K, V unrounded
    assert rel(gen.prefill(tokens), ref[-1]) < 1e-4
