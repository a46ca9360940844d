"""What each architecture adds to the llama block, read from its GGUF metadata as llama.cpp reads it.

qwen3 (and qwen3moe): per-head Q/K RMS norms, no QKV biases, a head size of its own (``attention.key_length``).
gemma2 / gemma3 (and gemma4, with what pyplugin.model.gemma4 adds): the embedding scaled by sqrt(n_embd), norms after attention and after the FFN, a
GELU-tanh gate, sliding-window layers (every ``sliding_window_pattern``-th layer global: 2 for gemma2,
6 for gemma3, or a per-layer array) with their own RoPE base, an attention scale from the head size
(from n_embd / n_head on the 27B models, as llama.cpp has it), gemma2's soft-capping. llama: Mistral's
sliding window and Granite's scales where the file declares them. Mixture-of-experts (qwen3moe, qwen2moe,
Mixtral-style llama files with ``expert_count``): see pyplugin.model.moe. gpt-oss: experts with biases, a
clamped SwiGLU and a softmax over the chosen experts' logits (moe.py), a learned sink logit per head in the
attention's softmax (attention.py), a bias on the output projection, every other layer sliding (pattern
2), YaRN as the file declares it, its own sliding base where the file gives one.

Any other key under the architecture's prefix is refused by name unless it is known not to change
what the model computes: a file that asks for math pebbling does not do fails to load, it never runs
as something else.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ModelError
from . import gemma4
from .moe import MOE_KEYS, moe_fields
from .rope import YARN_FIXED
from .transformer import ROPE_NEOX, ROPE_NORMAL

ROPE_MODES = {"llama": ROPE_NORMAL, "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX, "phi3": ROPE_NEOX,
              "gemma2": ROPE_NEOX, "gemma3": ROPE_NEOX, "qwen2moe": ROPE_NEOX, "qwen3moe": ROPE_NEOX,
              "gpt-oss": ROPE_NEOX, "gemma4": ROPE_NEOX}
GEMMAS = ("gemma2", "gemma3", "gemma4")
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}     # llama.cpp's period when the file gives no pattern
_BIG_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: q scaled by n_embd / n_head

# Keys read by load.read_config or here, and keys that change nothing pebbling computes.
_READ = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
         "attention.head_count_kv", "attention.key_length", "attention.value_length",
         "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base", "rope.scaling.type",
         "rope.scaling.factor", "rope.scale_linear", "pooling_type", "vocab_size", "attention.scale",
         "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
         "rope.local.freq_base", "rope.global.freq_base", "attn_logit_softcapping", "final_logit_softcapping",
         "embedding_scale", "residual_scale", "logit_scale", "rope.scaling.original_context_length",
         "rope.scaling.attn_factor", *YARN_FIXED, *MOE_KEYS}
_HARMLESS = {"rope.scaling.finetuned", "tensor_data_layout",
             "mm.tokens_per_image"}
_HARMLESS_PREFIXES = ("vision.", "mm.")      # a multimodal file's vision tower: its text model is what runs


def check_keys(f: Any, arch: str) -> None:
    """Refuses a key under `arch.` that may change the math and that pebbling does not compute."""
    prefix = f"{arch}."
    for key, value in f.metadata.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name in _READ or name.startswith(_HARMLESS_PREFIXES) or (arch == "gemma4" and name in gemma4.KEYS):
            continue
        if name in _HARMLESS:
            continue
        raise ModelError(f"{f.path}: metadata key '{key}' may change what the model computes and pebbling does "
                         f"not implement it; a {arch} file is accepted with: "
                         f"{', '.join(sorted(prefix + k for k in _READ))}")


def arch_fields(f: Any, arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int,
                positive: Callable[[str, float], float]) -> dict[str, Any]:
    """The ModelConfig fields beyond the llama block's, for `arch`."""
    check_keys(f, arch)
    out: dict[str, Any] = moe_fields(f, arch, _integer)
    if f"{arch}.attention.scale" in f.metadata:
        out["attn_scale"] = positive("attention.scale", 1.0)
    window = _integer(f, f"{arch}.attention.sliding_window", 0, 1 << 27)
    if window:
        out["sliding_window"] = window
        out["swa_layers"] = _sliding_layers(f, arch, n_layer)
    if arch == "gpt-oss":  # its experts' clamped SwiGLU; the router's choice and sinks: moe.py, attention.py
        if "sliding_window" not in out:
            raise ModelError(f"{f.path}: a gpt-oss file needs '{arch}.attention.sliding_window' (its sliding layers' "
                             "window; 128 in the released models)")
        out["activation"] = "swiglu_oai"
    if arch in GEMMAS:
        out["activation"] = "gelu"
        out["embd_scale"] = math.sqrt(n_embd)
        big = n_layer == _BIG_GEMMA_LAYERS.get(arch)
        out["attn_scale"] = 1.0 / math.sqrt(n_embd // n_head if big else head_dim)  # Gemma 4: 1 (gemma4.py)
        base = f.metadata.get(f"{arch}.rope.global.freq_base")   # Ollama's converter's names
        if base is not None:
            out["rope_theta"] = positive("rope.global.freq_base", 1e6)
        if arch == "gemma3":  # local layers: their own base, never scaled
            local = "rope.local.freq_base" if f"{arch}.rope.local.freq_base" in f.metadata else "rope.freq_base_swa"
            out["rope_theta_swa"] = positive(local, 10000.0)
            out["rope_freq_scale_swa"] = 1.0
        elif f"{arch}.rope.freq_base_swa" in f.metadata:
            out["rope_theta_swa"] = positive("rope.freq_base_swa", 10000.0)
        if arch == "gemma2":  # always capped: llama.cpp's defaults where the file does not say (Gemma 2's own)
            out["attn_softcap"] = _cap(f, arch, "attn_logit_softcapping", 50.0)
            out["final_softcap"] = _cap(f, arch, "final_logit_softcapping", 30.0)
        else:  # Gemma 4 too keeps llama.cpp's default cap of 30 where the file gives none (gemma3 resets it to 0)
            out["final_softcap"] = _cap(f, arch, "final_logit_softcapping", 30.0 if arch == "gemma4" else 0.0)
        if arch == "gemma4":
            rope_dims = f.metadata.get(f"{arch}.rope.dimension_count", head_dim)
            out.update(gemma4.config_fields(f, n_layer, n_embd, head_dim, rope_dims, n_head, positive))
    else:
        if arch == "gpt-oss" and f"{arch}.rope.freq_base_swa" in f.metadata:  # the sliding layers' base, YaRN kept
            out["rope_theta_swa"] = positive("rope.freq_base_swa", 150000.0)
        for key in ("attn_logit_softcapping", "final_logit_softcapping",
                    *(() if arch == "gpt-oss" else ("rope.freq_base_swa",)),
                    "rope.local.freq_base", "rope.global.freq_base"):
            if f"{arch}.{key}" in f.metadata:
                raise ModelError(f"{f.path}: '{arch}.{key}' is not part of the {arch} architecture as "
                                 "llama.cpp computes it; pebbling refuses it rather than ignore it")
        if arch == "llama":  # Granite's scales, where a llama file carries them
            out["embd_scale"] = positive("embedding_scale", 1.0)
            out["residual_scale"] = positive("residual_scale", 1.0)
            out["logit_scale"] = 1.0 / positive("logit_scale", 1.0)
        else:
            for key in ("embedding_scale", "residual_scale", "logit_scale"):
                if f"{arch}.{key}" in f.metadata:
                    raise ModelError(f"{f.path}: '{arch}.{key}' is not part of the {arch} architecture; "
                                     "pebbling refuses it rather than ignore it")
    return out


def _integer(f: Any, key: str, default: int, hi: int) -> int:
    v = f.metadata.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise ModelError(f"{f.path}: '{key}' is {v!r}; it must be an integer from 0 to {hi}")
    return int(v)


def _cap(f: Any, arch: str, name: str, default: float) -> float:
    v = f.metadata.get(f"{arch}.{name}", default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ModelError(f"{f.path}: '{arch}.{name}' is {v!r}; it must be a finite number, 0 (none) or more")
    return float(v)


def _sliding_layers(f: Any, arch: str, n_layer: int) -> tuple[int, ...]:
    """The sliding layers: a per-layer array of the file, else every layer but each period's last
    (llama.cpp's set_swa_pattern); a llama file's window covers every layer (Mistral)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = f.metadata.get(key)
    if isinstance(pattern, list):
        if len(pattern) != n_layer or not all(isinstance(p, (bool, int)) for p in pattern):
            raise ModelError(f"{f.path}: '{key}' has {len(pattern)} values; it must give one true/false per "
                             f"layer ({n_layer})")
        return tuple(i for i, p in enumerate(pattern) if p)
    period = _integer(f, key, _SWA_PERIOD.get(arch, 0), 1 << 12)
    if period == 0:
        return tuple(range(n_layer))
    return tuple(i for i in range(n_layer) if i % period < period - 1)
