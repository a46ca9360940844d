"""A model's shape and the constants its forward pass needs (``ModelConfig``), and the config each layer
computes with (``ModelConfig.for_layer``): its window and RoPE where it slides, and, in a Gemma 4 file, its own
head size, KV heads, FFN width and the earlier layer whose caches it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model and the constants its forward pass needs."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_mode: str                      # ROPE_NORMAL (llama) or ROPE_NEOX (qwen2, phi3)
    rope_dims: int                      # leading dims of each head that are rotated
    rope_theta: float = 10000.0
    rope_freq_scale: float = 1.0        # 1 / linear scaling factor
    rope_freq_factors: tuple[float, ...] | None = None  # llama3-style per-frequency divisors
    rope_yarn: tuple[float, float, float, int] | None = None  # YaRN's (ext_factor, beta_fast, beta_slow,
                                        # original context): rope_freq_scale blended back to unscaled
                                        # on the fast-turning pairs
    rope_mscale: float = 1.0            # multiplies cos and sin (YaRN's 1 + 0.1 ln(factor))
    attn_scale: float | None = None     # multiplies q before the dot products; None: 1/sqrt(head_dim)
    pooling: str = "mean"               # how embeddings pool the hidden states: mean, cls, last, none, rank
    activation: str = "silu"            # the FFN's gate: "silu" (SwiGLU), "gelu" (GELU-tanh, the Gemmas) or
                                        # "swiglu_oai" (gpt-oss's clamped SwiGLU: moe.swiglu_oai)
    embd_scale: float = 1.0             # multiplies the token embedding (sqrt(n_embd) for the Gemmas)
    residual_scale: float = 1.0         # multiplies each block's output before it joins the residual (Granite)
    logit_scale: float = 1.0            # multiplies the logits (1 / Granite's logit_scale)
    attn_softcap: float = 0.0           # scores -> c * tanh(scores / c) when above 0 (gemma2)
    final_softcap: float = 0.0          # logits -> c * tanh(logits / c) when above 0 (gemma2)
    sliding_window: int = 0             # positions a sliding layer attends to, itself included; 0: none
    swa_layers: tuple[int, ...] = ()    # the sliding layers
    rope_theta_swa: float | None = None  # the sliding layers' RoPE base; None: rope_theta
    rope_freq_scale_swa: float | None = None  # ... and linear scale; None: rope_freq_scale
    window: int = 0                     # this layer's window (set by ``for_layer``); 0: full attention
    n_expert: int = 0                   # experts of each layer's FFN (pyplugin.model.moe); 0: a dense FFN
    n_expert_used: int = 0              # experts each token runs
    n_ff_exp: int = 0                   # an expert's hidden size
    n_ff_shexp: int = 0                 # the shared expert's hidden size (qwen2moe); 0: none
    expert_norm: bool = False           # the chosen experts' weights renormalised to sum to 1
    expert_scale: float = 1.0           # ... then multiplied by this
    expert_gating: str = "softmax"      # "softmax": over every expert's score; "softmax_chosen" (gpt-oss): the
                                        # best by the router's logits, a softmax over the chosen
    # Gemma 4 (pyplugin.model.gemma4): the sliding layers' head size and rotated dims, a per-layer count of KV
    # heads and FFN width where the file gives arrays, the first layer that keeps no cache of its own
    # (0: every layer keeps one), V normed without a weight, and the per-layer embeddings' width.
    head_dim_swa: int = 0               # 0: head_dim
    rope_dims_swa: int = 0              # 0: rope_dims
    n_head_kv_layers: tuple[int, ...] = ()  # per layer; (): n_head_kv everywhere
    n_ff_layers: tuple[int, ...] = ()   # per layer; (): n_ff everywhere
    n_layer_kv: int = 0                 # layers from here on read an earlier layer's caches (kv_source)
    v_norm: bool = False                # V rows RMS-normed without a weight before they are cached
    n_embd_per_layer: int = 0           # the per-layer embeddings' width; 0: none
    kv_from: int = -1                   # set by ``for_layer``: the layer whose caches this one reads; -1: its own

    @property
    def n_group(self) -> int:
        """Query heads that share one KV head."""
        return self.n_head // self.n_head_kv

    @property
    def query_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """K and V of one token in one layer (the config's own: ``for_layer(i)`` gives layer i's)."""
        return 2 * self.n_head_kv * self.head_dim * itemsize

    def kv_token_bytes(self, i: int, row_bytes) -> int:
        """K and V of one token in layer i's own caches, `row_bytes(head_dim)` a head's row in the KV type (0 in a
        layer that reads another's caches)."""
        c = self.for_layer(i)
        return 2 * c.n_head_kv * row_bytes(c.head_dim) if self.owns_kv(i) else 0

    def kv_source(self, i: int) -> int:
        """The layer whose caches layer i reads: i itself, or in a Gemma 4 file sharing its caches the last layer
        of i's kind (sliding or not) before n_layer_kv, as llama.cpp picks it."""
        if not self.n_layer_kv or i < self.n_layer_kv:
            return i
        return self.n_layer_kv - (2 if self.is_sliding(i) else 1)

    def owns_kv(self, i: int) -> bool:
        """Whether layer i keeps caches of its own (a layer that reads another's keeps none)."""
        return self.kv_source(i) == i

    @property
    def kv_owners(self) -> tuple[int, ...]:
        """The layers that keep caches of their own (every layer but Gemma 4's readers)."""
        return tuple(i for i in range(self.n_layer) if self.owns_kv(i))

    @property
    def kv_shared(self) -> tuple[int, ...]:
        """The layers whose caches later layers read (Gemma 4's), in order."""
        return tuple(sorted({self.kv_source(i) for i in range(self.n_layer) if not self.owns_kv(i)}))

    def is_sliding(self, i: int) -> bool:
        return self.sliding_window > 0 and i in self.swa_layers

    def kv_rows(self, i: int, n_ctx: int) -> int:
        """Rows of layer i's KV cache for a context of n_ctx: the window on a sliding layer."""
        return min(n_ctx, self.sliding_window) if self.is_sliding(i) else n_ctx

    def for_layer(self, i: int) -> "ModelConfig":
        """The config layer i computes with: its window and, on a sliding layer, its RoPE; in a Gemma 4 file its
        head size, KV heads, FFN width and the layer whose caches it reads."""
        return self._layer_configs[i] if 0 <= i < len(self._layer_configs) else self

    @cached_property
    def _layer_configs(self) -> tuple["ModelConfig", ...]:
        own_scale = self.rope_freq_scale_swa is not None  # gemma3's local layers: never scaled, YaRN neither
        sliding = replace(self, window=self.sliding_window,
                          rope_theta=self.rope_theta if self.rope_theta_swa is None else self.rope_theta_swa,
                          rope_freq_scale=self.rope_freq_scale_swa if own_scale else self.rope_freq_scale,
                          rope_freq_factors=self.rope_freq_factors if self.rope_theta_swa is None else None,
                          rope_yarn=None if own_scale else self.rope_yarn,
                          rope_mscale=1.0 if own_scale else self.rope_mscale,
                          head_dim=self.head_dim_swa or self.head_dim, rope_dims=self.rope_dims_swa or self.rope_dims)
        configs = [sliding if self.is_sliding(i) else self for i in range(self.n_layer)]
        if self.n_head_kv_layers or self.n_ff_layers or self.n_layer_kv:
            for i, c in enumerate(configs):
                configs[i] = replace(c, n_head_kv=self.n_head_kv_layers[i] if self.n_head_kv_layers else c.n_head_kv,
                                     n_ff=self.n_ff_layers[i] if self.n_ff_layers else c.n_ff,
                                     kv_from=-1 if self.owns_kv(i) else self.kv_source(i))
        return tuple(configs)

