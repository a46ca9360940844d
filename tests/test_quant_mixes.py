"""Files mixed as llama-quantize writes them (synth_mix): the types it gives each matrix by role and layer,
and such files loaded, generating, and counted by the plan at the bytes the file stores.

The native backends run the llama mixes with every strategy in test_quantized_residency (its MODELS); here,
on the stub, each mix once through the store (MXFP4_MOE's experts too), and MXFP4_MOE on every backend with
its experts streamed.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from helpers import MIX_ARCHS, MIX_SHAPES, mix_overrides, store_backend_params, tiny_model, tiny_path, tiny_spec
from pyplugin.model.synth_mix import quantize_mix
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

PROMPT = [5, 17, 42, 8, 99, 3, 61]
OPTIONS = Options(temperature=0, num_predict=6, num_ctx=32, num_batch=16)

# The types each mix's file holds in its matrices (helpers.MIX_SHAPES: shapes that let the rules show).
TYPES = {"Q3_K_M": {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}, "Q2_K": {"Q2_K", "Q3_K", "Q4_K", "Q6_K"},
         "IQ4_XS": {"IQ4_XS", "IQ4_NL", "Q5_1", "Q6_K"}, "MXFP4_MOE": {"Q8_0", "MXFP4", "F32"}}  # F32: the router


def test_the_mixes_give_each_matrix_llama_quantizes_type():
    q3 = quantize_mix(tiny_spec("llama", **MIX_SHAPES["Q3_K_M"]), "Q3_K_M").tensor_types
    assert [q3[f"blk.{i}.attn_v"] for i in range(4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert [q3[f"blk.{i}.ffn_down"] for i in range(3)] == ["Q5_K", "Q4_K", "Q4_K"]
    assert {q3[f"blk.{i}.{t}"] for i in range(16) for t in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == {"Q3_K"}
    assert {q3[f"blk.{i}.attn_output"] for i in range(16)} == {"Q4_K"}
    assert (q3["output"], q3["token_embd"]) == ("Q6_K", "Q3_K")

    def q2(n_head_kv):
        return quantize_mix(tiny_spec("llama", **dict(MIX_SHAPES["Q2_K"], n_head_kv=n_head_kv)), "Q2_K").tensor_types
    assert (q2(1)["blk.0.attn_v"], q2(2)["blk.0.attn_v"]) == ("Q4_K", "Q3_K")
    assert {q2(2)[f"blk.0.{t}"] for t in ("attn_output", "ffn_down")} == {"Q3_K"}
    assert q2(2)["blk.0.attn_q"] == "Q2_K"

    xs = quantize_mix(tiny_spec("llama", **MIX_SHAPES["IQ4_XS"]), "IQ4_XS").tensor_types
    assert [xs[f"blk.{i}.ffn_down"] for i in range(3)] == ["Q5_1", "IQ4_NL", "IQ4_NL"]  # 320-value rows
    assert xs["blk.0.attn_v"] == xs["blk.0.ffn_up"] == "IQ4_XS" and xs["output"] == "Q6_K"
    narrow = quantize_mix(tiny_spec("llama", n_embd=64, n_ff=128), "IQ4_XS")  # no row is whole 256-value blocks
    assert narrow.weight_type == "IQ4_NL" and narrow.tensor_types["output"] == "Q8_0"
    assert set(narrow.tensor_types.values()) == {"IQ4_NL", "Q8_0"}

    moe = quantize_mix(tiny_spec("qwen3moe", n_embd=64, n_expert=4, n_ff_exp=64, key_length=32), "MXFP4_MOE")
    assert moe.tensor_types["blk.0.ffn_down_exps"] == "MXFP4" and moe.tensor_types["blk.0.attn_v"] == "Q8_0"
    assert moe.tensor_types["output"] == moe.tensor_types["token_embd"] == "Q8_0"
    with pytest.raises(ValueError, match="mix 'Q4_K_XL': choose one of Q2_K, Q3_K_M, IQ4_XS, MXFP4_MOE"):
        quantize_mix(tiny_spec("llama"), "Q4_K_XL")


@pytest.mark.parametrize("mix", list(MIX_SHAPES))
def test_a_mixed_file_generates_the_f16_tokens_and_the_plan_counts_the_bytes_it_stores(mix):
    arch, overrides = MIX_ARCHS.get(mix, "llama"), mix_overrides(mix)
    reader = GGUFReader(tiny_path(arch, **overrides))
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}  # matrices and merged experts
    assert types == TYPES[mix]
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}

    model = tiny_model(arch, weights="quantized", **overrides)
    assert model.host_bytes == sum(file_bytes.values())
    pebbled = PebbledModel(model, backend="stub")
    try:
        # every layer's weights as the file stores them (its norms are F32 there, float32 on the stub), each
        # entry in whole 256-byte units of the store; the output matrix as stored too
        memory = pebbled.memory_model(OPTIONS, len(PROMPT))
        for i in range(model.config.n_layer):
            stored = [n for name, n in file_bytes.items() if name.startswith(f"blk.{i}.")]
            assert sum(t.nbytes for t in pebbled.layouts[i]) == sum(stored)
            assert memory.layer_weight_bytes[i] == sum(-(-n // 256) * 256 for n in stored)
        assert pebbled.outer.output.nbytes == file_bytes["output.weight"]
        # greedy tokens with every layer streamed through the store: those of the weights expanded at load
        pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
        tokens = list(pebbled.generation(OPTIONS, pebbling, len(PROMPT)).tokens(PROMPT))
        f16 = list(Generation(tiny_model(arch, weights="f16", **overrides), OPTIONS).tokens(PROMPT))
        assert len(tokens) == OPTIONS.num_predict and tokens == f16
        assert np.unique(tokens).size > 1  # a model that says one thing over and over would hide a wrong layer
    finally:
        pebbled.close()


@pytest.mark.parametrize("backend", store_backend_params())
def test_mxfp4_experts_streamed_through_slots_decode_the_tokens_of_experts_kept(backend):
    """MXFP4_MOE on each backend: the experts (MXFP4) restored into the decoder's expert slots one at a time
    (no cache), and every layer streamed under minimal, give the tokens of the same backend with everything
    resident."""
    overrides = mix_overrides("MXFP4_MOE")
    model = tiny_model(MIX_ARCHS["MXFP4_MOE"], weights="quantized", **overrides)
    pebbled = PebbledModel(model, backend=backend)

    def tokens(prompt, **options):
        gen = pebbled.generation(OPTIONS, PebblingOptions.from_options(options), len(prompt))
        return list(gen.tokens(prompt))
    try:
        resident = tokens(PROMPT, pebbling_strategy="none")
        assert len(resident) == OPTIONS.num_predict and np.unique(resident).size > 1
        for options in ({"pebbling_strategy": "none", "pebbling_expert_cache": 0},
                        {"pebbling_strategy": "minimal"},
                        {"pebbling_strategy": "minimal", "pebbling_expert_cache": 1}):
            assert tokens(PROMPT, **options) == resident, options
    finally:
        pebbled.close()
