"""Gemma 4 (``gemma4`` in GGUF) as llama.cpp computes it, beside the Gemma block of gemma2/gemma3.

What it adds: sliding layers with a head size, rotated dims and RoPE base of their own, full layers whose
RoPE is "proportional" (the file's rope_freqs divides the angles, 1e30 leaving a dim unrotated); KV heads and
FFN widths per layer where the file gives arrays; V normed without a weight, and on a full layer without
attn_v, V the keys' projection itself (before K's norm); no scaling of q (its norm does that); the last
shared_kv_layers layers computing no K or V and reading the caches of the last earlier layer of their kind;
per-layer embeddings (E2B, E4B): a second table of n_layer * n_embd_per_layer per token, mixed with a
projection of the scaled embedding (per_layer_inputs) and added after each layer through a GELU gate and a
projection; a scalar on each layer's output; in the 26B-A4B a dense FFN beside 128 GELU experts, the router
scoring x normed without a weight, over sqrt(n_embd), times its scale, and each expert's output times a scale
of its own. The forward pass (transformer.py) computes these where the weights have them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import numpy as np

from ..errors import ModelError
from ..xp import get_array_module
from .gguf_file import drop_file_pages
from .qweight import QuantWeight
from .transformer import linear, rms_norm, table_rows

Array = Any

# The keys a gemma4 file adds to the Gemma block's (read here).
KEYS = {"attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa",
        "attention.shared_kv_layers", "embedding_length_per_layer_input"}
PER_LAYER_ARRAYS = ("feed_forward_length", "attention.head_count_kv")  # an integer, or one per layer


def config_fields(f: Any, n_layer: int, n_embd: int, head_dim: int, rope_dims: int, n_head: int,
                  positive: Callable[[str, float], float]) -> dict[str, Any]:
    """The ModelConfig fields of a gemma4 file beyond the llama block's (arch.arch_fields adds the Gemmas')."""
    md, arch = f.metadata, "gemma4"

    def integer(key: str, default: int, lo: int = 0, hi: int = 1 << 20) -> int:
        v = md.get(f"{arch}.{key}", default)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
            raise ModelError(f"{f.path}: '{arch}.{key}' is {v!r}; it must be an integer from {lo} to {hi}")
        return int(v)

    if not isinstance(md.get(f"{arch}.attention.sliding_window_pattern"), list):
        raise ModelError(f"{f.path}: a gemma4 file gives '{arch}.attention.sliding_window_pattern' as one true/false "
                         "per layer (which layers slide)")
    if not md.get(f"{arch}.attention.sliding_window"):
        raise ModelError(f"{f.path}: a gemma4 file needs '{arch}.attention.sliding_window' (its sliding layers' window)")
    head_dim_swa = integer("attention.key_length_swa", head_dim, 1)
    if integer("attention.value_length_swa", head_dim_swa, 1) != head_dim_swa:
        raise ModelError(f"{f.path}: the sliding layers' key and value head sizes differ, which is not supported")
    rope_dims_swa = integer("rope.dimension_count_swa", rope_dims, 2)
    if rope_dims_swa % 2 or rope_dims_swa > head_dim_swa:
        raise ModelError(f"{f.path}: '{arch}.rope.dimension_count_swa' is {rope_dims_swa}; it must be even and at most "
                         f"the sliding layers' head size, {head_dim_swa}")
    shared = integer("attention.shared_kv_layers", 0, 0, n_layer - 1)
    out = dict(head_dim_swa=head_dim_swa, rope_dims_swa=rope_dims_swa, n_layer_kv=n_layer - shared if shared else 0,
               v_norm=True, n_embd_per_layer=integer("embedding_length_per_layer_input", 0),
               attn_scale=1.0, rope_theta_swa=positive("rope.freq_base_swa", 10000.0))  # llama.cpp's default, not
    # the full layers' base
    for key, field in zip(PER_LAYER_ARRAYS, ("n_ff_layers", "n_head_kv_layers")):
        v = md.get(f"{arch}.{key}")
        if isinstance(v, list):
            if len(v) != n_layer or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x > 0
                                            for x in v):
                raise ModelError(f"{f.path}: '{arch}.{key}' has {len(v)} values; it must be one integer above 0 per "
                                 f"layer ({n_layer})")
            out[field] = tuple(int(x) for x in v)
    for n in out.get("n_head_kv_layers", ()):
        if n_head % n:
            raise ModelError(f"{f.path}: {n_head} query heads cannot share {n} KV heads evenly")
    return out


def per_layer_value(f: Any, key: str) -> int:
    """The first layer's value of a key a gemma4 file may give per layer (the config's own; for_layer the rest)."""
    v = f.metadata.get(f"gemma4.{key}")
    return v[0] if isinstance(v, list) and v else v


def check_sharing(path: Any, cfg: Any) -> None:
    """Every layer that reads another's caches reads a layer of its own kind and shape, as llama.cpp assumes."""
    for i in range(cfg.n_layer):
        src = cfg.kv_source(i)
        if src == i:
            continue
        a, b = cfg.for_layer(i), cfg.for_layer(src)
        if src < 0 or cfg.is_sliding(i) != cfg.is_sliding(src) or (a.head_dim, a.n_head_kv) != (b.head_dim, b.n_head_kv):
            raise ModelError(f"{path}: layer {i} reads the caches of layer {src} (the last {cfg.n_layer - cfg.n_layer_kv} "
                             "layers share earlier layers' caches), which is not a layer of its kind and shape")


# ---------------------------------------------------------------------------------------------------
# weights


def layer_tensors(f: Any, cfg: Any, i: int, get: Callable[[str], Any], optional: Callable[[str], Any]) -> dict[str, Any]:
    """Layer i's LayerWeights fields, as a gemma4 file names them; any tensor of the layer not read is refused."""
    lcfg, b = cfg.for_layer(i), f"blk.{i}."
    reader = lcfg.kv_from >= 0
    w = dict(attn_norm=get("attn_norm.weight"), wq=get("attn_q.weight"), wo=get("attn_output.weight"),
             q_norm=get("attn_q_norm.weight"), post_attn_norm=get("post_attention_norm.weight"),
             ffn_norm=get("ffn_norm.weight"), post_ffn_norm=get("post_ffw_norm.weight"),
             w_gate=get("ffn_gate.weight"), w_up=get("ffn_up.weight"), w_down=get("ffn_down.weight"),
             out_scale=optional("layer_output_scale.weight"),
             wk=None if reader else get("attn_k.weight"), wv=None if reader else optional("attn_v.weight"),
             k_norm=None if reader else get("attn_k_norm.weight"))
    read = {"attn_norm", "attn_q", "attn_output", "attn_q_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
            "ffn_gate", "ffn_up", "ffn_down", "layer_output_scale", "attn_k", "attn_v", "attn_k_norm"}
    if cfg.n_embd_per_layer:
        w.update(per_layer_inp_gate=get("inp_gate.weight"), per_layer_proj=get("proj.weight"),
                 per_layer_post_norm=get("post_norm.weight"))
        read |= {"inp_gate", "proj", "post_norm"}
    if f"{b}ffn_gate_inp.weight" in f.tensors:
        if not cfg.n_expert:
            raise ModelError(f"{f.path}: layer {i} has a router (ffn_gate_inp) but the file declares no experts")
        w.update(ffn_gate_inp=get("ffn_gate_inp.weight"), ffn_gate_inp_s=get("ffn_gate_inp.scale"),
                 ffn_pre_norm_2=get("pre_ffw_norm_2.weight"), ffn_post_norm_1=get("post_ffw_norm_1.weight"),
                 ffn_post_norm_2=get("post_ffw_norm_2.weight"), ffn_down_exps=get("ffn_down_exps.weight"),
                 ffn_down_exps_s=optional("ffn_down_exps.scale"))
        if f"{b}ffn_gate_up_exps.weight" in f.tensors:  # each expert's gate rows, then its up rows
            w["ffn_gate_exps"], w["ffn_up_exps"] = split_gate_up(get("ffn_gate_up_exps.weight"), cfg.n_expert, cfg.n_ff_exp)
        else:
            w.update(ffn_gate_exps=get("ffn_gate_exps.weight"), ffn_up_exps=get("ffn_up_exps.weight"))
        read |= {"ffn_gate_inp", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2", "ffn_gate_up_exps",
                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    elif cfg.n_expert:
        raise ModelError(f"{f.path}: layer {i} has no router (blk.{i}.ffn_gate_inp.weight) though the file declares "
                         f"{cfg.n_expert} experts")
    for name in f.tensors:
        if name.startswith(b) and name[len(b):].rsplit(".", 1)[0] not in read:
            raise ModelError(f"{f.path}: tensor {name!r} is not part of the gemma4 block pebbling computes; the file is "
                             "refused rather than the tensor ignored")
    return w


def split_gate_up(a: Any, n_expert: int, n_ff: int) -> tuple[Any, Any]:
    """A merged [n_expert, 2 n_ff, n_embd] gate-and-up stack as two [n_expert * n_ff, n_embd] stacks (copies; the
    file's pages of the merged one dropped after, so that its bytes are held once)."""
    rows = np.arange(n_expert * 2 * n_ff).reshape(n_expert, 2, n_ff)
    gate, up = rows[:, 0].ravel(), rows[:, 1].ravel()
    if isinstance(a, QuantWeight):
        split = (QuantWeight(a.qtype, (gate.size, a.shape[1]), np.ascontiguousarray(a.data[gate])),
                 QuantWeight(a.qtype, (up.size, a.shape[1]), np.ascontiguousarray(a.data[up])))
        drop_file_pages(a.data)  # the file's pages of the merged tensor, read once here: not held twice
        return split
    return np.ascontiguousarray(a[gate]), np.ascontiguousarray(a[up])


def outer_tensors(f: Any, cfg: Any, load: Callable[[str], Any]) -> dict[str, Any]:
    """The per-layer embeddings' OuterWeights fields (none where the file has none)."""
    if not cfg.n_embd_per_layer:
        for name in ("per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"):
            if name in f.tensors:
                raise ModelError(f"{f.path}: tensor {name!r} without '{cfg.arch}.embedding_length_per_layer_input'")
        return {}
    names = {"per_layer_token_embd": "per_layer_token_embd.weight", "per_layer_model_proj": "per_layer_model_proj.weight",
             "per_layer_proj_norm": "per_layer_proj_norm.weight"}
    for name in names.values():
        if name not in f.tensors:
            raise ModelError(f"{f.path}: missing tensor {name!r} (a gemma4 file's per-layer embeddings)")
    out = {field: load(name) for field, name in names.items()}
    pl, e = cfg.n_layer * cfg.n_embd_per_layer, cfg.n_embd
    for field, shape in (("per_layer_token_embd", (cfg.n_vocab, pl)), ("per_layer_model_proj", (pl, e)),
                         ("per_layer_proj_norm", (cfg.n_embd_per_layer,))):
        if tuple(out[field].shape) != shape:
            raise ModelError(f"{f.path}: {field} has shape {tuple(out[field].shape)}, expected {shape}")
    return out


# ---------------------------------------------------------------------------------------------------
# the forward pass


def per_layer_inputs(cfg: Any, outer: Any, tokens: Any, x: Array) -> Array | None:
    """Each layer's per-layer input for `tokens` whose scaled embeddings are x [T, n_embd]: [T, n_layer,
    n_embd_per_layer], as llama.cpp's project_per_layer_inputs computes it: the projection of x over sqrt(n_embd),
    normed, plus the token's row of the per-layer table times sqrt(n_embd_per_layer), all over sqrt(2). None for
    a model without them."""
    if outer.per_layer_token_embd is None:
        return None
    xp, T, n = get_array_module(x), x.shape[0], cfg.n_embd_per_layer
    rows = table_rows(outer.per_layer_token_embd, tokens, xp, math.sqrt(n), x.dtype).reshape(T, cfg.n_layer, n)
    proj = linear(x, outer.per_layer_model_proj) * np.float32(1.0 / math.sqrt(cfg.n_embd))
    proj = rms_norm(proj.reshape(T, cfg.n_layer, n), outer.per_layer_proj_norm, cfg.rms_eps)
    return ((proj + rows) * np.float32(1.0 / math.sqrt(2.0))).astype(x.dtype, copy=False)

