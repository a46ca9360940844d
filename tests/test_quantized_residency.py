"""Quantized residency: weight matrices stay in their GGUF type in the model, in both tiers of the store
and on the bus, and the kernels compute from them; every strategy gives the greedy tokens of the
weights expanded at load (`f16`), on every backend present.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from helpers import mix_overrides, store_backend_params
from helpers import tiny_model, tiny_path
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.runtime.generation import ResidentLayers
from pyplugin.store import backend_named
from pyplugin.runtime.layout import K_ID, V_ID, WEIGHT_IDS
from pyplugin.model import QuantWeight
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

PROMPT = [5, 17, 42, 8, 99, 3, 61, 7, 250, 12, 33, 21, 9, 140]
OPTIONS = Options(temperature=0, num_predict=10, num_ctx=64, num_batch=12)  # chunks past the fused kernels
STRATEGIES = ["none", "sqrt", "minimal", "every:3", "adaptive"]

# A Q4_K_M-like mix (Q4_K, with Q6_K for attn_v, ffn_down and the output), and single types.
Q4_K_M = dict(weight_type="Q4_K", tensor_types={"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
              n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
MODELS = {
    "llama-Q4_K_M": ("llama", dict(Q4_K_M, n_layer=6)),
    "qwen2-Q8_0": ("qwen2", dict(weight_type="Q8_0", n_layer=6)),
    "phi3-Q4_0": ("phi3", dict(weight_type="Q4_0", n_layer=6)),
    "llama-Q6_K-tied": ("llama", dict(weight_type="Q6_K", tied_output=True, n_embd=256, n_ff=256, n_layer=4)),
    "llama-BF16": ("llama", dict(weight_type="BF16", n_layer=4)),
    "qwen2-F16": ("qwen2", dict(weight_type="F16", n_layer=4)),      # no expansion: multiplied as stored
    "llama-F32": ("llama", dict(weight_type="F32", n_layer=4)),
    # Q5_K_M-like; and the fallbacks llama.cpp writes where rows are not whole 256-value blocks
    "llama-Q5_K_M": ("llama", dict(weight_type="Q5_K", tensor_types={"attn_v": "Q6_K", "ffn_down": "Q6_K"},
                                   n_embd=256, n_ff=512, n_layer=4)),
    "qwen2-Q5_0-Q8_0": ("qwen2", dict(weight_type="Q5_0", tensor_types={"ffn_down": "Q8_0", "attn_v": "Q8_0"},
                                      n_layer=4)),
    "phi3-Q4_1-Q5_1": ("phi3", dict(weight_type="Q4_1", tensor_types={"ffn_down": "Q5_1"}, n_layer=4, seed=1)),
    # llama-quantize's Q3_K_M, Q2_K and IQ4_XS mixes (synth_mix; test_quant_mixes runs them on the stub's store)
    **{f"llama-{mix}": ("llama", mix_overrides(mix)) for mix in ("Q3_K_M", "Q2_K", "IQ4_XS")},
}


# The stub's kernels are held to the host library's on every type (test_quant_kernels.py), and its store
# to the native one (test_store_conformance.py); what it adds here is the whole path through its own
# store and kernels, which one model mixing three types shows. Every model runs on the native backends.
STUB_MODELS = ("llama-Q4_K_M",)


_references: dict[tuple[str, str], list[int]] = {}


def reference_tokens(name: str, backend: str = "stub") -> list[int]:
    """Greedy tokens of the f16 form, every layer resident, no store. On the native libraries, whose matrix
    kernels multiply the activation quantized to 8-bit blocks (pebble.h: the host library for every
    quantized type, the cuda library for four), those of the quantized form resident on the library's own
    kernels: random-weight models have near-ties that this rounding can turn (as it does llama.cpp's,
    which quantizes them alike), so the store's paths are held to the library's own resident result;
    test_quant_kernels bounds the difference itself."""
    key = (name, backend if backend in ("host", "cuda") else "f16")
    if key not in _references:
        arch, overrides = MODELS[name]
        if key[1] != "f16":
            model = tiny_model(arch, weights="quantized", **overrides)
            layers = ResidentLayers(model, OPTIONS.num_ctx, backend_named(backend).kernels)
            tokens = list(Generation(model, OPTIONS, layers=layers).tokens(PROMPT))
        else:
            tokens = list(Generation(tiny_model(arch, weights="f16", **overrides), OPTIONS).tokens(PROMPT))
        assert len(tokens) == OPTIONS.num_predict  # the comparison below means something
        _references[key] = tokens
    return _references[key]


@pytest.fixture(scope="module", params=[
    pytest.param((backend.values[0], name), marks=backend.marks, id=f"{backend.id}-{name}")
    for backend in store_backend_params() for name in MODELS
    if backend.values[0] != "stub" or name in STUB_MODELS])
def pebbled(request):
    """A model's layers in a store of one backend; `.case` names the model's entry in MODELS."""
    backend, name = request.param
    arch, overrides = MODELS[name]
    pm = PebbledModel(tiny_model(arch, weights="quantized", **overrides), backend=backend)
    pm.case = name
    yield pm
    pm.close()


def run(pebbled, strategy: str, limit: int | None = None):
    pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, "pebbling_memory_limit": limit})
    gen = pebbled.generation(OPTIONS, pebbling, len(PROMPT))
    return list(gen.tokens(PROMPT)), gen.report(), gen.layers


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_quantized_tokens_equal_the_f16_tokens_for_every_strategy(pebbled, strategy):
    tokens, report, _ = run(pebbled, strategy)
    assert report["weights"] == "quantized"
    assert tokens == reference_tokens(pebbled.case, pebbled.backend.name)


@pytest.mark.parametrize("name", MODELS)
def test_the_resident_quantized_model_gives_the_f16_tokens(name):
    """On kernels that multiply the activation as it is (the stub's; the GPU's alike)."""
    arch, overrides = MODELS[name]
    model = tiny_model(arch, weights="quantized", **overrides)
    layers = ResidentLayers(model, OPTIONS.num_ctx, backend_named("stub").kernels)
    assert list(Generation(model, OPTIONS, layers=layers).tokens(PROMPT)) == reference_tokens(name)


def test_pebbles_are_the_files_bytes_with_their_type_and_shape(pebbled):
    """Each weight matrix's entry holds exactly the file's bytes, typed with its GGUF type and shape."""
    arch, overrides = MODELS[pebbled.case]
    reader = GGUFReader(tiny_path(arch, **overrides))
    matrices = {t.name: t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    stored = 0
    for i in range(pebbled.model.config.n_layer):
        for t in pebbled.layouts[i]:
            info = pebbled.store.entry_info(i, t.tensor_id)
            if t.qtype is None:  # a vector (norm, bias), in the compute type
                assert len(info.shape) == 1
                continue
            assert info.ggml_type == t.qtype and info.shape == (t.shape[1], t.shape[0])  # GGUF order
            assert info.nbytes == t.nbytes
            stored += info.nbytes
            weights = pebbled.layer_weights(i)
            assert isinstance(getattr(weights, t.name), QuantWeight)
    assert stored == sum(int(t.n_bytes) for t in matrices.values())  # phi3's fused tensors: split, same bytes
    # the same bytes, not a copy converted on the way
    w = pebbled.layer_weights(0)
    name = "attn_qkv.weight" if arch == "phi3" else "attn_q.weight"
    raw = np.asarray(matrices[f"blk.0.{name}"].data).reshape(-1).view(np.uint8)
    got = w.wq.data if pebbled.xp is np else w.wq.data.get()
    np.testing.assert_array_equal(got.reshape(-1), raw[:got.size])


def test_the_plan_counts_weights_in_their_stored_type(pebbled):
    arch, overrides = MODELS[pebbled.case]
    memory = pebbled.memory_model(OPTIONS, len(PROMPT))
    for i, layout in enumerate(pebbled.layouts):
        assert memory.layer_weight_bytes[i] == sum(-(-t.nbytes // 256) * 256 for t in layout)
    expanded = PebbledModel(tiny_model(arch, weights="f16", **overrides), backend=pebbled.backend)
    try:
        f16 = expanded.memory_model(OPTIONS, len(PROMPT))
        quantized, expanded_bytes = sum(memory.layer_weight_bytes), sum(f16.layer_weight_bytes)
        stored_bits = {"F32": 32, "F16": 16, "BF16": 16}.get(overrides["weight_type"])
        if stored_bits:  # float files: at most their expansion, bit for bit (the GPU expands to fp16, so
            # an F32 file's stored form is twice its expansion there)
            expanded_bits = 8 * np.dtype(pebbled.backend.compute_dtype).itemsize
            assert quantized <= expanded_bytes * max(1, stored_bits // expanded_bits)
        else:  # 8.5 bits a weight or fewer, against 16 (GPU) or 32 (host)
            assert quantized < 0.6 * expanded_bytes
    finally:
        expanded.close()


def test_streaming_restores_the_stored_bytes_of_the_streamed_layers(pebbled):
    """bytes restored per decoded token = the streamed layers' weights as stored + the K and V rows
    each decode step reads back, exactly; where the arrays are host memory (host, stub) the weights
    and the KV caches are computed from the host tier in place, and nothing is copied."""
    tokens, report, layers = run(pebbled, "minimal")
    plan = layers.plan
    assert plan.streamed == tuple(range(pebbled.model.config.n_layer))
    if not pebbled.backend.arrays_on_device:
        assert report["bytes_restored_per_token"] == 0 and report["restores"] == 0
        return
    weights = sum(t.nbytes for i in plan.streamed for t in pebbled.layouts[i])
    kv_rows = 0
    steps = len(tokens) - 1  # the last token is sampled, not fed back
    for n in range(steps):
        pos = len(PROMPT) + n
        kv_rows += 2 * pos * layers.kv_row_bytes * len(plan.streamed)
    assert report["bytes_restored_per_token"] == (steps * weights + kv_rows) // steps


def test_kv_entries_are_f16_by_default_on_every_backend(pebbled):
    run(pebbled, "minimal")
    cfg = pebbled.model.config
    info = pebbled.store.entry_info(0, K_ID)
    assert info.ggml_type == 1  # F16, whatever the compute type
    assert info.nbytes == OPTIONS.num_ctx * cfg.n_head_kv * cfg.head_dim * 2
    assert pebbled.store.entry_info(0, V_ID).nbytes == info.nbytes
    assert max(WEIGHT_IDS.values()) < K_ID


def test_prefill_expands_only_what_the_gemm_cannot_take_as_stored(pebbled):
    """A chunk past the fused kernels expands quantized matrices into the fp16 workspace, and the
    estimate counts the largest; F16 (and, on the host, F32) are multiplied as they are stored, and on
    the host library every type is (pebble_matmul)."""
    _, overrides = MODELS[pebbled.case]
    as_stored = {"F16"} | ({"F32"} if pebbled.xp is np else set())
    types = {overrides["weight_type"], *overrides.get("tensor_types", {}).values()}
    largest = max(t.shape[0] * t.shape[1] for layout in pebbled.layouts for t in layout if t.qtype is not None)
    assert pebbled.expansion_elements(8) == 0  # the fused kernels take up to 8 rows
    # the host library's prefill multiplies the stored blocks in tiles: nothing is expanded there
    expands = not (types <= as_stored or pebbled.backend.name == "host")
    assert pebbled.expansion_elements(12) == (largest if expands else 0)


@pytest.mark.parametrize("strategy", ["none", "minimal"])
def test_a_pass_that_expands_takes_its_workspace_at_its_largest_once(pebbled, strategy, monkeypatch):
    """A chunk past the fused kernels expands each quantized matrix into one workspace: sized at the largest
    before the pass, it is never grown while a smaller matrix's view is held (11-27 on the H200: grown at the
    first feed-forward matrix, attn_q's 33.5 MB stayed beside its 117 MB, over the estimate)."""
    kernels = pebbled.kernels
    made, asked = [], []
    grow = kernels.workspace

    def spy(n_elements):
        asked.append(n_elements)
        view = grow(n_elements)
        if not made or made[-1] is not kernels._local.buffer:
            made.append(kernels._local.buffer)
        return view

    monkeypatch.setattr(kernels, "workspace", spy)
    run(pebbled, strategy)
    largest = pebbled.expansion_elements(OPTIONS.num_batch)
    if not largest:  # nothing is expanded on this backend (the host library multiplies the blocks as stored)
        assert not asked
        return
    assert len(asked) > 1 and asked[0] == largest == max(asked)
    assert len(made) == 1 and made[0].size == largest, [b.size for b in made]
