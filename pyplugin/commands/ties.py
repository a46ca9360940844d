"""Near-ties between two weight forms, for `verify --compare-weights`.

The quantized and f16 forms of a model round differently (8-bit activations against fp16 ones), so
their logits at the same prefix differ a little; where the reference's two likeliest tokens are closer
than that, either is a correct greedy choice and the two forms may part there. Both forms are fed the
reference's tokens (teacher forcing), so every step compares choices made from the same prefix: a step
where the other form chooses differently is a near-tie when the reference's own logits for the two
tokens are within the tolerance, and a failure otherwise.

The default tolerance, 0.1 logits: on the demo model the two forms' logits at the same prefix differ by
a median of 0.014 and a 99th percentile of 0.055 (at most 0.10 over a 32-token answer); two tokens'
logits each moved by that much can trade places when they lie up to about twice it apart. A model
with larger logits rounds by more (SmolLM2-135M Q4_1: median 0.18, 99th percentile 0.73): `verify`
prints the difference it measured, and --tie-tolerance takes a larger figure where that is the cause.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..runtime.sampling import apply_presence_frequency, apply_repeat_penalty

DEFAULT_TIE_TOLERANCE = 0.1  # logits


def greedy_logits(sampler, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
    """The logits a greedy sampler takes its argmax of: the raw ones after its penalties, float32."""
    o, recent = sampler.options, sampler.recent(history)
    out = apply_repeat_penalty(logits, recent, o.repeat_penalty)
    if o.presence_penalty or o.frequency_penalty:
        out = apply_presence_frequency(out, recent, o.presence_penalty, o.frequency_penalty)
    return np.array(out, dtype=np.float32, copy=True)


class Recorder:
    """Wraps a generation's sampling: keeps the logits each greedy choice was made from."""

    def __init__(self, gen):
        self.steps: list[np.ndarray] = []
        self._gen, self._sample = gen, gen.sample
        gen.sample = self

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        self.steps.append(greedy_logits(self._gen.sampler, logits, history))
        return self._sample(logits, history)


def forced_steps(gen, prompt: Sequence[int], reference: Sequence[int], n_steps: int) -> list[np.ndarray]:
    """The greedy logits of `gen` at each of `n_steps` steps, fed the reference's tokens after `prompt`."""
    gen.start(prompt)
    steps = []
    for i in range(n_steps):
        steps.append(greedy_logits(gen.sampler, gen.logits, gen.history))
        if i + 1 < n_steps:
            gen.history.append(reference[i])
            gen.logits = gen.decode_one(reference[i])
    return steps


def compare(reference: Sequence[int], ref_steps: Sequence[np.ndarray], other_steps: Sequence[np.ndarray],
            tolerance: float) -> dict[str, Any]:
    """Step by step from the same prefixes: where the other form chooses another token, the gap between
    the reference's logits for its own token and for that one; within `tolerance` is a near-tie."""
    ties = []
    for i, (ref, other) in enumerate(zip(ref_steps, other_steps)):
        mine = reference[i] if i < len(reference) else int(np.argmax(ref))  # past the end: its stop token
        theirs = int(np.argmax(other))
        if theirs != mine:
            gap = float(ref[mine] - ref[theirs])
            ties.append({"position": i, "reference_token": mine, "token": theirs, "logit_gap": round(gap, 6),
                         "within_tolerance": gap <= tolerance})
    difference = [float(np.max(np.abs(a - b))) for a, b in zip(ref_steps, other_steps)]
    return {"tie_tolerance": tolerance, "near_ties": ties, "steps_compared": len(difference),
            "logit_difference_max": round(max(difference, default=0.0), 6),
            "logit_difference_median": round(float(np.median(difference)) if difference else 0.0, 6),
            "choices_agree_within_tolerance": all(t["within_tolerance"] for t in ties)}


def describe(other: dict[str, Any], reference_weights: str) -> str:
    """One sentence on how the forms' choices compared, fed the same tokens."""
    ties, tolerance = other["near_ties"], other["tie_tolerance"]
    measured = (f"their logits at the same prefix differ by up to {other['logit_difference_max']:.4g} (median "
                f"of the steps' largest {other['logit_difference_median']:.4g})")
    if not ties:
        return f"fed the same tokens, both forms choose alike at all {other['steps_compared']} steps; {measured}"
    worst = max(ties, key=lambda t: t["logit_gap"])
    verdict = ("within" if other["choices_agree_within_tolerance"] else "NOT within")
    return (f"fed the same tokens, weights {other['weights']} chooses differently at {len(ties)} of "
            f"{other['steps_compared']} steps (first at token {ties[0]['position'] + 1}), where weights "
            f"{reference_weights}'s logits for the two tokens lie at most {worst['logit_gap']:.4g} apart: {verdict} "
            f"--tie-tolerance {tolerance:g} logits" + (", so either token is a correct greedy choice (a near-tie)"
                                                      if other["choices_agree_within_tolerance"] else "")
            + f"; {measured}")
