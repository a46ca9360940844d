"""Experts as pebbles: hit rate and expert bytes restored per token at a few cache sizes, on a
Qwen3-30B-A3B-shaped mixture of experts scaled to fit (128 experts a layer, 8 used per token, normalised
top-k, Q/K norms; narrower and fewer layers than the real 48 x 2048).

    python benchmarks/bench_experts.py [--backend host] [--n-layer 4] [--n-embd 256] [--n-ff-exp 256]
                                       [--decode-tokens 48] [--caches 0,8,16,32] [--json FILE]

Two parts:

  model    the decode step itself (pebbling_expert_cache) on a random-weight file: the report's hits,
           misses, hit rate and expert bytes restored per decoded token, and the tokens checked equal to
           the experts kept in their layers. Random router weights route near-uniformly, so an LRU cache
           of C of E experts hits about C / E of the time.
  zipf     a routing trace with locality, stated as such: each token's k experts drawn without
           replacement from a Zipf(s) distribution over a per-layer random order of the experts (s 1.0 by
           default), run through the same policy as the decode step's cache (least recently used out,
           each expert of a step restored at most once), to show what the cache buys where routing is
           skewed, as real models' is. It is a simulation of the policy, not a run of a model.

Speculative prefetch is not implemented yet: no prefetch figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyplugin.model import load_model  # noqa: E402
from pyplugin.model.synth import write_gguf  # noqa: E402
from pyplugin.runtime import PebbledModel  # noqa: E402
from pyplugin.runtime.options import Options  # noqa: E402
from pyplugin.runtime.plan import PebblingOptions  # noqa: E402


def run_model(args, path: Path) -> list[dict]:
    model = load_model(path, progress=False)
    options = Options(temperature=0, num_predict=args.decode_tokens + 1, num_ctx=args.decode_tokens + 32)
    prompt = [(7 * i + 3) % 200 + 1 for i in range(8)]
    pebbled = PebbledModel(model, backend=args.backend)
    rows = []
    try:
        def generate(**extra):
            gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": "none", **extra}),
                                     len(prompt))
            return list(gen.tokens(prompt)), gen.report()
        expected, _ = generate()
        for cache in args.caches:
            tokens, report = generate(pebbling_expert_cache=cache)
            e = report["experts"]
            rows.append({"cache_per_layer": cache, "tokens_equal": tokens == expected, "hits": e["hits"],
                         "misses": e["misses"], "hit_rate": e["hit_rate"],
                         "expert_bytes_per_token": e["bytes_restored_per_token"], "expert_bytes": e["expert_bytes"],
                         "backend": report["backend"]})
    finally:
        pebbled.close()
    return rows


def lru_trace(choices: np.ndarray, cache: int) -> tuple[int, int]:
    """(hits, misses) of the decode step's policy over choices [steps, layers, k]: per layer a cache of
    `cache` experts (0: nothing kept between uses), the least recently used replaced."""
    hits = misses = 0
    for layer in range(choices.shape[1]):
        held: dict[int, int] = {}  # expert -> last use
        clock = 0
        for step in range(choices.shape[0]):
            for j in sorted(set(choices[step, layer].tolist())):   # a step: each expert once, in order
                clock += 1
                if cache and j in held:
                    hits += 1
                else:
                    misses += 1
                    if cache and len(held) >= cache:
                        del held[min(held, key=held.get)]
                if cache:
                    held[j] = clock
    return hits, misses


def zipf_choices(steps: int, layers: int, n_expert: int, k: int, s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_expert + 1) ** s
    p /= p.sum()
    out = np.empty((steps, layers, k), np.int64)
    for layer in range(layers):
        order = rng.permutation(n_expert)                  # which experts a layer favours
        for step in range(steps):
            out[step, layer] = order[rng.choice(n_expert, size=k, replace=False, p=p)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="host")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-ff-exp", type=int, default=256)
    ap.add_argument("--n-expert", type=int, default=128)
    ap.add_argument("--n-expert-used", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--caches", default="0,8,16,32")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--zipf-steps", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.caches = [int(c) for c in args.caches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "qwen3moe.gguf", arch="qwen3moe", vocab="qwen3", n_layer=args.n_layer,
                          n_embd=args.n_embd, n_head=4, n_head_kv=2, key_length=64, n_ff=args.n_ff_exp * 8,
                          n_ff_exp=args.n_ff_exp, n_expert=args.n_expert, n_expert_used=args.n_expert_used,
                          weight_type="Q8_0", n_ctx=512, n_merges=150)
        model_rows = run_model(args, path)
    expert_bytes = model_rows[0]["expert_bytes"]
    choices = zipf_choices(args.zipf_steps, args.n_layer, args.n_expert, args.n_expert_used, args.zipf_s, 0)
    zipf_rows = []
    for cache in args.caches:
        hits, misses = lru_trace(choices, cache)
        zipf_rows.append({"cache_per_layer": cache, "hit_rate": round(hits / (hits + misses), 4),
                          "expert_bytes_per_token": round(misses * expert_bytes / args.zipf_steps)})
    result = {"shape": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_ff_exp": args.n_ff_exp,
                        "n_expert": args.n_expert, "n_expert_used": args.n_expert_used, "weights": "Q8_0",
                        "expert_bytes": expert_bytes},
              "model": model_rows, "zipf": {"s": args.zipf_s, "steps": args.zipf_steps, "rows": zipf_rows},
              "prefetch": "not implemented yet"}
    print(f"qwen3moe-shaped, {args.n_layer} layers x {args.n_embd}, {args.n_expert} experts of {args.n_ff_exp}, "
          f"{args.n_expert_used} used; one expert {expert_bytes} bytes (Q8_0)")
    print("cache/layer  model: hit rate  bytes/token  tokens=  |  zipf trace: hit rate  bytes/token")
    for m, z in zip(model_rows, zipf_rows):
        print(f"{m['cache_per_layer']:>11}  {m['hit_rate']:>14}  {m['expert_bytes_per_token']:>11}  "
              f"{str(m['tokens_equal']):>7}  |  {z['hit_rate']:>20}  {z['expert_bytes_per_token']:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
