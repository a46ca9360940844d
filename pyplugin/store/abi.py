"""The C ABI's facts as Python: what the pure-Python stub and the bindings' argument checks need to
know without the library. A leaf.

native/pebble.h is the source of every value here: tests/test_abi.py checks each one against the
header as the bindings read it and against a loaded library (the status codes live with their
exceptions in pyplugin.errors and are checked the same way).
"""

from __future__ import annotations

# enum pebble_tier: where pebble_save places an entry
TIER_AUTO, TIER_DEVICE, TIER_HOST = 0, 1, 2
TIER_NAMES = {TIER_AUTO: "auto", TIER_DEVICE: "device", TIER_HOST: "host"}

# enum pebble_strategy
STRATEGY_NONE, STRATEGY_SQRT, STRATEGY_ADAPTIVE, STRATEGY_MINIMAL, STRATEGY_EVERY = 0, 1, 2, 3, 4

TYPE_BYTES = -1      # PEBBLE_TYPE_BYTES: an entry of untyped bytes
TYPE_COUNT = 42      # PEBBLE_TYPE_COUNT: GGUF type ids are 0..TYPE_COUNT-1
MAX_DIMS = 4         # PEBBLE_MAX_DIMS
MATVEC_MAX_VEC = 8   # PEBBLE_MATVEC_MAX_VEC: the most vectors one matvec call takes
DECODER_MAX_BATCH = 64  # PEBBLE_DECODER_MAX_BATCH: the most sequences one decoder holds
DECODER_GRAPHS = 8      # PEBBLE_DECODER_GRAPHS: the most CUDA graphs one decoder keeps
DECODER_SPLIT_ROWS = 64  # PEBBLE_DECODER_SPLIT_ROWS: rows of V a decode step's attention sums a part
LAYER_WEIGHTS = 39      # PEBBLE_LAYER_WEIGHTS: the fields of struct pebble_layer_weights
# ... in their order (pebble_step_layer.weight_ids), named as pyplugin.model's LayerWeights fields
DECODE_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv",
                  "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                  "ffn_down_exps", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_sinks",
                  "bo", "ffn_gate_inp_b", "ffn_gate_exps_b", "ffn_up_exps_b", "ffn_down_exps_b", "per_layer_inp_gate",
                  "per_layer_proj", "per_layer_post_norm", "out_scale", "ffn_gate_inp_s", "ffn_pre_norm_2",
                  "ffn_post_norm_1", "ffn_post_norm_2", "ffn_down_exps_s")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")  # pebble_layer_shape.activation's values, in order
GATINGS = ("softmax", "softmax_chosen")        # ... and expert_gating's
DEVICE_PAGE_BYTES = 2 << 20  # PEBBLE_DEVICE_PAGE_BYTES: the cuda device tier counts a copy of half or more in pages

ALIGN = 256  # the library aligns each part of a buffer it lays out to this (slots, expert slots, a decoder's scratch)


def aligned(n: int) -> int:
    """n bytes rounded up to a whole number of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def paged(nbytes: int, page: int) -> int:
    """An allocation of `nbytes` as a device of `page`-byte pages holds it (0: as bytes): from half a page on,
    whole pages (native/store_tiers.cu, device_footprint)."""
    return nbytes if not page or nbytes < page // 2 else -(-nbytes // page) * page


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
UINT64_MAX = 2**64 - 1

# Each value above under its name in pebble.h, for the test that holds the two together.
HEADER_NAMES = {
    "PEBBLE_TIER_AUTO": TIER_AUTO, "PEBBLE_TIER_DEVICE": TIER_DEVICE, "PEBBLE_TIER_HOST": TIER_HOST,
    "PEBBLE_STRATEGY_NONE": STRATEGY_NONE, "PEBBLE_STRATEGY_SQRT": STRATEGY_SQRT,
    "PEBBLE_STRATEGY_ADAPTIVE": STRATEGY_ADAPTIVE, "PEBBLE_STRATEGY_MINIMAL": STRATEGY_MINIMAL,
    "PEBBLE_STRATEGY_EVERY": STRATEGY_EVERY,
    "PEBBLE_TYPE_BYTES": TYPE_BYTES, "PEBBLE_TYPE_COUNT": TYPE_COUNT, "PEBBLE_MAX_DIMS": MAX_DIMS,
    "PEBBLE_MATVEC_MAX_VEC": MATVEC_MAX_VEC, "PEBBLE_DECODER_MAX_BATCH": DECODER_MAX_BATCH,
    "PEBBLE_DECODER_GRAPHS": DECODER_GRAPHS, "PEBBLE_LAYER_WEIGHTS": LAYER_WEIGHTS,
    "PEBBLE_DECODER_SPLIT_ROWS": DECODER_SPLIT_ROWS, "PEBBLE_DEVICE_PAGE_BYTES": DEVICE_PAGE_BYTES,
}


# The native library's run-time switches (native/cuda/common.cuh, cuda_switches; docs/environment.md): each
# variable's accepted values, the default first. The library reads them once and takes any other
# value as the default, so check_switches refuses it before a library is chosen.
SWITCHES = {
    "PEBBLING_CUDA_MATVEC": ("integer", "float"),
    "PEBBLING_CUDA_PERSIST": ("1", "0"),
    "PEBBLING_CUDA_STACK": ("1", "0"),
    "PEBBLING_CUDA_GROUP": ("8", "1", "2", "3", "4", "5", "6", "7"),
    "PEBBLING_CUDA_GRAPHS": ("1", "0"),
    "PEBBLING_CUDA_SPLIT": ("1", "0"),
    "PEBBLING_CUDA_DENSE": ("1", "0"),
}


def check_switches(environ) -> None:
    """Raises ValueError naming the first switch in `environ` set to a value it does not take, and the values
    it does."""
    for name, accepted in SWITCHES.items():
        value = environ.get(name)
        if value and value not in accepted:  # empty: unset
            raise ValueError(f"{name}={value!r} is not a value it takes; accepted: {', '.join(accepted)} "
                             f"(default {accepted[0]})")

