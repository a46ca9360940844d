"""Gemma 4's tokenizer (``tokenizer.ggml.model`` "gemma4"), as llama.cpp runs it: a BPE vocabulary with a merge
list, but written as SentencePiece writes pieces, not in GPT-2's byte alphabet.

- spaces become '▁' (U+2581) and nothing is put in front of the text;
- the text is split only into runs of newlines and runs of everything else (``[^\\n]+|[\\n]+``), each merged on
  its own, starting from its characters;
- a run of newlines that is itself a token is taken whole, merged or not (llama.cpp's fix for Gemma 4);
- what the merges leave outside the vocabulary falls back to byte tokens ``<0xNN>``;
- a BOS is always added (llama.cpp overrides a file that says otherwise).

The merges run in the ``tokenizers`` library, as for the other kinds (model/tokenizer.py); only the newline runs
are settled here, after it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models

SPACE = "\u2581"
SPLIT = r"[^\n]+|[\n]+"

# The tokens Gemma 4's converter marks user-defined so that they are shown in the reply (its chat parser reads
# them): the thinking channel, the tool calls and responses, and the string quote of their arguments.
SHOWN = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>')


def split_merge(merge: str) -> tuple[str, str]:
    """A merge's two pieces, cut at its first space after the first character (as llama.cpp reads them), or
    ("", "") where there is none."""
    at = merge.find(" ", 1)
    return (merge[:at], merge[at + 1:]) if at > 0 else ("", "")


def build(vocab: dict[str, int], merges: Sequence[str]) -> _HFTokenizer:
    """The ``tokenizers`` pipeline for one vocabulary: '▁' for spaces, the newline split, BPE from the characters
    with byte fallback (a byte whose token is missing is dropped, as llama.cpp drops it: no <unk>)."""
    hf = _HFTokenizer(_models.BPE(vocab, [split_merge(m) for m in merges], byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT), behavior="isolated")
    return hf


class NewlineRuns:
    """llama.cpp's rule for Gemma 4's runs of newlines: a run that is a token in the vocabulary is that token,
    whatever the merges make of it. Applied to the ids and offsets the merges gave."""

    def __init__(self, tokens: Sequence[str], vocab: dict[str, int]):
        newline_ids = [i for i, t in enumerate(tokens) if t and not t.strip("\n")]
        byte = vocab.get("<0x0A>")
        # the ids that can stand for part of a run: newline pieces, and the byte token for one
        self._parts = np.asarray(sorted(set(newline_ids) | ({byte} if byte is not None else set())), dtype=np.int64)
        self._whole = {t: vocab[t] for t in (tokens[i] for i in newline_ids) if t in vocab}

    def apply(self, text: str, ids: list[int], offsets: Sequence[tuple[int, int]],
              special: frozenset[int] = frozenset()) -> tuple[list[int], list[tuple[int, int]]]:
        """`ids` and their character `offsets` in `text`, with each run of newlines that is a token made that
        one token. `special`: ids matched as special tokens, never part of a run."""
        offsets = list(offsets)
        if "\n" not in text or not len(self._parts):
            return ids, offsets
        hits = np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), self._parts)).tolist()
        if not hits:
            return ids, offsets
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        done = 0
        k = 0
        while k < len(hits):
            start = hits[k]
            end = start + 1
            # the run's tokens: adjacent in the ids and in the text, each covering newlines only
            while k + 1 < len(hits) and hits[k + 1] == end and offsets[end][0] == offsets[end - 1][1]:
                k += 1
                end += 1
            k += 1
            if any(i in special for i in ids[start:end]):
                continue
            run = text[offsets[start][0]:offsets[end - 1][1]]
            whole = self._whole.get(run)
            if whole is not None and run and not run.strip("\n") and end - start > 1:
                out += ids[done:start]
                spans += offsets[done:start]
                out.append(whole)
                spans.append((offsets[start][0], offsets[end - 1][1]))
                done = end
        return (out + ids[done:], spans + offsets[done:]) if done else (ids, offsets)
