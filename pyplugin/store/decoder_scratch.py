"""The memory a native decoder allocates for its steps' activations (pebble_decoder_stats.scratch_bytes):
pebble_decoder_create's layout, part by part, so that a plan counts it before the decoder exists. On the
GPU it is device memory of the decoder's own, beside CuPy's pool and the store's tier."""

from __future__ import annotations

from collections.abc import Sequence

from .abi import DECODER_SPLIT_ROWS, aligned
from .kernels import LayerShape


def scratch_bytes(shapes: Sequence, kv_rows: Sequence[int], n_seq: int, n_embd: int, n_vocab: int,
                  on_device: bool, n_embd_per_layer: int = 0) -> int:
    """A decoder's scratch over layers of these LayerShapes and cache rows, for steps of up to n_seq sequences:
    the activations of the widest layer in fp16 on the device (float32 in the host build), float32 q, k, v,
    the attention's scores over the longest cache and its parts of DECODER_SPLIT_ROWS rows, the feed-forward's
    gate and up, and with experts the router's scores and rows; on the device also x and the logits at fixed
    addresses (a graph's), x with Gemma 4's per-layer inputs after it (n_embd_per_layer a layer)."""
    act, b = (2 if on_device else 4), n_seq
    q = max(s.n_head * s.head_dim for s in shapes)
    kv = max(s.n_head_kv * s.head_dim for s in shapes)
    heads = max(s.n_head for s in shapes)
    rows = max(kv_rows)
    pl = n_embd_per_layer  # the per-layer embedding's gate and input go through the FFN's buffers
    ff = max(max(s.n_ff, s.n_ff_exp if s.n_expert else 0, s.n_ff_shexp if s.n_expert else 0, pl) for s in shapes)
    widest = max(n_embd, *(max(s.n_embd, s.n_head * s.head_dim, s.n_ff, pl) for s in shapes))
    experts = max(s.n_expert for s in shapes)
    parts = (q + 2 * heads) * -(-rows // DECODER_SPLIT_ROWS)  # each head's part sums and (largest, sum of exps)
    takes = [act * b * widest, 4 * b * q, 4 * b * kv, 4 * b * kv, 4 * b * q, 8 * b * kv, 4 * b * heads * rows,
             4 * b * parts, 4 * b * n_embd, 4 * b * ff, 4 * b * ff, 8 * b]
    if experts:
        takes += [4 * b * experts, act * b * n_embd, act * b * ff, 4 * b * n_embd]
    if on_device:
        takes += [4 * b * (n_embd + len(shapes) * pl), 4 * b * n_vocab]
    return sum(aligned(t) for t in takes)  # each part aligned (native/cuda/decoder.cu)


def model_scratch_bytes(cfg, n_ctx: int, n_seq: int, on_device: bool = True) -> int:
    """scratch_bytes of a decoder over every layer of the model of ModelConfig `cfg`, caches at n_ctx."""
    return scratch_bytes([LayerShape.of(cfg.for_layer(i)) for i in range(cfg.n_layer)],
                         [cfg.kv_rows(i, n_ctx) for i in range(cfg.n_layer)], n_seq, cfg.n_embd, cfg.n_vocab, on_device,
                         cfg.n_embd_per_layer)
