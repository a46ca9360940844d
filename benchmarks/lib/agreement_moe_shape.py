"""`agreement.py llamacpp`'s mixture-of-experts check on a real model's shape (issue 28).

    python benchmarks/agreement.py moe-shape --shape qwen3-30b-a3b --n-layer 2 [--json FILE] [--dir DIR]

A dense shape runs too (Gemma 4's E4B: its greedy tokens judged on the copy where llama.cpp's own rounding
parts them; no router). The shape is shapes.SHAPES[--shape] with --n-layer layers, written as `speed.py cpu` writes it
(synth's random valid blocks in its Q4_K_M-like mix), and agreement_llamacpp.compare_case runs it: the last
prompt position's logits and 16 greedy tokens of llama.cpp on the quantized file against pebbling's (weights
expanded to float32), and the control, llama.cpp on an F32 copy holding the values pebbling dequantizes. Where
the quantized comparison parts, a mixture of experts is judged against that copy (greedy tokens equal, logits
within 1e-4 relative at every step).

Beside it, pebbling's own router margins over the prompt (step 0; decode steps route in the native decoder): in
each layer, the gap between the n_expert_used-th and the next largest router logit at the last position, and
the least such gap over the positions. llama.cpp quantizes activations to Q8_K before its Q4_K/Q6_K matmuls, so the router's input (and
so its logits) moves a little; a gap smaller than that moves a token to another expert.

The F32 copy is large (Qwen3-30B-A3B: 2.4 GB a layer and two 1.2 GB vocabulary matrices) and pebbling holds the
same in memory: --n-layer 2 needs about 8 GB of memory and 9 GB of disk. Run it with an interpreter that has
llama-cpp-python and pebbling, as `agreement.py llamacpp`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lib import agreement_llamacpp as cmp, shapes
from pyplugin.model import moe


@contextmanager
def router_logits():
    """Every call of pebbling's router while in the block: its logits [T, n_expert] (its bias added where it has
    one; the gaps between them are the log-probabilities'), in call order: the layers in turn, for the prompt and
    then each token."""
    calls, original = [], moe.router_logits

    def recorded(cfg, h, router, max_rows=0, bias=None):
        logits = original(cfg, h, router, max_rows, bias)
        calls.append(np.array(logits, dtype=np.float32))
        return logits

    moe.router_logits = recorded
    try:
        yield calls
    finally:
        moe.router_logits = original


def router_margins(calls: list[np.ndarray], n_layer: int, k: int) -> list[dict]:
    """Per layer, the prompt's gaps between the k-th and (k+1)-th router logit: at its last position, and the
    least over its positions (any of which the last position's logits depend on, through attention). The
    prompt's pass is the first n_layer calls; decode steps route in the native decoder, unrecorded."""
    out = []
    for layer, logp in enumerate(calls[:n_layer]):
        top = -np.sort(-logp, axis=-1)
        gaps = top[:, k - 1] - top[:, k]
        least = int(np.argmin(gaps))
        out.append(dict(layer=layer, last_gap=float(gaps[-1]), least_gap=float(gaps[least]), least_position=least,
                        spread=float(np.std(logp[-1]))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(shapes.SHAPES))  # a dense one: no router
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the two files are written (default: a temporary one)")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    cmp.import_llama_cpp()
    shape = shapes.with_layers(shapes.SHAPES[args.shape], args.n_layer)
    mix = shapes.q4_k_m(shape)
    case = cmp.Case(f"{args.shape} {args.n_layer}L Q4_K_M-like", shape["arch"], mix["weight_type"],
                    {**shape, "tensor_types": mix["tensor_types"]})
    with tempfile.TemporaryDirectory(prefix="pebbling-vs-llamacpp-", dir=args.dir) as tmp, \
            router_logits() as calls:
        row = cmp.compare_case(case, Path(tmp))
    margins = router_margins(calls, args.n_layer, shape["n_expert_used"]) if shape.get("n_expert") else []
    cmp.print_model_table([row])
    if "pebbling_tokens" in row:
        print(f"\nllama.cpp (quantized)  {row['llama_tokens']}\nllama.cpp (F32 copy)   "
              f"{row.get('dequantized_tokens')}\npebbling               {row['pebbling_tokens']}")
        print(f"pebbling vs llama.cpp on the F32 copy: rel err {row['vs_dequantized']:.2e} (last prompt position, "
              f"max |diff| {row['vs_dequantized_max_abs']:.2e}), worst over the decode steps "
              f"{row['vs_dequantized_decode']:.2e}, greedy tokens equal: {row['dequantized_greedy_equal']}")
    k = shape.get("n_expert_used", 0)
    if margins:
        print(f"\npebbling's router over the prompt (step 0): the gap between the {k}th and {k + 1}th logit at the last "
              "position, the least over the positions, and the std of the last position's logits")
    for m in margins:
        print(f"  layer {m['layer']:2d}: last {m['last_gap']:.2e}, least {m['least_gap']:.2e} (position "
              f"{m['least_position']}), std {m['spread']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=shape, model=row, router=margins), indent=1))
    return 1 if row["status"] in ("DISAGREE", "llama.cpp refused") else 0
