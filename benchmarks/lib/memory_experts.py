"""Experts as pebbles: hit rate, expert bytes restored per token and prefetch accuracy at a few cache sizes,
with and without speculative prefetch, under the least-recently-used and the least-often-used policy, on a
Qwen3-30B-A3B-shaped mixture of experts (2048 wide, 32 query heads and 4 KV heads of 128, 128 experts of
768, 8 used per token, normalised top-k, Q/K norms, a vocabulary of 151936) with fewer layers than its 48.

    python benchmarks/memory.py experts [--backend host] [--n-layer 4] [--decode-tokens 48]
        [--caches 0,8,16,32] [--policies lru,lfu] [--zipf-s 1.0] [--zipf-steps 512] [--json FILE]

Two parts:

  model    the decode step itself on a random-weight file (Q4_K_M-like, its blocks written directly:
           synth's random_blocks): one request per (policy, prefetch, cache) with pebbling_expert_cache,
           its report's hit rate, expert bytes restored per decoded token (misses and prefetches), the
           prefetch guesses' accuracy (guessed experts the layer then ran) and the share of prefetched
           experts used, the decoder's expert slots and the byte-accounted peak (the host library's and
           stub's accounting: no GPU is measured), the tokens checked equal to the experts kept in their
           layers. Random router weights route near-uniformly, so a cache of C of 128 hits about C / 128
           of the time and prefetch guesses from near-uniform scores.
  zipf     a routing trace with locality, stated as such: each layer's router scores are the log of a
           Zipf(s) prior over a per-layer random order of its experts plus Gumbel noise (so each token's 8
           experts are drawn without replacement in proportion to the Zipf weights); a prefetch guess is the
           same router with N(0, noise^2) added to that noise (--guess-noise, 0.5 by default). The trace
           runs through the stub decoder's own expert slots (pyplugin.store.stub_experts, which the
           conformance test holds equal to the native step's choices), with restores counted, not made:
           a simulation of the policy, not a run of a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from lib.shapes import SHAPES
from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.store.kernels import DECODER_STATS, EXPERT_POLICIES, LayerShape
from pyplugin.store.stub_experts import ExpertSlots

QWEN3_30B_A3B = {k: v for k, v in SHAPES["qwen3-30b-a3b"].items() if k not in ("n_layer", "random_blocks")}


def q4_k_m_moe(n_layer: int) -> dict:
    """llama.cpp's Q4_K_M mix for these shapes: Q4_K, with Q6_K for the embedding, attn_v and, on the layers
    its use_more_bits picks (the first and last eighth, every third between), ffn_down_exps."""
    more = [i for i in range(n_layer) if i < n_layer / 8 or i >= 7 * n_layer / 8 or (i - n_layer // 8) % 3 == 2]
    return dict(weight_type="Q4_K", tensor_types={"token_embd": "Q6_K", "output": "Q6_K", "attn_v": "Q6_K",
                                                  **{f"blk.{i}.ffn_down_exps": "Q6_K" for i in more}})


# ---------------------------------------------------------------------------------------------------
# the model

def run_model(args, path: Path) -> list[dict]:
    model = load_model(path, progress=False)
    options = Options(temperature=0, num_predict=args.decode_tokens + 1, num_ctx=args.decode_tokens + 32)
    prompt = [(7 * i + 3) % 5000 + 1 for i in range(8)]
    pebbled = PebbledModel(model, backend=args.backend)
    rows = []
    try:
        def generate(**extra):
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "none", **extra}),
                                     len(prompt))
            return list(gen.tokens(prompt)), gen.report()
        expected, _ = generate()
        for policy in args.policies:
            for prefetch in (False, True):
                for cache in args.caches:
                    tokens, report = generate(pebbling_expert_cache=cache, pebbling_expert_prefetch=prefetch,
                                              pebbling_expert_policy=policy)
                    e = report["experts"]
                    rows.append({"policy": policy, "prefetch": prefetch, "cache_per_layer": e["cache_per_layer"],
                                 "tokens_equal": tokens == expected, "hits": e["hits"], "misses": e["misses"],
                                 "hit_rate": e["hit_rate"], "expert_bytes_per_token": e["bytes_restored_per_token"],
                                 "prefetch_accuracy": e["prefetch_accuracy"],
                                 "prefetched_used": round(e["prefetched_used"] / e["prefetched"], 4)
                                 if e["prefetched"] else None,
                                 "expert_slot_bytes": e["cache_bytes"], "expert_bytes": e["expert_bytes"],
                                 "measured_peak_bytes": report["measured_peak_bytes"],
                                 "measured_peak_how": report["measured_peak_how"], "backend": report["backend"]})
                    print(f"  model {policy} prefetch={prefetch!s:5} cache {cache:3}: hit rate {e['hit_rate']}, "
                          f"{e['bytes_restored_per_token']} B/token", file=sys.stderr, flush=True)
    finally:
        pebbled.close()
    return rows


# ---------------------------------------------------------------------------------------------------
# the Zipf trace

class _CountingStore:
    """A store whose entries are all `nbytes` and whose restores copy nothing (the trace counts them)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def entry_info(self, layer, tensor_id):
        return type("Info", (), {"nbytes": self.nbytes})

    def restore(self, layer, tensor_id, out):
        pass


class _NoKernels:
    @staticmethod
    def _matrix(*args):
        return None


def zipf_router(steps: int, layers: int, n_expert: int, s: float, noise: float, seed: int):
    """Router scores [steps, layers, n_expert] (log Zipf prior over a per-layer order, plus Gumbel noise)
    and the prefetch guesser's (the same, plus N(0, noise^2))."""
    rng = np.random.default_rng(seed)
    prior = -s * np.log(np.arange(1, n_expert + 1))
    order = np.stack([rng.permutation(n_expert) for _ in range(layers)])          # which experts a layer favours
    scores = np.empty((steps, layers, n_expert))
    for layer in range(layers):
        scores[:, layer, order[layer]] = prior
    scores += rng.gumbel(size=scores.shape)
    return scores, scores + rng.normal(0.0, noise, scores.shape)


def run_trace(scores, guesses, k: int, cache: int, policy: str, prefetch: bool, expert_bytes: int) -> dict:
    """The trace through ExpertSlots as the decode step drives it, one token a step."""
    steps, layers, n_expert = scores.shape
    shape = LayerShape(64, 1, 1, 64, 64, 64, 0, 1e-6, n_expert=n_expert, n_expert_used=k, n_ff_exp=64)
    types = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), 0)  # F32: 64 x 64 x 4 x 3 bytes
    stats = dict.fromkeys(DECODER_STATS, 0)
    slots = ExpertSlots(_NoKernels, _CountingStore(3 * 64 * 64 * 4), {i: (shape, types, 0, cache) for i in range(layers)},
                        EXPERT_POLICIES.index(policy), prefetch, stats)
    for t in range(steps):
        for i in range(layers):
            if prefetch:
                slots.stage(i, np.argsort(-guesses[t, i], kind="stable")[:k])
            run = slots.for_layer(i)
            chosen = np.sort(np.argsort(-scores[t, i], kind="stable")[:k])
            run.routed(chosen)
            for j in chosen:
                run(int(j))
            run.done()
    ran = stats["expert_hits"] + stats["expert_misses"]
    restored = stats["expert_misses"] + stats["expert_prefetches"]
    return {"policy": policy, "prefetch": prefetch, "cache_per_layer": cache,
            "hit_rate": round(stats["expert_hits"] / ran, 4),
            "expert_bytes_per_token": round(restored * expert_bytes / steps),
            "prefetch_accuracy": round(stats["expert_guesses_right"] / stats["expert_guesses"], 4) if prefetch else None,
            "prefetched_used": round(stats["expert_prefetch_hits"] / stats["expert_prefetches"], 4)
            if stats["expert_prefetches"] else None}


# ---------------------------------------------------------------------------------------------------

def fmt(v, width: int) -> str:
    return f"{'-' if v is None else v:>{width}}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="host", help="host (the native library's accounting) or stub")
    ap.add_argument("--n-layer", type=int, default=4, help="layers of the model part (Qwen3-30B-A3B has 48)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--caches", default="0,8,16,32")
    ap.add_argument("--policies", default="lru,lfu", help=f"of {', '.join(EXPERT_POLICIES)}")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--zipf-steps", type=int, default=512)
    ap.add_argument("--zipf-layers", type=int, default=48)
    ap.add_argument("--guess-noise", type=float, default=0.5)
    ap.add_argument("--skip-model", action="store_true", help="the Zipf trace only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.caches = [int(c) for c in args.caches.split(",")]
    args.policies = [p for p in args.policies.split(",") if p]
    shape = {**QWEN3_30B_A3B, "n_layer": args.n_layer}
    model_rows, expert_bytes = [], None
    if not args.skip_model:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_gguf(Path(tmp) / "qwen3moe.gguf", **shape, n_ctx=4096, random_blocks=True,
                              **q4_k_m_moe(args.n_layer))
            model_rows = run_model(args, path)
        expert_bytes = model_rows[0]["expert_bytes"]
    expert_bytes = expert_bytes or 768 * 2048 * 3 * 144 // 256  # Q4_K gate, up and down
    k, E = shape["n_expert_used"], shape["n_expert"]
    scores, guesses = zipf_router(args.zipf_steps, args.zipf_layers, E, args.zipf_s, args.guess_noise, 0)
    zipf_rows = [run_trace(scores, guesses, k, cache, policy, prefetch, expert_bytes)
                 for policy in args.policies for prefetch in (False, True) for cache in args.caches]
    result = {"shape": {**shape, "weights": "Q4_K_M-like (random blocks)", "expert_bytes": expert_bytes},
              "model": model_rows, "zipf": {"s": args.zipf_s, "steps": args.zipf_steps, "layers": args.zipf_layers,
                                            "guess_noise": args.guess_noise, "rows": zipf_rows}}

    print(f"Qwen3-30B-A3B-shaped: 2048 wide, 32/4 heads of 128, {E} experts of 768, {k} used, vocab 151936; "
          f"one expert {expert_bytes} bytes (largest layer's, Q4_K_M-like)")
    header = (f"{'policy':6} {'prefetch':8} {'cache/layer':>11} {'hit rate':>8} {'bytes/token':>12} "
              f"{'prefetch acc.':>13} {'prefetched used':>15}")
    if model_rows:
        r0 = model_rows[0]
        print(f"\nmodel: the decode step on {r0['backend']}, {args.n_layer} layers, {args.decode_tokens} greedy "
              f"tokens, random weights (routing near uniform); peaks {r0['measured_peak_how'].split(' (')[0]}")
        print(header + f" {'expert slots':>12} {'accounted peak':>14} tokens = none")
        for r in model_rows:
            print(f"{r['policy']:6} {str(r['prefetch']):8} {r['cache_per_layer']:>11} {fmt(r['hit_rate'], 8)} "
                  f"{fmt(r['expert_bytes_per_token'], 12)} {fmt(r['prefetch_accuracy'], 13)} "
                  f"{fmt(r['prefetched_used'], 15)} {r['expert_slot_bytes']:>12} {r['measured_peak_bytes']:>14} "
                  f"{r['tokens_equal']}")
    print(f"\nzipf trace (a simulation, not a model): {args.zipf_layers} layers x {args.zipf_steps} tokens, each "
          f"layer's router a Zipf(s={args.zipf_s}) prior over its experts plus Gumbel noise; guesses from the same "
          f"router with N(0, {args.guess_noise}^2) added; through the stub decoder's expert slots; bytes/token for "
          f"all {args.zipf_layers} layers")
    print(header)
    for r in zipf_rows:
        print(f"{r['policy']:6} {str(r['prefetch']):8} {r['cache_per_layer']:>11} {fmt(r['hit_rate'], 8)} "
              f"{fmt(r['expert_bytes_per_token'], 12)} {fmt(r['prefetch_accuracy'], 13)} {fmt(r['prefetched_used'], 15)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
