"""A GGUF file -> a loaded ``Model``: config, tokenizer, chat template and host weights.

Weights come in one of two forms (``WEIGHT_FORMS``). ``quantized``, the default: every weight matrix
stays as the file's bytes (a ``QuantWeight``), so host memory is the file's size and the forward pass
computes from the quantized bytes. ``f16``: every tensor is expanded once, at load, to float32 on the
host (and to fp16 where it moves to the GPU), for comparison; more memory, the same tokens. Vectors
(norms, biases) are float32 in both. Tensors are read one at a time from the memory-mapped file, so
host memory while loading stays near the size of the loaded weights. phi3's fused tensors (attn_qkv,
gate+up in ffn_up) are split into row views here, so the forward pass sees the same ``LayerWeights``
for every architecture.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from ..errors import ModelError, OptionsError
from ..xp import compute_dtype, to_xp
from .chat import ChatTemplate
from .gguf_file import GGUFFile
from .qweight import QuantWeight
from .tokenizer import Tokenizer
from .arch import ROPE_MODES, arch_fields
from . import gemma4
from .moe import GGUF_NAMES, expert_shapes
from .rope import YARN_FIXED
from .transformer import LayerWeights, ModelConfig, OuterWeights

SUPPORTED_ARCHS = tuple(ROPE_MODES)
RANDOM_WEIGHTS_KEY = "pebbling.random_weights"  # set by pyplugin.synth
_REQUIRED = object()
WEIGHT_FORMS = ("quantized", "f16")  # as the file stores them, or expanded once at load
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")  # {arch}.pooling_type, as llama.cpp numbers them;
# a file without one (a chat model) is pooled by the mean, as Ollama's embeddings of such models are


def check_weight_form(form: str, what: str = "weights") -> str:
    if form not in WEIGHT_FORMS:
        raise OptionsError(f"{what}: got {form!r}; accepted: {', '.join(map(repr, WEIGHT_FORMS))} "
                           "(quantized: weights stay in their GGUF type; f16: expanded once at load)")
    return form


@dataclass
class Model:
    """A loaded model. The layer loop belongs to the caller (see pyplugin.loop)."""

    path: Path
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    layers: list[LayerWeights]          # host weights, one per layer: QuantWeight or float32 numpy
    outer: OuterWeights                 # host weights
    host_bytes: int                     # the weights as loaded here (the tied output counted once)
    metadata: dict[str, Any]            # scalar metadata (the vocabulary and merges left out)
    random_weights: bool = False
    weights: str = "quantized"          # the form of the weights, one of WEIGHT_FORMS
    _converted: dict[str, Any] = field(default_factory=dict, repr=False)

    def release_layers(self) -> None:
        """Drops the host copy of the layers, once something else (a pebble store) holds them."""
        self.layers = []
        self._converted = {k: v for k, v in self._converted.items() if k[0] != "layers"}

    def resident_layers(self, kernels: Any) -> list[LayerWeights]:
        """Every layer on the side of `kernels` (their array module `xp`), converted once and kept (all
        layers resident): matrices in their GGUF form stay so and are computed by `kernels`, arrays go
        to xp's compute type (on the host, the loaded arrays themselves)."""
        if len(self.layers) != self.config.n_layer:
            raise ModelError(f"{self.path}: the layers were handed over to a pebble store; run them "
                             f"through it (pyplugin.runtime.PebbledModel) rather than resident here")
        key = ("layers", kernels)
        if key not in self._converted:
            self._converted[key] = [lw.map(lambda a: _place(a, kernels)) for lw in self.layers]
        return self._converted[key]

    def outer_weights(self, kernels: Any) -> OuterWeights:
        """The outer weights for `kernels`; token_embd stays on the host, where embed gathers its rows (a
        quantized table's decoded on the CPU by the kernels' library)."""
        key = ("outer", kernels)
        if key not in self._converted:
            embd = self.outer.token_embd
            if isinstance(embd, QuantWeight):
                embd = embd.placed(embd.data, kernels)
            per_layer = self.outer.per_layer_token_embd  # Gemma 4's second table: rows gathered on the host too
            if isinstance(per_layer, QuantWeight):
                per_layer = per_layer.placed(per_layer.data, kernels)
            self._converted[key] = OuterWeights(
                embd, _place(self.outer.output_norm, kernels), _place(self.outer.output, kernels), per_layer,
                *(None if a is None else _place(a, kernels)
                  for a in (self.outer.per_layer_model_proj, self.outer.per_layer_proj_norm)))
        return self._converted[key]

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """`extra`: more variables for the template (tools, enable_thinking)."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)


def _place(a: Any, kernels: Any) -> Any:
    """`a` on the side of `kernels`: a QuantWeight computed by them, an array in their compute type."""
    xp = kernels.xp
    return a.to(xp, kernels) if isinstance(a, QuantWeight) else to_xp(a, xp, compute_dtype(xp))


def load_model(path: str | os.PathLike, *, weights: str = "quantized", progress: bool | None = None) -> Model:
    """Load a GGUF file with its weights in the form `weights` (see WEIGHT_FORMS). ``progress``: None
    shows a bar on a terminal when loading takes a while."""
    check_weight_form(weights, "weights")
    path = Path(path)
    with GGUFFile(path) as f:
        cfg = read_config(f)
        f.check_types()
        tokenizer = Tokenizer.from_metadata(f.metadata, str(path))
        if tokenizer.n_vocab != cfg.n_vocab:
            raise ModelError(f"{path}: the tokenizer has {tokenizer.n_vocab} tokens but token_embd "
                             f"has {cfg.n_vocab} rows")
        template = ChatTemplate(f.metadata.get("tokenizer.chat_template"),
                                bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                                origin=str(path))
        with _progress_bar(f, path, progress) as bar:
            def load(name: str) -> np.ndarray | QuantWeight:
                t = f.tensors[name]
                bar.update(t.nbytes)
                stacked = name.endswith(".bias")   # gpt-oss's experts' biases [n_expert, rows]: one vector
                if weights == "quantized" and len(t.shape) >= 2 and not stacked:  # merged experts (3-D): rows
                    return QuantWeight(int(t.qtype), (math.prod(t.shape[:-1]), t.shape[-1]), f.raw(name))
                a = f.dequantize(name)
                return a.ravel() if stacked else a.reshape(-1, a.shape[-1]) if a.ndim > 2 else a
            layers = [_load_layer(f, cfg, i, load) for i in range(cfg.n_layer)]
            outer = _load_outer(f, cfg, load)
        host_bytes = _host_bytes(layers, outer)
        metadata = {k: v for k, v in f.metadata.items() if not isinstance(v, list)}
    name = metadata.get("general.name") or path.stem
    random = bool(metadata.get(RANDOM_WEIGHTS_KEY)) or "random weights" in str(name).lower()
    return Model(path, name, cfg, tokenizer, template, layers, outer, host_bytes, metadata, random, weights)


# ---------------------------------------------------------------------------------------------------
# config


def read_config(f: GGUFFile) -> ModelConfig:
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{f.path}: architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHS)}")

    def value(key: str, default: Any = _REQUIRED) -> Any:
        v = f.metadata.get(f"{arch}.{key}", default)
        if v is _REQUIRED:
            raise ModelError(f"{f.path}: missing metadata key '{arch}.{key}'")
        if isinstance(v, list) and arch == "gemma4" and key in gemma4.PER_LAYER_ARRAYS and v:
            v = v[0]  # the first layer's; ModelConfig.for_layer gives each layer its own
        if isinstance(v, list):
            raise ModelError(f"{f.path}: per-layer values for '{arch}.{key}' are not supported")
        return v

    def integer(key: str, hi: int, default: Any = _REQUIRED, lo: int = 1) -> int:
        v = value(key, default)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
            raise ModelError(f"{f.path}: '{arch}.{key}' is {_shown(v)}; it must be an integer from {lo} to {hi}")
        return int(v)

    def positive(key: str, default: float) -> float:
        v = value(key, default)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ModelError(f"{f.path}: '{arch}.{key}' is {_shown(v)}; it must be a finite number above 0")
        return float(v)

    # Every hyperparameter is checked against what the forward pass needs before anything is sized.
    n_embd, n_head = integer("embedding_length", 1 << 20), integer("attention.head_count", 1 << 14)
    n_head_kv = integer("attention.head_count_kv", n_head, default=n_head)
    if n_head % n_head_kv:
        raise ModelError(f"{f.path}: {n_head} query heads cannot share {n_head_kv} KV heads evenly")
    head_dim = integer("attention.key_length", 1 << 14, default=max(1, n_embd // n_head))
    if integer("attention.value_length", 1 << 14, default=head_dim) != head_dim:
        raise ModelError(f"{f.path}: key and value head sizes differ, which is not supported")
    rope_dims = integer("rope.dimension_count", head_dim, default=head_dim, lo=2)
    if rope_dims % 2:
        raise ModelError(f"{f.path}: '{arch}.rope.dimension_count' is {rope_dims}; RoPE rotates pairs, so it "
                         f"must be even (and at most the head size, {head_dim})")
    token_embd = f.tensors.get("token_embd.weight")
    if token_embd is None or len(token_embd.shape) != 2 or token_embd.shape[0] < 1:
        raise ModelError(f"{f.path}: missing tensor 'token_embd.weight' (a matrix of one row per token)")
    if "rope_factors_long.weight" in f.tensors:
        raise ModelError(f"{f.path}: LongRoPE (rope_factors_long/short, e.g. phi3 128k) is not "
                         "supported; the 4k variants are")
    n_layer = integer("block_count", 1 << 12)
    n_ctx_train = integer("context_length", 1 << 27)
    scaling = _rope_scaling(f, arch, n_ctx_train)
    fields = dict(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_ff=integer("feed_forward_length", 1 << 22),
        n_vocab=token_embd.shape[0], n_ctx_train=n_ctx_train,
        rms_eps=positive("attention.layer_norm_rms_epsilon", 1e-5), rope_mode=ROPE_MODES[arch],
        rope_dims=rope_dims, rope_theta=positive("rope.freq_base", 10000.0),
        rope_freq_factors=_rope_freq_factors(f, rope_dims), **scaling,
        pooling=POOLING_TYPES[integer("pooling_type", len(POOLING_TYPES) - 1, default=1, lo=0)])
    fields.update(arch_fields(f, arch, n_layer, n_embd, n_head, head_dim, positive))
    cfg = ModelConfig(**fields)
    gemma4.check_sharing(f.path, cfg)
    return cfg


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."




def _rope_scaling(f: GGUFFile, arch: str, n_ctx_train: int) -> dict[str, Any]:
    """The ModelConfig fields of the file's RoPE scaling: linear (rope_freq_scale), llama3 (its factors are in
    rope_freqs), or YaRN as llama.cpp computes it: the angles scaled by 1/factor blended back to unscaled
    on the fast-turning pairs (between the dimensions of beta_fast 32 and beta_slow 1 turns in the original
    context), cos and sin times 1 + 0.1 ln(factor) (times rope.scaling.attn_factor where given)."""
    md = f.metadata
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor", 0.0)
    legacy = float(md.get(f"{arch}.rope.scale_linear", 0.0))  # older converters
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor < 0:
        raise ModelError(f"{f.path}: '{arch}.rope.scaling.factor' is {_shown(factor)}; it must be a finite number, "
                         "0 (none) or more")
    if kind != "yarn":
        for key in (*YARN_FIXED, "rope.scaling.attn_factor"):
            if f"{arch}.{key}" in md:
                raise ModelError(f"{f.path}: '{arch}.{key}' with rope scaling {kind!r}: pebbling computes it for "
                                 "YaRN only")
    if kind == "linear" and factor > 0:
        return dict(rope_freq_scale=1.0 / factor)
    if kind in ("none", "linear"):
        return dict(rope_freq_scale=1.0 / legacy if legacy > 0 else 1.0)
    if kind == "llama3" and "rope_freqs.weight" in f.tensors:  # the factors are in rope_freqs
        return dict(rope_freq_scale=1.0)
    if kind == "yarn":
        for key, fixed in YARN_FIXED.items():
            v = md.get(f"{arch}.{key}", fixed)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or float(v) != fixed:
                raise ModelError(f"{f.path}: '{arch}.{key}' is {_shown(v)}; pebbling computes YaRN with beta_fast 32, "
                                 "beta_slow 1, ext_factor 1, yarn_attn_factor 1 and no log multiplier (llama.cpp's "
                                 "defaults)")
        original = md.get(f"{arch}.rope.scaling.original_context_length", n_ctx_train)
        attn = md.get(f"{arch}.rope.scaling.attn_factor", 1.0)
        if isinstance(original, bool) or not isinstance(original, numbers.Integral) or not 1 <= original <= 1 << 27 \
                or isinstance(attn, bool) or not isinstance(attn, numbers.Real) or not math.isfinite(attn) or attn <= 0:
            raise ModelError(f"{f.path}: YaRN's '{arch}.rope.scaling.original_context_length' ({_shown(original)}) must "
                             f"be a positive integer and '{arch}.rope.scaling.attn_factor' ({_shown(attn)}) a finite "
                             "number above 0")
        factor = float(factor) or 1.0
        mscale = (1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0) * float(attn)
        return dict(rope_freq_scale=1.0 / factor, rope_yarn=(1.0, 32.0, 1.0, int(original)), rope_mscale=mscale)
    raise ModelError(f"{f.path}: rope scaling {kind!r} is not supported; supported: none, linear, yarn, and llama3 "
                     "with its rope_freqs tensor")


def _rope_freq_factors(f: GGUFFile, rope_dims: int) -> tuple[float, ...] | None:
    if "rope_freqs.weight" not in f.tensors:
        return None
    factors = f.dequantize("rope_freqs.weight").ravel()
    if factors.size != rope_dims // 2:
        raise ModelError(f"{f.path}: rope_freqs has {factors.size} values, expected {rope_dims // 2}")
    return tuple(float(x) for x in factors)


# ---------------------------------------------------------------------------------------------------
# weights


def _load_layer(f: GGUFFile, cfg: ModelConfig, i: int, load: Callable[[str], Any]) -> LayerWeights:
    def get(tensor: str) -> np.ndarray:
        name = f"blk.{i}.{tensor}"
        if name not in f.tensors:
            raise ModelError(f"{f.path}: missing tensor {name!r} ({cfg.arch})")
        return load(name)

    def optional(tensor: str) -> np.ndarray | None:
        return get(tensor) if f"blk.{i}.{tensor}" in f.tensors else None

    def split(tensor: str, sizes: tuple[int, ...]) -> list[np.ndarray]:
        return _split_rows(get(tensor), sizes, f"{f.path}: blk.{i}.{tensor}")

    if cfg.arch == "gemma4":
        lw = LayerWeights(**gemma4.layer_tensors(f, cfg, i, get, optional))
        _check_shapes(f, cfg.for_layer(i), i, lw)
        return lw
    qkv = (cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim)
    if f"blk.{i}.attn_qkv.weight" in f.tensors:       # phi3: one fused projection, Q then K then V
        wq, wk, wv = split("attn_qkv.weight", qkv)
        has_bias = f"blk.{i}.attn_qkv.bias" in f.tensors
        bq, bk, bv = split("attn_qkv.bias", qkv) if has_bias else (None, None, None)
    else:
        wq, wk, wv = get("attn_q.weight"), get("attn_k.weight"), get("attn_v.weight")
        bq, bk, bv = optional("attn_q.bias"), optional("attn_k.bias"), optional("attn_v.bias")
    experts = {}
    if cfg.n_expert:                                   # a mixture of experts in place of the FFN
        w_gate = w_up = w_down = None
        experts = {field: get(f"{name}.weight") for field, name in GGUF_NAMES.items()
                   if field in expert_shapes(cfg)}
        for tensor in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", *(f"{n}.weight" for n in GGUF_NAMES)):
            if f"blk.{i}.{tensor}" in f.tensors and GGUF_NAMES.get(tensor.removesuffix(".weight")) not in experts:
                raise ModelError(f"{f.path}: tensor 'blk.{i}.{tensor}' is not part of the {cfg.arch} block pebbling "
                                 "computes (a layer of experts); the file is refused rather than the tensor ignored")
    elif f"blk.{i}.ffn_gate.weight" in f.tensors:
        w_gate, w_up, w_down = get("ffn_gate.weight"), get("ffn_up.weight"), get("ffn_down.weight")
    else:                                              # phi3: ffn_up holds gate, then up
        w_gate, w_up = split("ffn_up.weight", (cfg.n_ff, cfg.n_ff))
        w_down = get("ffn_down.weight")
    norms = {field: get(tensor) for tensor, field in _EXTRA_NORMS.items() if cfg.arch in _ARCHS_WITH[field]}
    ffn_norm = "post_attention_norm.weight" if cfg.arch == "gpt-oss" else "ffn_norm.weight"  # before its experts
    for tensor in (*_EXTRA_NORMS, "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", "ffn_norm.weight"):
        if f"blk.{i}.{tensor}" in f.tensors and _EXTRA_NORMS.get(tensor) not in norms and tensor != ffn_norm:
            raise ModelError(f"{f.path}: tensor 'blk.{i}.{tensor}' is not part of the {cfg.arch} block pebbling "
                             "computes; the file is refused rather than the tensor ignored")
    lw = LayerWeights(attn_norm=get("attn_norm.weight"), wq=wq, wk=wk, wv=wv,
                      wo=get("attn_output.weight"), ffn_norm=get(ffn_norm),
                      w_gate=w_gate, w_up=w_up, w_down=w_down, bq=bq, bk=bk, bv=bv, **norms, **experts)
    _check_shapes(f, cfg, i, lw)
    return lw


# The norms some architectures add to the llama block: GGUF tensor -> LayerWeights field, and who has them.
# (and gpt-oss's sinks and biases, its experts' as stacks of vectors)
_EXTRA_NORMS = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
                "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm",
                "attn_sinks.weight": "attn_sinks", "attn_output.bias": "bo", "ffn_gate_inp.bias": "ffn_gate_inp_b",
                "ffn_gate_exps.bias": "ffn_gate_exps_b", "ffn_up_exps.bias": "ffn_up_exps_b",
                "ffn_down_exps.bias": "ffn_down_exps_b"}
_ARCHS_WITH = {"q_norm": ("qwen3", "gemma3", "qwen3moe"), "k_norm": ("qwen3", "gemma3", "qwen3moe"),
               "post_attn_norm": ("gemma2", "gemma3"), "post_ffn_norm": ("gemma2", "gemma3"),
               **dict.fromkeys(("attn_sinks", "bo", "ffn_gate_inp_b", "ffn_gate_exps_b", "ffn_up_exps_b",
                                "ffn_down_exps_b"), ("gpt-oss",))}


def _split_rows(a: np.ndarray | QuantWeight, sizes: tuple[int, ...], what: str) -> list:
    # Views of the fused tensor: no copy, and rows stay contiguous.
    if a.shape[0] != sum(sizes):
        raise ModelError(f"{what}: fused tensor has {a.shape[0]} rows, expected "
                         f"{' + '.join(map(str, sizes))}")
    if isinstance(a, QuantWeight):
        return a.split_rows(sizes)
    return np.split(a, np.cumsum(sizes)[:-1])


def _check_shapes(f: GGUFFile, cfg: ModelConfig, i: int, lw: LayerWeights) -> None:
    q, kv, e, ff = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_embd, cfg.n_ff
    expected = {"attn_norm": (e,), "wq": (q, e), "wk": (kv, e), "wv": (kv, e), "wo": (e, q),
                "ffn_norm": (e,), "w_gate": (ff, e), "w_up": (ff, e), "w_down": (e, ff),
                "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
                "post_attn_norm": (e,), "post_ffn_norm": (e,), "attn_sinks": (cfg.n_head,), "bo": (e,),
                **expert_shapes(cfg), "per_layer_inp_gate": (cfg.n_embd_per_layer, e), "out_scale": (1,),
                "per_layer_proj": (e, cfg.n_embd_per_layer), "per_layer_post_norm": (e,), "ffn_gate_inp_s": (e,),
                "ffn_pre_norm_2": (e,), "ffn_post_norm_1": (e,), "ffn_post_norm_2": (e,), "ffn_down_exps_s": (cfg.n_expert,)}
    for name, a in lw.arrays():
        if tuple(a.shape) != expected[name]:
            raise ModelError(f"{f.path}: layer {i} {name} has shape {a.shape}, expected "
                             f"{expected[name]} from the metadata")


def _load_outer(f: GGUFFile, cfg: ModelConfig, load: Callable[[str], Any]) -> OuterWeights:
    if "output_norm.weight" not in f.tensors:
        raise ModelError(f"{f.path}: missing tensor 'output_norm.weight'")
    token_embd = load("token_embd.weight")
    # Without output.weight the model ties its output projection to the token embedding.
    output = load("output.weight") if "output.weight" in f.tensors else token_embd
    outer = OuterWeights(token_embd, load("output_norm.weight"), output, **gemma4.outer_tensors(f, cfg, load))
    for name, a, shape in (("token_embd", token_embd, (cfg.n_vocab, cfg.n_embd)),
                           ("output", output, (cfg.n_vocab, cfg.n_embd)),
                           ("output_norm", outer.output_norm, (cfg.n_embd,))):
        if tuple(a.shape) != shape:
            raise ModelError(f"{f.path}: {name} has shape {a.shape}, expected {shape}")
    return outer


def _host_bytes(layers: list[LayerWeights], outer: OuterWeights) -> int:
    unique_outer = {id(a): a for a in vars(outer).values() if a is not None}.values()  # a tied output is the embedding
    return sum(lw.nbytes for lw in layers) + sum(a.nbytes for a in unique_outer)


def _progress_bar(f: GGUFFile, path: Path, progress: bool | None) -> tqdm:
    total = sum(t.nbytes for t in f.tensors.values())
    # disable=None: tqdm decides (off when stderr is not a terminal); delay: quick loads show nothing.
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", leave=False,
                disable=None if progress is None else not progress, delay=0.5)
