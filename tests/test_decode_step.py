"""The decode step (pebble_decoder_*, native/cuda/decode_step.cu): a whole model for a batch of tokens in one
call; one layer of it against the model's own forward pass on every backend present; its refusals; and
generation through it against the Python forward pass, and batched against alone."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import quantizes_x, store_backend_params, tiny_model
from pyplugin.errors import ClosedError, InvalidArgumentError, SizeMismatchError
from pyplugin.runtime import PebbledModel
from pyplugin.model import QuantWeight, layer_forward
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.runtime.generation import Generation, ResidentLayers
from pyplugin.store import backend_named
from pyplugin.store.decoder_scratch import model_scratch_bytes, scratch_bytes
from pyplugin.store.kernels import LayerShape

N_CTX = 24
CASES = {  # name: (arch, overrides); partial RoPE, NeoX, biases, GQA, every type
    "llama-Q4_K_M": ("llama", dict(weight_type="Q4_K", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                                   tensor_types={"attn_v": "Q6_K", "ffn_down": "Q6_K"})),
    "qwen2-Q8_0-bias": ("qwen2", dict(weight_type="Q8_0")),
    "phi3-Q4_0-neox": ("phi3", dict(weight_type="Q4_0")),
    "llama-F16-partial-rope": ("llama", dict(weight_type="F16", rope_dims=8)),
    "llama-BF16-mha": ("llama", dict(weight_type="BF16", n_head_kv=4)),
    "llama-Q5_K-Q5_1": ("llama", dict(weight_type="Q5_K", n_embd=256, n_ff=256, tensor_types={"attn_output": "Q5_1"})),
    "qwen2-Q5_0-Q4_1": ("qwen2", dict(weight_type="Q5_0", tensor_types={"ffn_down": "Q4_1"})),
    "llama-Q3_K-Q2_K-IQ4_XS": ("llama", dict(weight_type="Q3_K", n_embd=256, n_ff=256,
                                             tensor_types={"attn_v": "Q2_K", "ffn_down": "IQ4_XS"})),
    "qwen2-IQ4_NL-MXFP4": ("qwen2", dict(weight_type="IQ4_NL", tensor_types={"attn_output": "MXFP4",
                                                                              "ffn_down": "MXFP4"})),
    # Q/K norms and a head size of its own; the Gemmas' sandwich norms and GELU; gemma2's soft cap (low, so
    # that it bends the scores); Granite's residual and attention scales
    "qwen3-Q8_0-qk-norm": ("qwen3", dict(weight_type="Q8_0", key_length=32)),
    "gemma3-Q4_0-sandwich": ("gemma3", dict(weight_type="Q4_0", key_length=32, sliding_window=8)),
    "gemma2-F16-softcap": ("gemma2", dict(weight_type="F16", sliding_window=8, attn_softcap=0.5)),
    "llama-Q8_0-granite": ("llama", dict(weight_type="Q8_0", metadata={"llama.residual_scale": 0.5,
                                                                       "llama.attention.scale": 0.3})),
    # gpt-oss: sinks, the output's bias, a sliding layer, experts in MXFP4 with their biases and clamped SwiGLU
    "gpt-oss-Q8_0-MXFP4-sinks": ("gpt-oss", dict(weight_type="Q8_0", key_length=32, n_expert=4, n_expert_used=2,
                                                 n_ff_exp=32, sliding_window=8,
                                                 tensor_types={"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4",
                                                               "ffn_down_exps": "MXFP4"})),
}


@pytest.fixture(params=store_backend_params())
def kernels(request):
    return backend_named(request.param).kernels


def host(a):
    return a.get() if type(a).__module__.partition(".")[0] == "cupy" else a


def setup(kernels, arch, overrides, form, pos, seed=0, n_ctx=N_CTX):
    """(cfg, weights on the kernels' side, caches of n_ctx rows with rows 0..pos-1 filled, x float32)."""
    model = tiny_model(arch, weights=form, n_layer=1, **overrides)
    cfg, xp = model.config.for_layer(0), kernels.xp
    setup.outer = model.outer_weights(kernels)
    dtype = np.float32 if xp is np else np.float16
    lw = model.layers[0].map(lambda a: a.to(xp, kernels) if isinstance(a, QuantWeight) else xp.asarray(a, dtype))
    rng = np.random.default_rng(seed)
    shape = (cfg.kv_rows(0, n_ctx), cfg.n_head_kv, cfg.head_dim)  # a sliding layer: a ring of its window
    k, v = (xp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(2))
    x = rng.standard_normal(cfg.n_embd).astype(np.float32)
    return cfg, lw, k, v, x


def reference(cfg, lw, k, v, x, pos, kernels):
    """The model's forward pass on numpy, float32, weights as the decode step sees them: quantized or
    dense matrices through the same fp16-vector matvec (dense ones wrapped as F32/F16 QuantWeights).
    Each matrix's matvec takes x as the step's does: the stub's (x as it is), or the host library's where
    the step's kernels quantize x to 8-bit blocks (pebble.h: the host library for the quantized types,
    the cuda library's integer kernel, quantizing as the host does; test_quant_kernels holds
    both to the documented bound)."""
    stub = backend_named("stub").kernels
    native = backend_named("host").kernels if kernels.name in ("host", "cuda") else stub

    def as_numpy(a):
        if isinstance(a, QuantWeight):
            by = native if kernels.name == "host" or quantizes_x(kernels.name, a.qtype) else stub
            return QuantWeight(a.qtype, a.shape, host(a.data), by)
        a = host(a).astype(np.float32)
        if a.ndim == 2:  # a dense matrix: its float32 bytes, so the matvec rounds x to fp16 as the step does
            return QuantWeight(0, a.shape, a.view(np.uint8).reshape(a.shape[0], -1),
                               native if kernels.name == "host" else stub)
        return a

    lw = lw.map(as_numpy)
    k, v = host(k).astype(np.float32), host(v).astype(np.float32)
    out = layer_forward(cfg, x[None, :], lw, k, v, pos)[0]
    return out, k, v


def step_tolerance(kernels, quantized_x: bool) -> float:
    """Of the output's largest value. Host, x as it is: 1e-3. Host, x in 8-bit blocks, or the GPU (its
    caches, norms and activations in fp16): 5e-3. The GPU with x in 8-bit blocks: 1e-2. Its activations
    differ from the reference's by an fp16 unit here and there, which moves an element across a rounding
    boundary of its block (a step is 1/127 of the block's largest): about one element in ten of 4096,
    each by a step, sums to ~0.7% of a row's product; seen up to 0.72% on the H200, 11-27."""
    if kernels.xp is np:
        return 5e-3 if quantized_x else 1e-3
    return 1e-2 if quantized_x else 5e-3


def step_one(kernels, cfg, lw, k, v, x, pos, n_ctx):
    """x through the one layer at `pos` by a decoder over it (its hidden state, no logits)."""
    decoder = kernels.decoder(cfg, [lw], [[(k, v)]], setup.outer, n_ctx)
    got = kernels.xp.asarray(x[None, :])
    assert decoder.step([0], [pos], got, logits=False) is None
    return got[0]


@pytest.mark.parametrize("pos", [0, 5, N_CTX - 1])
@pytest.mark.parametrize("case", list(CASES))
def test_one_layer_equals_the_forward_pass(kernels, case, pos):
    arch, overrides = CASES[case]
    cfg, lw, k, v, x = setup(kernels, arch, overrides, "quantized" if "F16" not in case else "f16", pos)
    want, want_k, want_v = reference(cfg, lw, k, v, x, pos, kernels)
    before_k, before_v = host(k).astype(np.float32), host(v).astype(np.float32)
    got = step_one(kernels, cfg, lw, k, v, x, pos, N_CTX)
    got, k, v = host(got), host(k).astype(np.float32), host(v).astype(np.float32)
    # The vectors entering the matrix kernels are rounded to fp16 on both sides; where the float32 sums
    # before them differ in the last bit a rounding can fall the other way: one fp16 unit (1e-3) of one
    # element, carried through a matrix. A wrong rotation, head or row is off by the values themselves.
    # On the host library such a flip also moves x's 8-bit blocks (pebble.h): one fp16 unit of a block's
    # largest element changes its scale, every q of it by up to half a step, about 1/127 of that block's
    # share; seen up to 3.5e-3 of the output's largest value (Q5_K through the AVX-512 kernels).
    quantized_x = any(isinstance(w, QuantWeight) and quantizes_x(kernels.name, w.qtype) for _, w in lw.arrays())
    tol = step_tolerance(kernels, quantized_x)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= tol * scale, (np.abs(got - want).max(), scale)
    np.testing.assert_allclose(v[pos % k.shape[0]], want_v[pos % k.shape[0]], rtol=tol,
                               atol=tol * np.abs(want_v[pos % k.shape[0]]).max())
    # every other row of the caches is untouched
    row = pos % k.shape[0]
    np.testing.assert_allclose(k[row], want_k[row], rtol=tol, atol=tol * np.abs(want_k[row]).max())
    rest = [r for r in range(k.shape[0]) if r != row]
    np.testing.assert_array_equal(k[rest], before_k[rest])
    np.testing.assert_array_equal(v[rest], before_v[rest])


@pytest.mark.parametrize("pos", [63, 64, 130, 199])
@pytest.mark.parametrize("case", ["llama-Q4_K_M", "qwen3-Q8_0-qk-norm", "phi3-Q4_0-neox"])
def test_a_long_context_sums_v_in_parts_as_the_forward_pass_does(kernels, case, pos):
    """A 200-row context: the GPU (and the host without SIMD, which runs its kernels) sums V in parts of
    DECODER_SPLIT_ROWS rows on warps apart, then the parts in order; 64, 65, 131 and 200 rows attended
    are one, two, three and four parts, the last one short. Held to the forward pass as one layer is."""
    from pyplugin.store.abi import DECODER_SPLIT_ROWS
    assert DECODER_SPLIT_ROWS == 64  # the positions above are chosen around its parts' edges
    n_ctx = 200
    arch, overrides = CASES[case]
    cfg, lw, k, v, x = setup(kernels, arch, overrides, "quantized", pos, n_ctx=n_ctx)
    want, _, _ = reference(cfg, lw, k, v, x, pos, kernels)
    got = host(step_one(kernels, cfg, lw, k, v, x, pos, n_ctx))
    quantized_x = any(isinstance(w, QuantWeight) and quantizes_x(kernels.name, w.qtype) for _, w in lw.arrays())
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= step_tolerance(kernels, quantized_x) * scale, (np.abs(got - want).max(), scale)


@pytest.mark.parametrize("pos", [3, 13, 21])
def test_a_sliding_layer_keeps_a_ring_of_its_window(kernels, pos):
    """A window of 8: the caches hold 8 rows, position p in row p % 8, and attention covers the rows filled
    (past the window's edge, the last 8 positions), as the forward pass's ring does."""
    arch, overrides = CASES["gemma3-Q4_0-sandwich"]
    cfg, lw, k, v, x = setup(kernels, arch, overrides, "quantized", pos)
    assert cfg.window == 8 and cfg.rope_theta == 10000.0 and k.shape[0] == 8
    want, want_k, want_v = reference(cfg, lw, k, v, x, pos, kernels)
    got = step_one(kernels, cfg, lw, k, v, x, pos, N_CTX)
    got, k = host(got), host(k).astype(np.float32)
    tol = step_tolerance(kernels, any(isinstance(w, QuantWeight) and quantizes_x(kernels.name, w.qtype)
                                      for _, w in lw.arrays()))
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    np.testing.assert_allclose(k[pos % 8], want_k[pos % 8], rtol=tol, atol=tol * np.abs(want_k[pos % 8]).max())


def test_refusals_name_what_was_wrong_and_the_kernels_stay_usable(kernels):
    from dataclasses import replace

    arch, overrides = CASES["qwen2-Q8_0-bias"]
    cfg, lw, k, v, x = setup(kernels, arch, overrides, "quantized", 3)
    xp = kernels.xp
    half_rows = xp.ascontiguousarray(lw.wq.data[:, :lw.wq.data.shape[1] // 2])  # a matrix of half the columns
    wrong_q = QuantWeight(lw.wq.qtype, (cfg.n_embd, cfg.n_embd // 2), half_rows)
    made = [
        (dict(cfg=replace(cfg, n_head_kv=3)), InvalidArgumentError, "layer 0: 4 query heads cannot share 3 KV heads"),
        (dict(cfg=replace(cfg, n_ff=0)), InvalidArgumentError, "must each be at least 1"),
        (dict(lw=replace(lw, wq=wrong_q)), SizeMismatchError, "wq"),
        (dict(lw=replace(lw, attn_norm=xp.asarray(host(lw.attn_norm)[:10]))), SizeMismatchError, "attn_norm"),
        (dict(lw=replace(lw, attn_norm=xp.asarray(host(lw.attn_norm).astype(np.float64)))), InvalidArgumentError,
         "float64"),
        (dict(k=k.astype(np.float64), v=v.astype(np.float64)), InvalidArgumentError, "float32"),
        (dict(k=k[:N_CTX - 1]), SizeMismatchError, "a v_cache holds"),  # K says the rows: V disagrees
    ]
    good = dict(cfg=cfg, lw=lw, k=k, v=v)
    for change, error, message in made:
        args = {**good, **change}
        with pytest.raises(error, match=message):
            kernels.decoder(args["cfg"], [args["lw"]], [[(args["k"], args["v"])]], setup.outer, N_CTX)
    decoder = kernels.decoder(cfg, [lw], [[(k, v)]], setup.outer, N_CTX)
    row = xp.asarray(x[None, :])
    for seqs, positions, error, message in [([0], [N_CTX], SizeMismatchError, f"position {N_CTX} is outside"),
                                            ([0], [-1], SizeMismatchError, "position -1"),
                                            ([1], [3], InvalidArgumentError, "sequence 1; each of 0..0"),
                                            ([], [], InvalidArgumentError, "0 tokens")]:
        with pytest.raises(error, match=message):
            decoder.step(seqs, positions, row)
    before = host(row).copy()
    logits = decoder.step([0], [3], row)  # still works, and the refused calls changed nothing
    assert not np.array_equal(host(row), before) and host(logits).shape == (1, cfg.n_vocab)
    decoder.close()
    with pytest.raises(ClosedError):
        decoder.step([0], [3], row)


def test_the_native_library_refuses_malformed_calls_by_status(kernels):
    if kernels.name == "stub":
        pytest.skip("the stub takes arrays, not pointers")
    from pyplugin.store import native

    lib, ffi = kernels.lib._lib, native.ffi
    model = ffi.new("struct pebble_step_model *", dict(n_layer=1, n_embd=32, n_vocab=8, n_seq=1, kv_type=0))
    layer = ffi.new("struct pebble_step_layer[]", 1)  # every pointer NULL
    layer[0].shape = dict(n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff=32, rope_dims=16, rms_eps=1e-5)
    layer[0].kv_rows = 8
    caches = ffi.new("void *[]", 1)
    out = ffi.new("pebble_decoder_t *")
    assert lib.pebble_decoder_create(model, layer, caches, caches, out) == -1
    assert "output_norm must not be NULL" in ffi.string(lib.pebble_last_error()).decode()
    assert lib.pebble_decoder_create(ffi.NULL, layer, caches, caches, out) == -1
    assert lib.pebble_decoder_step(ffi.NULL, 1, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL) == -9  # closed


# A near-tie: the reference's two best logits closer than this share of its largest. The host's matrix
# kernels multiply activations quantized to 8-bit blocks (pebble.h bounds it: 0.022 of |W||x| per block
# of 32, far less in practice), the stub's multiply them as they are, so where the reference hesitates
# this much either token is right; past the first such step the two go on from different tokens.
NEAR_TIE = 0.02


def reference_steps(model, options, prompt):
    """Greedy tokens of the Python forward pass (the stub backend), with each step's top-two gap."""
    gen = Generation(model, options, layers=ResidentLayers(model, options.num_ctx, backend_named("stub").kernels))
    tokens, gaps = [], []
    gen.start(prompt)
    while True:
        top = np.sort(gen.logits)[-2:]
        token = gen.next_token()
        if token is None:
            return tokens, gaps
        tokens.append(token)
        gaps.append((top[1] - top[0]) / np.abs(gen.logits).max())
        if not gen.wants_forward():
            return tokens, gaps
        gen.logits = gen.decode_one(token)


def agrees(got, reference):
    """got equals the reference's tokens up to its first near-tie, where either token is right."""
    tokens, gaps = reference
    for j, (a, b) in enumerate(zip(got, tokens)):
        if a != b:
            return gaps[j] <= NEAR_TIE
    return len(got) == len(tokens)


@pytest.mark.parametrize("case", ["llama-Q4_K_M", "qwen2-Q8_0-bias", "phi3-Q4_0-neox", "qwen3-Q8_0-qk-norm",
                                  "gemma3-Q4_0-sandwich", "gemma2-F16-softcap", "llama-Q8_0-granite"])
@pytest.mark.parametrize("backend", store_backend_params())
def test_generation_through_the_decoder_gives_the_forward_pass_tokens(backend, case):
    """Every strategy through one native call per token gives the Python forward pass's tokens (tie-tolerant
    on the host library, whose kernels quantize activations), one call per step whatever the layers."""
    arch, overrides = CASES[case]
    model = tiny_model(arch, weights="quantized" if "F16" not in case else "f16", n_layer=4, **overrides)
    options = Options(temperature=0, num_predict=12, num_ctx=48, num_batch=16)
    prompt = [5, 17, 42, 8, 99, 3, 61]
    reference = reference_steps(model, options, prompt)
    assert len(reference[0]) == 12
    pebbled = PebbledModel(model, backend=backend)
    try:
        tokens = {}
        for strategy in ("none", "minimal", "every:3"):
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": strategy}),
                                     len(prompt))
            tokens[strategy] = list(gen.tokens(prompt))
            decoder = gen.layers.shared.decoder()
            assert decoder.calls == len(tokens[strategy]) - 1  # every plan steps in one call
            assert gen.report()["decode_step"] == ("python" if backend == "stub" else "native")
        assert len(set(map(tuple, tokens.values()))) == 1, tokens  # strategies never change a token
        if backend == "stub":
            assert tokens["none"] == reference[0]
        else:
            assert agrees(tokens["none"], reference), (tokens["none"], reference)
    finally:
        pebbled.close()


class _Counting:
    """A native library whose pebble_* calls are counted."""

    def __init__(self, lib):
        self._lib, self.calls = lib, 0

    def __getattr__(self, name):
        if name.startswith("pebble_"):
            self.calls += 1
        return getattr(self._lib, name)


def test_a_decode_step_makes_the_same_few_native_calls_whatever_the_layer_count(capsys):
    """Python pays per token, not per layer: the calls into the library during decode steps (after the first,
    which makes the plan's decoder), counted, are as many for 8 layers as for 2."""
    per_step = {}
    for n_layer in (2, 8):
        model = tiny_model("qwen3", weights="quantized", n_layer=n_layer, weight_type="Q8_0", key_length=32)
        pebbled = PebbledModel(model, backend="host")
        try:
            options = Options(temperature=0, num_predict=6, num_ctx=48, num_batch=16)
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "every:2"}), 5)
            gen.start([5, 17, 42, 8, 99])
            token = gen.next_token()
            gen.logits = gen.decode_one(token)  # the first step makes the plan's decoder: once per plan
            kernels_lib, store = pebbled.kernels.lib, pebbled.store
            counting = _Counting(kernels_lib._lib)
            kernels_lib._lib = counting
            store_counting = _Counting(store._lib)
            store._lib = store_counting
            token = gen.next_token()
            for _ in range(4):
                gen.logits = gen.decode_one(token)
                token = gen.next_token()
            kernels_lib._lib, store._lib = counting._lib, store_counting._lib
            per_step[n_layer] = (counting.calls + store_counting.calls) / 4
        finally:
            pebbled.close()
    with capsys.disabled():
        print(f"\nnative calls per decode step: {per_step[2]:g} at 2 layers, {per_step[8]:g} at 8 layers")
    assert per_step[2] == per_step[8] <= 4


@pytest.mark.parametrize("case", ["llama-Q4_K-72-rows", "gemma3-Q4_0-sandwich"])
def test_a_step_of_eleven_sequences_gives_each_what_it_gets_alone(kernels, case):
    """Eleven sequences in one step, at their own positions over caches of their own: the GPU launches the
    per-sequence kernels (RoPE, the new K/V row, attention) eight at a time, the second group from the
    ninth, and matvec takes eight vectors at a time (the second group's rows offset); q of 72 rows and k of
    36 in one stack (their edge inside a thread block's 16 rows); the Gemmas' norm-then-add and a ring.
    Each sequence's hidden state as the same step gives it alone."""
    arch, overrides = (("llama", dict(weight_type="Q4_K", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, key_length=18,
                                      tensor_types={"attn_output": "F16", "attn_v": "Q6_K"}))
                       if case == "llama-Q4_K-72-rows" else CASES[case])
    cfg, lw, _, _, _ = setup(kernels, arch, overrides, "quantized", 0)
    xp, n_seq, rows = kernels.xp, 11, cfg.kv_rows(0, N_CTX)
    dtype = np.float32 if xp is np else np.float16
    rng = np.random.default_rng(11)
    caches = [tuple(rng.standard_normal((rows, cfg.n_head_kv, cfg.head_dim)).astype(dtype) for _ in range(2))
              for _ in range(n_seq)]
    positions = [int(p) for p in rng.integers(0, N_CTX, n_seq)]
    x = rng.standard_normal((n_seq, cfg.n_embd)).astype(np.float32)

    def on_device(pairs):
        return [(xp.asarray(k.copy()), xp.asarray(v.copy())) for k, v in pairs]

    decoder = kernels.decoder(cfg, [lw], [on_device(caches)], setup.outer, N_CTX)
    # its scratch as the plan counts it (store.decoder_scratch), for eleven sequences
    assert decoder.stats()["scratch_bytes"] == scratch_bytes([LayerShape.of(cfg.for_layer(0))], [rows], n_seq, cfg.n_embd,
                                                             cfg.n_vocab, on_device=xp is not np)
    together = xp.asarray(x)
    decoder.step(list(range(n_seq)), positions, together, logits=False)
    together = host(together)
    decoder.close()
    for b in range(n_seq):
        one = kernels.decoder(cfg, [lw], [on_device(caches[b:b + 1])], setup.outer, N_CTX)
        alone = xp.asarray(x[b:b + 1])
        one.step([0], positions[b:b + 1], alone, logits=False)
        one.close()
        alone = host(alone)[0]
        np.testing.assert_allclose(together[b], alone, rtol=0, atol=1e-5 * np.abs(alone).max(),
                                   err_msg=f"sequence {b} of {n_seq} at position {positions[b]}")


def test_cuda_graph_decisions_follow_the_batch(kernels, monkeypatch):
    """When a step would be captured as a CUDA graph and replayed (native/cuda/graph.cu's graph_policy, the stub's
    GraphPolicy): a batch stepped twice running is captured, then replayed for as long as it recurs, whatever
    its positions (read from device memory); another batch, or the same one without logits, is another
    graph; past PEBBLE_DECODER_GRAPHS graphs the least recently used is dropped. The host build and the stub
    make and count the same decisions (they run every step directly); every step's result is the one it
    gives with graphs off."""
    from pyplugin.store.abi import DECODER_GRAPHS

    arch, overrides = CASES["gemma3-Q4_0-sandwich"]  # a ring: positions past its window wrap
    cfg, lw, _, _, x = setup(kernels, arch, overrides, "quantized", 0)
    xp, n_seq = kernels.xp, DECODER_GRAPHS + 2

    def run(graphs: bool):
        monkeypatch.setenv("PEBBLING_CUDA_GRAPHS", "1" if graphs else "0")
        rows = cfg.kv_rows(0, N_CTX)
        dtype = np.float32 if xp is np else np.float16
        caches = [[(xp.zeros((rows, cfg.n_head_kv, cfg.head_dim), dtype),
                    xp.zeros((rows, cfg.n_head_kv, cfg.head_dim), dtype)) for _ in range(n_seq)]]
        decoder = kernels.decoder(cfg, [lw], caches, setup.outer, N_CTX)
        pos = [0] * n_seq
        outs, seen = [], []

        def step(seqs, logits=True):
            h = xp.asarray(np.tile(x, (len(seqs), 1)))
            out = decoder.step(seqs, [pos[s] for s in seqs], h, logits=logits)
            for s in seqs:
                pos[s] += 1
            outs.append(host(h).copy())
            if out is not None:
                outs.append(host(out).copy())
            stats = decoder.stats()
            seen.append((stats["graphs_captured"], stats["graph_replays"], stats["graphs_dropped"]))

        for _ in range(12):          # direct, captured, then replayed past the ring's edge (window 8)
            step([0, 1])
        step([1, 0])                 # another order: another batch, run directly
        step([0, 1], logits=False)   # without logits: another batch
        step([0, 1])                 # its graph kept: replayed
        for s in range(2, 2 + DECODER_GRAPHS):  # eight more batches, each captured: the ninth graph drops one
            step([s])
            step([s])
        step([0, 1])                 # the least recently used was [0, 1]: dropped, so run directly again
        decoder.close()
        return outs, seen

    outs, seen = run(True)
    assert seen[0] == (0, 0, 0) and seen[1] == (1, 0, 0) and seen[11] == (1, 10, 0)
    assert seen[12] == (1, 10, 0) and seen[13] == (1, 10, 0) and seen[14] == (1, 11, 0)
    assert seen[-2] == (1 + DECODER_GRAPHS, 11, 1)
    assert seen[-1] == (1 + DECODER_GRAPHS, 11, 1)
    plain, none = run(False)
    assert all(s == (0, 0, 0) for s in none)
    for got, want in zip(outs, plain, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["llama-Q4_K_M", "gemma3-Q4_0-sandwich", "qwen2-Q8_0-bias"])
@pytest.mark.parametrize("backend", store_backend_params())
def test_streamed_layers_through_the_decoder_s_slots_give_the_resident_tokens(backend, case, monkeypatch):
    """The GPU's path on every backend: streamed layers copied from the store into the plan's two slots inside
    the native step (weights, and each sequence's K/V rows before its position), the new rows written back;
    a batch of three sequences at once; the tokens of `none`, and every byte restored counted."""
    from pyplugin.runtime.batch import decode_batch
    from pyplugin.runtime.store_layers import StoreLayers

    monkeypatch.setattr(StoreLayers, "slots_everywhere", True)
    arch, overrides = CASES[case]
    model = tiny_model(arch, weights="quantized", n_layer=5, **overrides)
    options = Options(temperature=0, num_predict=10, num_ctx=48, num_batch=16)
    prompts = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 19], [88, 2, 31, 4, 56]]
    pebbled = PebbledModel(model, backend=backend)
    try:
        alone = {}
        for strategy in ("none", "minimal", "every:2"):
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
            gen = pebbled.generation(options, pebbling, len(prompts[0]))
            alone[strategy] = list(gen.tokens(prompts[0]))
            report = gen.report()
            if strategy == "none":
                assert report["bytes_restored"] == 0
            else:  # every step restored the streamed layers' weights through the store
                assert report["bytes_restored_per_token"] > 0 and gen.layers.shared.decoder().calls == 9
        assert alone["minimal"] == alone["none"] and alone["every:2"] == alone["none"], alone
        # three sequences in one plan, stepped together: each gives its tokens alone
        pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
        want = []
        for prompt in prompts:
            gen = pebbled.generation(options, pebbling, len(prompt))
            want.append(list(gen.tokens(prompt)))
        source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=3), options, pebbling)
        gens = [Generation(model, options, layers=source.sequence(s)) for s in range(3)]
        got = [[] for _ in prompts]
        for gen, prompt in zip(gens, prompts):
            gen.start(prompt)
        going = [0, 1, 2]
        while going:
            forward = []
            for b in going:
                token = gens[b].next_token()
                if token is not None:
                    got[b].append(token)
                    if gens[b].wants_forward():
                        forward.append((b, token))
            if forward:
                for (b, _), logits in zip(forward, decode_batch(source, [gens[b] for b, _ in forward],
                                                                [t for _, t in forward])):
                    gens[b].logits = logits
            going = [b for b, _ in forward]
        assert got == want and source.decoder().stats()["tokens"] == 3 * 9
    finally:
        pebbled.close()


def test_the_portable_decode_step_equals_the_forward_pass_too():
    """What a CPU without AVX2 runs (PEBBLING_SIMD=portable): the one-layer tests above, in a process of their
    own with the setting, where each sequence's biases, RoPE and cache rows go through the GPU's own kernel
    (qkv_kernel) rather than the host's qkv_rows, and the attention through the GPU's kernels (V summed in
    parts at the long context, eleven sequences in two groups)."""
    import os
    import subprocess
    import sys

    from pyplugin.store import probe
    if not probe("host").usable:
        pytest.skip("the host library is not built here (make host)")
    env = {**os.environ, "PEBBLING_SIMD": "portable", "PEBBLING_TEST_BACKENDS": "host"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "host and (one_layer_equals or sliding_layer_keeps or long_context or eleven or gemma4_decode_steps)"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict(weight_type="Q4_K", n_embd=256, n_ff=512, n_head=4, n_head_kv=2)),
    ("gemma2", dict(weight_type="F16", sliding_window=8)),  # a ring of 8 rows beside whole caches
    ("qwen3moe", dict(weight_type="Q8_0", key_length=32, n_expert=8, n_expert_used=3, n_ff_exp=32)),
    ("qwen2moe", dict(weight_type="Q8_0", n_expert=8, n_expert_used=3, n_ff_exp=32, n_ff_shexp=64)),
])
@pytest.mark.parametrize("backend", store_backend_params())
def test_the_plan_counts_the_decoders_scratch_as_the_library_allocates_it(backend, arch, overrides):
    """pebble_decoder_stats.scratch_bytes is what the decoder took for its steps' activations; the plan counts
    it from the model's shape before the decoder exists (decoder_bytes), where it is device memory of the
    decoder's own (cuda: 11-27 on the H200, 14.6 to 18.8 MB of a batch of 8's peak was beyond the pool, the
    store and the overhead), and not where it is the host's."""
    model = tiny_model(arch, weights="quantized" if "F16" not in overrides["weight_type"] else "f16", n_layer=3,
                       **overrides)
    options = Options(temperature=0, num_predict=3, num_ctx=40, num_batch=16)
    pebbled = PebbledModel(model, backend=backend)
    try:
        for strategy in ("none", "minimal"):
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": strategy}), 5)
            assert len(list(gen.tokens([5, 17, 42, 8, 99]))) == 3
            held = gen.layers.shared.decoder().stats()["scratch_bytes"]
            on_device = pebbled.backend.arrays_on_device
            assert held == model_scratch_bytes(model.config, options.num_ctx, 1, on_device) > 0
            assert gen.layers.shared.plan.memory.decoder_bytes == (held if on_device else 0)
    finally:
        pebbled.close()


# ---------------------------------------------------------------------------------------------------
# Gemma 4 (test_gemma4.py's files): E2B's per-layer inputs, layers reading earlier layers' caches (rings and
# whole caches), V normed and double-wide FFNs; 26B-A4B's dense FFN beside GELU experts (the router's own input,
# a scale per expert; its gate and up merged in the file, or split); 31B's V = K on its full layers, KV heads of
# their own there

GEMMA4 = ("e2b", "26b-a4b", "26b-a4b split", "31b")


def forward_pass_logits(gen, token):
    """The logits of `token` through the Python forward pass (every layer's layer_forward), not the decoder."""
    from pyplugin.model import output_logits
    from pyplugin.xp import to_numpy
    return to_numpy(output_logits(gen.cfg, gen.outer, gen._through_layers([token])[-1]))


def gemma4_tolerance(kernels) -> float:
    """Of the logits' largest value. The stub's step is the forward pass itself (equal to the bit, seen); the host's
    sums in other orders, its GELU and softmax are its own, and a vector entering a matrix is rounded to fp16 on
    both sides, so a last-bit difference before it can flip a rounding, carried through ten layers and the
    final soft cap: seen up to 5.1e-3 (E2B, host, 11-28), as far as the host's forward pass is from the stub's
    on the same steps (5.9e-3). Twice step_tolerance with x in blocks."""
    return 2 * step_tolerance(kernels, True)


@pytest.mark.parametrize("case", GEMMA4)
def test_gemma4_decode_steps_equal_the_forward_pass(kernels, case):
    """Each decode step of a Gemma 4 model through the decoder (one call) against the forward pass over the same
    prompt, past the sliding window of 5, so that the readers of a ring attend over rows their source rewrote."""
    from test_gemma4 import path_of, prompt
    from pyplugin.model import load_model
    model = load_model(path_of(case), weights="quantized", progress=False)
    options = Options(temperature=0, num_ctx=32, num_batch=4)
    through, forward = (Generation(model, options, layers=ResidentLayers(model, 32, kernels)) for _ in range(2))
    for gen in (through, forward):
        gen.prefill(prompt())
    for n, token in enumerate([5, 9, 77, 3, 41, 8, 19]):
        got, want = host(through.decode_one(token)), forward_pass_logits(forward, token)
        assert np.abs(got - want).max() <= gemma4_tolerance(kernels) * np.abs(want).max(), (case, n)
    assert through.layers._decoder.calls == 8  # every step one native call (the prompt's last chunk of one too)
    assert through.layers._decoder.stats()["scratch_bytes"] == model_scratch_bytes(model.config, 32, 1, False)


@pytest.mark.parametrize("case", GEMMA4)
@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_gemma4_batched_steps_through_the_slots_equal_the_forward_pass(backend, case, monkeypatch):
    """Three sequences in each step, at their own positions, with every layer resident and with every layer the
    plan streams copied through the decoder's slots (a reader of another's caches restores and writes back none:
    its source stays resident), the 26B-A4B's experts with their layers and as pebbles (a cache of 2 a layer,
    prefetched); each sequence's logits those of the forward pass alone."""
    from test_gemma4 import path_of, prompt
    from pyplugin.model import load_model
    from pyplugin.runtime.batch import decode_batch
    from pyplugin.runtime.store_layers import StoreLayers

    monkeypatch.setattr(StoreLayers, "slots_everywhere", True)
    model = load_model(path_of(case), weights="quantized", progress=False)
    options = Options(temperature=0, num_ctx=32, num_batch=4, kv_type="f32")
    prompts = [prompt(), prompt(6)[::-1], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    pebbled = PebbledModel(model, backend=backend)
    tolerance = gemma4_tolerance(backend_named(backend).kernels)
    experts = [{}, {"pebbling_expert_cache": 2, "pebbling_expert_prefetch": True}] if model.config.n_expert else [{}]
    try:
        for strategy, extra in [(strategy, extra) for strategy in ("none", "minimal") for extra in experts]:
            pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, **extra})
            source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=3), options, pebbling)
            assert bool(source.streamed) == (strategy == "minimal")
            gens = [Generation(model, options, layers=source.sequence(s)) for s in range(3)]
            alone = [Generation(model, options, layers=ResidentLayers(model, 32, backend_named(backend).kernels, "f32"))
                     for _ in prompts]
            for gen, ref, p in zip(gens, alone, prompts):
                gen.start(p)
                ref.start(p)
            for n in range(6):
                tokens = [(11 * n + 7 * b) % 200 + 1 for b in range(3)]
                for b, (got, token) in enumerate(zip(decode_batch(source, gens, tokens), tokens)):
                    want = forward_pass_logits(alone[b], token)
                    assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), (strategy, n, b)
            stats = source.decoder().stats()
            assert stats["tokens"] == 3 * 6 + 2  # and the 13- and 9-token prompts' last chunk
            if extra:  # every expert a token ran came from the layer's cache or was restored for it
                ran = stats["expert_hits"] + stats["expert_misses"]
                assert ran > 0 and stats["expert_guesses"] > 0 and stats["expert_misses"] > 0, stats
            source.release()
    finally:
        pebbled.close()


GEMMA4_MOE = ("26b-a4b", "26b-a4b split")
FIRST_EXPERT, MERGED = 300, (400, 401, 402)  # the entry of expert 0 (an entry each); the merged stacks' entries


def gemma4_moe_steps(kernels, model, **decoder_args):
    """Logits [steps, 3, n_vocab] of five decode steps of three sequences (positions 0..4, each its own tokens)
    through a decoder over every layer of `model`, and the decoder's stats."""
    from pyplugin.model import KVCache, embed
    cfg, n_ctx = model.config, 16
    kvs = [KVCache.allocate(cfg, n_ctx, kernels.xp) for _ in range(3)]
    caches = [[(kv.k[i], kv.v[i]) for kv in kvs] for i in range(cfg.n_layer)]
    decoder = kernels.decoder(cfg, model.resident_layers(kernels), caches, model.outer_weights(kernels), n_ctx,
                              **decoder_args)
    steps = []
    for t in range(5):
        x = np.ascontiguousarray(embed(model.outer, [(29 * t + 13 * b + 3) % 250 + 1 for b in range(3)], np,
                                       cfg.embd_scale, np.float32))
        steps.append(host(decoder.step([0, 1, 2], [t] * 3, kernels.xp.asarray(x))).copy())
    stats = decoder.stats()
    decoder.close()
    return np.stack(steps), stats


def gemma4_expert_store(backend, model, merged: bool):
    """A store of `backend` with each layer's experts in its host tier: an entry per expert (its gate, up and down
    rows; at FIRST_EXPERT + j), or the layer's merged gate, up and down stacks (at MERGED)."""
    from pyplugin.model.moe import expert_rows
    cfg = model.config
    store = backend.open_store(0, cfg.n_layer, "minimal")
    parts = (("ffn_gate_exps", cfg.n_ff_exp), ("ffn_up_exps", cfg.n_ff_exp), ("ffn_down_exps", cfg.n_embd))
    for i, lw in enumerate(model.layers):
        rows = [[expert_rows(getattr(lw, name), j, n).data.ravel() for name, n in parts] for j in range(cfg.n_expert)]
        if merged:
            for k, tid in enumerate(MERGED):
                store.save(i, tid, np.ascontiguousarray(np.concatenate([r[k] for r in rows])), tier="host")
        else:
            for j, r in enumerate(rows):
                store.save(i, FIRST_EXPERT + j, np.ascontiguousarray(np.concatenate(r)), tier="host")
    return store


@pytest.mark.parametrize("case", GEMMA4_MOE)
@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_gemma4_experts_as_pebbles_decode_what_its_merged_experts_decode(backend, case):
    """The 26B-A4B's experts out of the store (an entry each, or read out of the merged stacks' entries), through
    caches of none, some and every expert, least recently or least often used, with and without prefetch: the
    logits of the experts kept in their layers, to the bit; every expert a token ran a hit or a miss, the same
    count whatever the cache, and a prefetch guessing as many experts as a token runs per layer."""
    from pyplugin.store import backend_named
    from test_gemma4 import path_of
    from pyplugin.model import load_model
    be = backend_named(backend)
    model = load_model(path_of(case), weights="quantized", progress=False)
    cfg = model.config
    want, stats = gemma4_moe_steps(be.kernels, model)
    assert stats["expert_hits"] == stats["expert_misses"] == 0
    ran = None
    for merged in (False, True):
        store = gemma4_expert_store(be, model, merged)
        first = MERGED if merged else FIRST_EXPERT
        try:
            for cache, policy, prefetch in [(0, "lru", False), (2, "lru", False), (2, "lfu", True),
                                            (cfg.n_expert, "lru", True), (0, "lru", True)]:
                got, stats = gemma4_moe_steps(be.kernels, model, store=store, expert_policy=policy,
                                              expert_prefetch=prefetch,
                                              experts={i: (first, cache) for i in range(cfg.n_layer)})
                np.testing.assert_array_equal(got, want, err_msg=f"{merged} {cache} {policy} {prefetch}")
                used = stats["expert_hits"] + stats["expert_misses"]
                assert ran is None or used == ran
                ran = used
                assert cfg.n_layer * 5 * cfg.n_expert_used <= used <= cfg.n_layer * 5 * 3 * cfg.n_expert_used
                assert stats["expert_guesses"] == (cfg.n_layer * 5 * cfg.n_expert_used if prefetch else 0)
                assert stats["expert_guesses_right"] <= stats["expert_guesses"]
                if cache == cfg.n_expert:  # each expert restored once at most
                    assert stats["expert_misses"] <= cfg.n_layer * cfg.n_expert
        finally:
            store.close()


def test_gemma4_prefetch_guesses_from_the_router_s_own_input():
    """The 26B-A4B's prefetch scores the router on its own input (x normed without a weight, times ffn_gate_inp_s
    over sqrt(n_embd)), not on x normed by ffn_norm: the stub's guesses are the best summed probabilities of that
    input's scores (the native step's are held to the stub's by the tests above: the same hits and misses)."""
    from pyplugin.model import load_model
    from pyplugin.model.moe import router_probabilities
    from pyplugin.model.transformer import rms_norm, router_input
    from pyplugin.store import backend_named
    from pyplugin.store.kernels import DECODER_STATS
    from pyplugin.store.stub_experts import ExpertSlots
    from test_gemma4 import path_of
    be = backend_named("stub")
    model = load_model(path_of("26b-a4b"), progress=False)
    cfg, lw = model.config.for_layer(0), model.resident_layers(be.kernels)[0]
    x = np.random.default_rng(3).standard_normal((3, cfg.n_embd)).astype(np.float32)
    own = rms_norm(x, None, cfg.rms_eps) * (lw.ffn_gate_inp_s / np.float32(np.sqrt(cfg.n_embd)))
    np.testing.assert_array_equal(router_input(cfg, x, lw), own)
    store = gemma4_expert_store(be, model, merged=False)
    try:
        types = {name: getattr(lw, name).qtype for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        slots = ExpertSlots(be.kernels, store, {0: (LayerShape.of(cfg), types, FIRST_EXPERT, 0)}, 0, True,
                            dict.fromkeys(DECODER_STATS, 0))
        slots.prefetch(0, cfg, lw, x, 0)
    finally:
        store.close()
    score = router_probabilities(cfg, own, lw.ffn_gate_inp).sum(0)
    assert slots.guessed == sorted(np.argsort(-score, kind="stable")[:cfg.n_expert_used].tolist())
    by_ffn_norm = router_probabilities(cfg, rms_norm(x, lw.ffn_norm, cfg.rms_eps), lw.ffn_gate_inp).sum(0)
    assert not np.allclose(score, by_ffn_norm)  # the two inputs are told apart


def test_gemma4_refusals_name_what_was_wrong(kernels):
    """A layer reading another's caches that gives K weights or reads a later layer; V = K without V's norm; the
    per-layer embedding's weights without the model's width: refused at creation, by name."""
    from dataclasses import replace
    from test_gemma4 import path_of
    from pyplugin.model import KVCache, load_model
    model = load_model(path_of("e2b"), weights="quantized", progress=False)
    cfg = model.config
    layers = model.resident_layers(kernels)
    kv = KVCache.allocate(cfg, 16, kernels.xp)
    caches = [[pair] for pair in zip(kv.k, kv.v)]
    outer = model.outer_weights(kernels)
    reader = cfg.n_layer - 1

    def refused(match, cfg=cfg, layers=layers):
        with pytest.raises(InvalidArgumentError, match=match):
            kernels.decoder(cfg, layers, caches, outer, 16)

    refused("computes no K or V", layers=[*layers[:reader], replace(layers[reader], wk=layers[cfg.kv_source(reader)].wk)])
    refused("V is K's projection", cfg=replace(cfg, v_norm=False), layers=[replace(layers[0], wv=None), *layers[1:]])
    refused("n_embd_per_layer above 0", cfg=replace(cfg, n_embd_per_layer=0))
    # the 26B-A4B's layer: the parts of a dense FFN beside experts missing there, or given to a layer without it
    moe = load_model(path_of("26b-a4b"), weights="quantized", progress=False)
    moe_layers = moe.resident_layers(kernels)
    moe_kv = KVCache.allocate(moe.config, 16, kernels.xp)
    moe_caches = [[pair] for pair in zip(moe_kv.k, moe_kv.v)]
    moe_outer = moe.outer_weights(kernels)
    with pytest.raises(InvalidArgumentError, match="layer 2: ffn_post_norm_2 must not be NULL: a dense FFN beside "
                                                   "experts"):
        kernels.decoder(moe.config, [*moe_layers[:2], replace(moe_layers[2], ffn_post_norm_2=None), *moe_layers[3:]],
                        moe_caches, moe_outer, 16)
    refused("layer 0: ffn_gate_inp_s is given, but the layer has no dense FFN beside experts",
            layers=[replace(layers[0], ffn_gate_inp_s=layers[0].ffn_norm), *layers[1:]])
    kernels.decoder(cfg, layers, caches, outer, 16).close()  # and the kernels stay usable
    kernels.decoder(moe.config, moe_layers, moe_caches, moe_outer, 16).close()
