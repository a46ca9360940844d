"""Log probabilities of generated tokens, as OpenAI and Ollama report them.

A token's logprob is the model's log-softmax over the raw logits of its step, in float64: before the
repeat and presence penalties, the temperature, top_k/top_p/min_p and a format's grammar mask. That is
what OpenAI and Ollama return (the model's belief, not the distribution the sampler drew from), so a
token the grammar forced or a low temperature favoured shows the probability the model gave it. Only
computed when a request asks (one pass over the vocabulary per token), so plain decoding pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model import Tokenizer
from .sampling import top_k_candidates

MAX_TOP_LOGPROBS = 20  # OpenAI's and Ollama's limit


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its logprob, and the `n` most likely ids of its step with theirs
    (most likely first; ties by id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def json(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """As Ollama and OpenAI write it: the token as text (what it adds to the output, so control
        tokens add nothing), its UTF-8 bytes (a character split across tokens is whole only there),
        and the most likely tokens of its step in the same form."""
        def one(token: int, logprob: float) -> dict[str, Any]:
            raw = tokenizer.token_bytes(token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

        return {**one(self.token, self.logprob), "top_logprobs": [one(i, lp) for i, lp in self.top]}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log(softmax(logits)) in float64, stable for any finite logits."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x)
    return shifted - np.log(np.sum(np.exp(shifted)))


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """The chosen token's logprob under the raw logits, and the n_top most likely tokens'."""
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        ids = top_k_candidates(lp, min(n_top, lp.size))  # largest first, equal ones lowest id first
        top = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(int(token), float(lp[token]), top)
