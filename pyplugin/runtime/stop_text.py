"""Generated text as it comes, cut at the request's stop strings (the loop's and the batching loop's)."""

from __future__ import annotations

from typing import Sequence


class StopText:
    """Text from tokens as it comes: whole characters only, held back while it could still become a stop
    string, cut before the first one (then `stopped`)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.decoder, self.stops = tokenizer.stream_decoder(), stops
        self.pending, self.stopped = "", False

    def push(self, token: int) -> str:
        """The text that is ready after `token` (all that is left, cut, once a stop string appears)."""
        self.pending += self.decoder.push(token)
        cut = _find_stop(self.pending, self.stops)
        if cut is not None:
            self.stopped = True
            piece, self.pending = self.pending[:cut], ""
            return piece
        ready = len(self.pending) - _held_back(self.pending, self.stops)
        piece, self.pending = self.pending[:ready], self.pending[ready:]
        return piece

    def finish(self) -> str:
        """What is left once no token follows (cut at a stop string it completes)."""
        if self.stopped:
            return ""
        text = self.pending + self.decoder.flush()
        cut = _find_stop(text, self.stops)
        if cut is not None:
            self.stopped, text = True, text[:cut]
        self.pending = ""
        return text


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
