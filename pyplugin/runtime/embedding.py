"""Embeddings: one vector per input, pooled from the model's final hidden states as its GGUF declares
(`pooling_type`: mean, cls or last; mean where it declares none), and normalised to unit length as
Ollama's /api/embed and OpenAI's embeddings are."""

from __future__ import annotations

import numpy as np

from ..errors import OptionsError

POOLINGS = ("mean", "cls", "last")


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise OptionsError(f"this model's pooling_type is {pooling!r}, which gives no single embedding per "
                           f"input; embeddings are served for pooling {', '.join(POOLINGS)}")


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """hidden [T, n_embd] -> one float64 vector [n_embd]."""
    check_pooling(pooling)
    hidden = np.asarray(hidden, dtype=np.float64)
    if pooling == "mean":
        return hidden.mean(axis=0)
    return hidden[0] if pooling == "cls" else hidden[-1]


def normalize(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """The first `dimensions` values (all when None) scaled to unit length (a zero vector stays zero)."""
    vector = np.asarray(vector, dtype=np.float64)[:dimensions]
    norm = np.linalg.norm(vector)
    return vector / norm if norm > 0 else vector
