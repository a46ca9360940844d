"""What constrained decoding costs per token on the host backend: decode with a JSON schema against decode
without one on a small random-weight model, and the mask alone over vocabularies of real sizes.

    python benchmarks/speed.py structured [--tokens 64] [--json FILE]

Figures are measured in this run (medians over repeats). The mask costs with the vocabulary, not the
model: the second part times it over synthetic byte-level vocabularies of 32000 and 151936 tokens
(Llama 2's and Qwen2's sizes), driving the grammar with the best-scoring allowed token of random logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pyplugin.model import Tokenizer, load_model
from pyplugin.model.synth import write_gguf
from pyplugin.model.tokenizer import bytes_to_unicode
from pyplugin.runtime import Options, PebbledModel, PebblingOptions
from pyplugin.runtime.constraint import Constraint
from pyplugin.store import Strategy

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 8},
    "rows": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}}},
    "required": ["name", "tags", "rows"], "additionalProperties": False}


def decode_rates(pebbled: PebbledModel, n_tokens: int, repeats: int) -> dict:
    """Decode ms/token without and with the schema, all layers resident, greedy past the prompt."""
    model, prompt = pebbled.model, pebbled.model.tokenizer.encode("Write a record as JSON:")
    options = Options(temperature=1.0, seed=0, num_predict=n_tokens, num_ctx=512)
    rows = {}
    for label in ("unconstrained", "schema"):
        per_token, mask_share = [], []
        for _ in range(repeats + 1):  # the first warms up
            constraint = Constraint.from_format(model.tokenizer, SCHEMA) if label == "schema" else None
            gen = pebbled.generation(options, PebblingOptions(Strategy.parse("none")), len(prompt), constraint=constraint)
            list(gen.tokens(prompt))
            n = max(gen.stats.generated_tokens, 1)
            per_token.append(gen.stats.generate_ns / n / 1e6)
            mask_share.append(constraint.ns / n / 1e6 if constraint else 0.0)
        rows[label] = {"ms_per_token": round(statistics.median(per_token[1:]), 3),
                       "grammar_ms_per_token": round(statistics.median(mask_share[1:]), 4)}
    return rows


def synthetic_tokenizer(n_vocab: int, seed: int = 0) -> Tokenizer:
    """A byte-level vocabulary of `n_vocab` tokens: the 256 bytes, then random words of 2 to 10 letters."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789\"{}[],:")
    byte_chars = list(bytes_to_unicode().values())
    tokens, seen = list(byte_chars), set(byte_chars)
    while len(tokens) < n_vocab - 1:
        word = "".join(rng.choice(alphabet, rng.integers(2, 11))).replace(" ", "Ġ")
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    tokens.append("<|endoftext|>")
    return Tokenizer(tokens, [1] * (len(tokens) - 1) + [3], kind="bpe", eos_id=len(tokens) - 1)


def mask_cost(n_vocab: int, steps: int) -> dict:
    tokenizer = synthetic_tokenizer(n_vocab)
    start = time.perf_counter()
    constraint = Constraint.from_format(tokenizer, SCHEMA)
    build = time.perf_counter() - start
    rng = np.random.default_rng(1)
    times = []
    for _ in range(steps):
        logits = rng.standard_normal(n_vocab).astype(np.float32)
        before = constraint.ns
        masked = constraint.mask(logits)
        times.append((constraint.ns - before) / 1e6)
        token = int(np.argmax(masked))
        if token == tokenizer.eos_id or constraint.stopped:
            constraint = Constraint.from_format(tokenizer, SCHEMA)  # a new object: keep timing
            continue
        constraint.accept(token)
    return {"n_vocab": n_vocab, "first_constraint_s": round(build, 3), "steps": steps,
            "mask_ms_median": round(statistics.median(times), 4), "mask_ms_p90": round(float(np.percentile(times, 90)), 4)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_ctx=1024,
                          weight_type="Q8_0", vocab="chatml")
        model = load_model(path, progress=False)
    pebbled = PebbledModel(model, backend="host")
    try:
        decode = decode_rates(pebbled, args.tokens, args.repeats)
    finally:
        pebbled.close()
    masks = [mask_cost(n, args.steps) for n in (32000, 151936)]
    result = {"model": f"8 x 512 Q8_0 random-weight qwen2-style, vocabulary {model.tokenizer.n_vocab}", "decode": decode,
              "mask_over_vocabularies": masks}
    u, s = decode["unconstrained"], decode["schema"]
    print(f"{result['model']}, host backend, {args.tokens} tokens, median of {args.repeats}:")
    print(f"  unconstrained {u['ms_per_token']:.3f} ms/token; with the schema {s['ms_per_token']:.3f} ms/token, of which "
          f"the grammar {s['grammar_ms_per_token']:.4f} ms ({s['ms_per_token'] / u['ms_per_token']:.2f}x)")
    for m in masks:
        print(f"  mask alone, vocabulary {m['n_vocab']}: median {m['mask_ms_median']} ms/token, p90 {m['mask_ms_p90']} ms "
              f"(first constraint for this tokenizer built in {m['first_constraint_s']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result

