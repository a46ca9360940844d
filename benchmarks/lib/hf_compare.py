"""What the transformers agreements (agreement.py gpt-oss-transformers, gemma4-transformers) share: each side's
logits over a sequence and its greedy tokens, and the tie-tolerant comparison of the two."""

from __future__ import annotations

import numpy as np

from pyplugin.model.transformer import output_logits
from pyplugin.runtime import Generation
from pyplugin.runtime.options import Options

N_GEN, TIE = 16, 1e-4   # greedy tokens compared; where transformers' top two are this close, either is right


def teacher_tokens(model, n: int, seed: int = 5) -> list[int]:
    """n token ids drawn from the model's normal tokens: a teacher-forced prompt both sides read."""
    normal = [i for i, ty in enumerate(model.tokenizer.types) if ty == 1]
    return [int(x) for x in np.random.default_rng(seed).choice(normal, n)]


def hf_logits(model, torch, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].double().numpy()


def hf_greedy(model, torch, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    tokens, logits = list(prompt), []
    for _ in range(N_GEN):
        row = hf_logits(model, torch, tokens)[-1]
        logits.append(row)
        tokens.append(int(np.argmax(row)))
    return tokens[len(prompt):], logits


def pebbling_logits(model, tokens: list[int]) -> np.ndarray:
    gen = Generation(model, Options(num_ctx=256, temperature=0.0, kv_type="f32"))
    x = gen._through_layers(tokens)
    return np.array([output_logits(model.config, gen.outer, x[i]) for i in range(len(tokens))], dtype=np.float64)


def pebbling_greedy(model, prompt: list[int]) -> list[int]:
    gen = Generation(model, Options(num_ctx=256, temperature=0.0, kv_type="f32", num_predict=N_GEN, top_k=1,
                                    repeat_penalty=1.0))
    logits, out = gen.prefill(prompt), []
    for _ in range(N_GEN):
        token = int(np.argmax(logits))
        out.append(token)
        logits = gen.decode_one(token)
    return out


def tie_tolerant(ours: list[int], theirs: list[int], their_logits: list[np.ndarray]) -> tuple[bool, int | None, float]:
    """Equal up to the first step where transformers' top two are within TIE (then either is right)."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top = np.sort(their_logits[j])[-2:]
            return bool(top[1] - top[0] <= TIE), j, float(top[1] - top[0])
    return True, None, 0.0
