"""Mixture-of-experts feed-forward blocks, as llama.cpp's build_moe_ffn computes them.

A router (``ffn_gate_inp``, [n_expert, n_embd]) scores every expert for each token; the scores go through
a softmax, the n_expert_used best are chosen (ties to the lower index), their probabilities are
renormalised to sum to 1 where the model says so (qwen3moe and Mixtral-style llama files always; qwen2moe
never; a file's ``expert_weights_norm`` decides where it has one) and scaled by ``expert_weights_scale``
where the file gives one. Mixtral's "top-k, then a softmax over the chosen" is the same arithmetic as the
softmax over all experts renormalised over the chosen. Each chosen expert is a SwiGLU FFN of its own; the
output is the weighted sum. qwen2moe adds a shared expert, a SwiGLU FFN every token runs, times
sigmoid(ffn_gate_inp_shexp . h).

The experts of a layer are stored merged, as the converter writes them: ``ffn_gate_exps`` and
``ffn_up_exps`` [n_expert, n_ff_exp, n_embd], ``ffn_down_exps`` [n_expert, n_embd, n_ff_exp] (numpy
order). They are held as matrices of n_expert * rows rows (the bytes are the same), so that everything
that stores, moves or views a layer's matrices handles them unchanged; expert j is the row range
[j * rows, (j + 1) * rows). A batch of tokens is computed expert by expert, in increasing expert order,
each expert's rows read once for the tokens routed to it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ModelError
from ..xp import get_array_module
from .qweight import QuantWeight

Array = Any

MOE_ARCHS = ("qwen2moe", "qwen3moe", "gpt-oss")       # always experts; a llama file has them where expert_count says so
MOE_KEYS = {"expert_count", "expert_used_count", "expert_feed_forward_length",
            "expert_shared_feed_forward_length", "expert_weights_norm", "expert_weights_scale",
            "expert_gating_func"}
_NORMALISED = {"qwen3moe": True, "llama": True, "qwen2moe": False, "gpt-oss": False, "gemma4": True}  # llama.cpp's choice per architecture
_SOFTMAX_GATING = (0, 1)   # expert_gating_func: 0 none (the architecture's default, a softmax), 1 softmax
# The LayerWeights fields of the experts, and of the shared expert (qwen2moe).
EXPERT_FIELDS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_FIELDS = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
GGUF_NAMES = {name: name for name in EXPERT_FIELDS + SHARED_FIELDS}  # blk.{i}.<name>.weight


def moe_fields(f: Any, arch: str, integer: Callable[..., int]) -> dict[str, Any]:
    """The ModelConfig fields of the experts (none for a dense model), read as llama.cpp reads them.
    `integer(f, key, default, hi)` reads a bounded integer key."""
    md = f.metadata
    n_expert = integer(f, f"{arch}.expert_count", 0, 1 << 12)
    if not n_expert:
        if arch in MOE_ARCHS:
            raise ModelError(f"{f.path}: a {arch} file needs '{arch}.expert_count' of at least 1")
        for key in MOE_KEYS:
            if f"{arch}.{key}" in md and key != "expert_used_count":
                raise ModelError(f"{f.path}: '{arch}.{key}' without experts ('{arch}.expert_count' is 0 or absent)")
        return {}
    if arch not in _NORMALISED:
        raise ModelError(f"{f.path}: '{arch}.expert_count' is {n_expert}: experts in a {arch} file are not "
                         f"computed by pebbling; experts are "
                         f"supported in {', '.join(sorted(_NORMALISED))} files")
    used = integer(f, f"{arch}.expert_used_count", 0, n_expert)
    if used < 1:
        raise ModelError(f"{f.path}: '{arch}.expert_used_count' is {used}; it must be from 1 to {n_expert}")
    n_ff = md.get(f"{arch}.feed_forward_length", 0)
    if arch == "llama":  # Mixtral: every expert is the model's feed_forward_length wide
        n_ff_exp = integer(f, f"{arch}.expert_feed_forward_length", n_ff, 1 << 22)
        if n_ff_exp != n_ff:
            raise ModelError(f"{f.path}: a llama file's experts are feed_forward_length ({n_ff}) wide; "
                             f"'{arch}.expert_feed_forward_length' says {n_ff_exp}")
    else:
        n_ff = n_ff[0] if isinstance(n_ff, list) and n_ff else n_ff  # Gemma 4's may be one per layer
        n_ff_exp = integer(f, f"{arch}.expert_feed_forward_length", max(1, n_ff // used), 1 << 22)
    shared = arch == "qwen2moe"
    n_ff_shexp = integer(f, f"{arch}.expert_shared_feed_forward_length", n_ff, 1 << 22) if shared else 0
    if not shared and f"{arch}.expert_shared_feed_forward_length" in md:
        raise ModelError(f"{f.path}: '{arch}.expert_shared_feed_forward_length': a {arch} model has no shared "
                         "expert; pebbling refuses the key rather than ignore it")
    gating = md.get(f"{arch}.expert_gating_func", 0)
    if gating not in _SOFTMAX_GATING:
        raise ModelError(f"{f.path}: '{arch}.expert_gating_func' is {gating!r}; pebbling computes the softmax "
                         "gating (0 or 1) only")
    norm = md.get(f"{arch}.expert_weights_norm", _NORMALISED[arch])
    scale = md.get(f"{arch}.expert_weights_scale", 0.0)
    if not isinstance(norm, bool) or isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not np.isfinite(scale) or scale < 0:
        raise ModelError(f"{f.path}: '{arch}.expert_weights_norm' ({norm!r}) must be a boolean and "
                         f"'{arch}.expert_weights_scale' ({scale!r}) a finite number, 0 (none) or more")
    return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
                expert_norm=bool(norm), expert_scale=float(scale) if scale else 1.0,
                expert_gating="softmax_chosen" if arch == "gpt-oss" else "softmax")


def expert_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each expert field a layer of `cfg` holds (its merged matrices as row stacks)."""
    if not cfg.n_expert:
        return {}
    e, E, ff = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    shapes = {"ffn_gate_inp": (E, e), "ffn_gate_exps": (E * ff, e), "ffn_up_exps": (E * ff, e),
              "ffn_down_exps": (E * e, ff)}
    if cfg.arch == "gpt-oss":  # the router's and every expert's biases
        shapes.update(ffn_gate_inp_b=(E,), ffn_gate_exps_b=(E * ff,), ffn_up_exps_b=(E * ff,), ffn_down_exps_b=(E * e,))
    if cfg.n_ff_shexp:
        sh = cfg.n_ff_shexp
        shapes.update(ffn_gate_inp_shexp=(e,), ffn_gate_shexp=(sh, e), ffn_up_shexp=(sh, e), ffn_down_shexp=(e, sh))
    return shapes


# ---------------------------------------------------------------------------------------------------
# the forward pass


def _linear(x: Array, w: Array | QuantWeight) -> Array:
    return w.matmul(x) if isinstance(w, QuantWeight) else x @ w.T


def expert_rows(w: Array | QuantWeight, j: int, rows: int) -> Array | QuantWeight:
    """Expert j's matrix of a merged row stack: rows j * rows .. (j + 1) * rows, a view."""
    if isinstance(w, QuantWeight):
        return QuantWeight(w.qtype, (rows, w.shape[1]), w.data[j * rows:(j + 1) * rows], w.kernels)
    return w[j * rows:(j + 1) * rows]


def _rows(fn: Callable[[Array], Array], h: Array, max_rows: int) -> Array:
    """fn over h [T, ...], max_rows rows at a time where above 0 (so that each row is computed as alone
    where the kernels take a few vectors at once: the stub decoder's)."""
    if not max_rows or h.shape[0] <= max_rows:
        return fn(h)
    xp = get_array_module(h)
    return xp.concatenate([fn(h[r:r + max_rows]) for r in range(0, h.shape[0], max_rows)])


def _swiglu(h: Array, gate: Any, up: Any, down: Any, max_rows: int = 0, biases: tuple | None = None,
            oai: bool = False, act: Callable[[Array], Array] | None = None) -> Array:
    """down(act(gate h) * up h), with `biases` (gate, up, down) added to each product where given and
    `oai` choosing gpt-oss's clamped form (swiglu_oai) over SiLU; `act` another gate (Gemma 4's GELU)."""
    if max_rows and h.shape[0] > max_rows:
        return _rows(lambda part: _swiglu(part, gate, up, down, 0, biases, oai, act), h, max_rows)
    xp = get_array_module(h)
    bg, bu, bd = biases or (None, None, None)
    g, u = _linear(h, gate), _linear(h, up)
    if bg is not None:
        g, u = g + bg, u + bu
    if oai:
        g = swiglu_oai(g, u)
    elif act is not None:
        g = act(g)
        g *= u
    else:
        t = -g
        xp.exp(t, out=t)
        t += 1.0
        g = xp.divide(g, t, out=t)
        g *= u
    y = _linear(g, down)
    return y if bd is None else y + bd


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0   # gpt-oss's, as llama.cpp's swiglu_oai has them


def swiglu_oai(g: Array, u: Array) -> Array:
    """gpt-oss's gate: g clamped above at 7, u to [-7, 7]; g * sigmoid(1.702 g) * (u + 1), float32 as GGML's."""
    xp = get_array_module(g)
    g = xp.minimum(g.astype(np.float32, copy=False), np.float32(SWIGLU_OAI_LIMIT))
    u = xp.clip(u.astype(np.float32, copy=False), -np.float32(SWIGLU_OAI_LIMIT), np.float32(SWIGLU_OAI_LIMIT))
    return g / (1.0 + xp.exp(g * -np.float32(SWIGLU_OAI_ALPHA))) * (u + 1.0)


def router_logits(cfg: Any, h: Array, router: Any, max_rows: int = 0, bias: Array | None = None) -> np.ndarray:
    """The router's scores of h [T, n_embd] (normed), its bias added where it has one: [T, n_expert] float32,
    on the host."""
    logits = np.asarray(_to_host(_rows(lambda part: _linear(part, router), h, max_rows)), dtype=np.float32)
    logits = logits.reshape(-1, cfg.n_expert)
    return logits if bias is None else logits + np.asarray(_to_host(bias), dtype=np.float32)


def router_probabilities(cfg: Any, h: Array, router: Any, max_rows: int = 0, bias: Array | None = None) -> np.ndarray:
    """The router's softmax over the experts for h [T, n_embd] (normed): [T, n_expert] float32, on the host."""
    return _softmax(router_logits(cfg, h, router, max_rows, bias))


def _softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p


def route(cfg: Any, h: Array, router: Any, max_rows: int = 0, bias: Array | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, k] in descending probability, their weights [T, k] float32) for h [T, n_embd]."""
    if cfg.expert_gating == "softmax_chosen":  # gpt-oss: the best logits, a softmax over them alone
        logits = router_logits(cfg, h, router, max_rows, bias)
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :cfg.n_expert_used]
        w = _softmax(np.take_along_axis(logits, chosen, -1))
        return chosen, (w * np.float32(cfg.expert_scale)).astype(np.float32)
    p = router_probabilities(cfg, h, router, max_rows, bias)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :cfg.n_expert_used]
    w = np.take_along_axis(p, chosen, -1)
    if cfg.expert_norm:
        w = w / w.sum(-1, keepdims=True)
    if cfg.expert_scale != 1.0:
        w = w * np.float32(cfg.expert_scale)
    return chosen, w.astype(np.float32)


def merged_experts(cfg: Any, lw: Any) -> Callable[[int], tuple]:
    """Expert j's (gate, up, down) as views of the layer's merged matrices."""
    e, ff = cfg.n_embd, cfg.n_ff_exp
    return lambda j: (expert_rows(lw.ffn_gate_exps, j, ff), expert_rows(lw.ffn_up_exps, j, ff),
                      expert_rows(lw.ffn_down_exps, j, e))


def expert_biases(cfg: Any, lw: Any, j: int) -> tuple | None:
    """Expert j's (gate, up, down) biases, views of the layer's stacks; None where it has none (all but gpt-oss)."""
    if lw.ffn_gate_exps_b is None:
        return None
    ff, e = cfg.n_ff_exp, cfg.n_embd
    return (lw.ffn_gate_exps_b[j * ff:(j + 1) * ff], lw.ffn_up_exps_b[j * ff:(j + 1) * ff],
            lw.ffn_down_exps_b[j * e:(j + 1) * e])


def moe_ffn(cfg: Any, h: Array, lw: Any, experts: Callable[[int], tuple] | None = None, max_rows: int = 0,
            act: Callable[[Array], Array] | None = None, router_in: Array | None = None) -> Array:
    """The routed FFN (and the shared expert, where the layer has one) of h [T, n_embd] (normed):
    [T, n_embd] float32. `experts(j)`: expert j's (gate, up, down), asked once per call for each expert
    some token chose, in increasing order (a cache of experts restores it there); default: views of the
    layer's merged matrices. An `experts` with `routed` and `done` methods is told the experts the call
    runs before the first, and when the last has run. `max_rows`: see _rows. `act`: the experts' gate where
    not SiLU (Gemma 4's GELU); `router_in`: what the router scores where not h (Gemma 4's); a layer's
    ffn_down_exps_s (Gemma 4) scales each expert's output."""
    xp = get_array_module(h)
    T, e = h.shape[0], cfg.n_embd
    experts = experts or merged_experts(cfg, lw)
    chosen, weights = route(cfg, h if router_in is None else router_in, lw.ffn_gate_inp, max_rows, lw.ffn_gate_inp_b)
    if lw.ffn_down_exps_s is not None:
        weights = weights * np.asarray(_to_host(lw.ffn_down_exps_s), dtype=np.float32).reshape(-1)[chosen]
    out = xp.zeros((T, e), dtype=np.float32)
    ran = np.unique(chosen)
    if hasattr(experts, "routed"):
        experts.routed(ran)
    for j in ran:                                      # increasing: each token sums its experts in this order
        tokens, slot = np.nonzero(chosen == j)
        y = _swiglu(h[xp.asarray(tokens)], *experts(int(j)), max_rows, expert_biases(cfg, lw, int(j)),
                    cfg.activation == "swiglu_oai", act).astype(np.float32, copy=False)  # [n_j, e]
        out[xp.asarray(tokens)] += y * xp.asarray(weights[tokens, slot])[:, None]
    if hasattr(experts, "done"):
        experts.done()
    if lw.ffn_gate_shexp is not None:
        y = _swiglu(h, lw.ffn_gate_shexp, lw.ffn_up_shexp, lw.ffn_down_shexp, max_rows).astype(np.float32, copy=False)
        gate = (h.astype(np.float32, copy=False) @ lw.ffn_gate_inp_shexp.astype(np.float32, copy=False))  # [T]
        out += y * (1.0 / (1.0 + xp.exp(-gate)))[:, None]
    return out


def _to_host(a: Array) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
