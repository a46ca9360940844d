"""The tokenizer a GGUF file carries, rebuilt with the ``tokenizers`` library as llama.cpp runs it.

Three kinds, chosen by ``tokenizer.ggml.model``:
- ``gpt2``: byte-level BPE. Tokens are stored in GPT-2's byte-to-unicode alphabet with a merge
  list; the pre-tokenizer regexes are chosen by ``tokenizer.ggml.pre`` (llama.cpp's table).
- ``llama``: SentencePiece BPE. Spaces are '▁', a piece's score is its merge priority, and a
  character missing from the vocabulary falls back to byte tokens <0xNN>.
- ``gemma4``: Gemma 4's BPE, merges over SentencePiece-style pieces (model/tokenizer_gemma4.py).
Control, user-defined and unknown (<unk>) tokens are matched in the text as whole tokens. Decoding
goes through raw bytes, so a character split across tokens comes out whole (see ``StreamDecoder``).

One quirk is keyed on the model's name, as llama.cpp keys it: when ``general.name`` contains "phi3"
or "phi-3" (any case), whitespace right after a special token is dropped (see ``rstrip_ids``).
"""

from __future__ import annotations

import codecs
import functools
import re
from functools import lru_cache
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models

from ..errors import ModelError
from . import tokenizer_gemma4 as gemma4
from .pre_tokenizers import PRE_TOKENIZERS  # noqa: F401 (the table: for the vocabularies and tests)
from .vocabulary import check_vocabulary, fim_token_ids

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # '▁', SentencePiece's visible space

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # no text with one in it can be encoded

# What C's isspace() takes for whitespace (llama.cpp strips these bytes only, never U+00A0 & co).
_C_WHITESPACE = " \t\n\v\f\r"

# Tokens that end a turn in common chat formats; llama.cpp treats these as end-of-generation too, and
# Qwen2.5-Coder's fill-in-the-middle padding, repository and file separators (its FIM_PAD, _REP, _SEP).
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                        "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
                        "<|fim_pad|>", "<|repo_name|>", "<|fim_repo|>", "<|file_sep|>",
                        "<eos>", "<turn|>", "<|tool_response>"})  # (the last three: Gemma 4's)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, int]:
    """str.translate's table from a byte-level token's characters to the bytes they stand for (as
    latin-1 characters); a character below 256 that stands for no byte goes to U+FFFF, so that a
    string holding one fails to encode as latin-1, as one holding any other stray character does."""
    table = {ord(c): b for b, c in bytes_to_unicode().items()}
    for code in range(256):
        table.setdefault(code, 0xFFFF)
    return table


HARMONY_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # a harmony reply's headers


def _piece_bytes(text: str, ty: int, kind: str, table: dict[int, int]) -> bytes:
    """The bytes token `text` of type `ty` stands for in a `kind` vocabulary (table: _byte_level_table)."""
    if ty == BYTE and kind in ("spm", "gemma4"):
        return bytes([int(text[3:-1], 16)])       # '<0x0A>'
    if ty == USER_DEFINED or ty in (CONTROL, UNKNOWN, UNUSED):
        return text.encode("utf-8")               # shown only when specials are asked for
    if kind in ("spm", "gemma4"):
        return text.replace(SPACE, " ").encode("utf-8")
    try:  # every character a byte of the byte-level alphabet
        return text.translate(table).encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


class Tokenizer:
    """Text <-> token ids for one model. ``kind`` is 'bpe' (byte-level), 'spm' (SentencePiece) or 'gemma4'."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None = None, *, kind: str,
                 merges: Sequence[str] = (), scores: Sequence[float] | None = None,
                 pre: str = "default", bos_id: int | None = None, eos_id: int | None = None,
                 eot_id: int | None = None, eom_id: int | None = None, unk_id: int | None = None,
                 add_bos: bool | None = None, add_space_prefix: bool = True, name: str = "",
                 fim_ids: tuple[int, int, int] | None = None):
        """`fim_ids`: the fill-in-the-middle tokens (fim_token_ids), matched in text as wholes whatever
        their type, as llama.cpp makes them control tokens."""
        if kind not in ("bpe", "spm", "gemma4"):
            raise ValueError(f"tokenizer kind must be 'bpe', 'spm' or 'gemma4', got {kind!r}")
        self.kind = kind
        self.tokens = list(tokens)
        self.types = list(token_types) if token_types is not None else [NORMAL] * len(self.tokens)
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_space_prefix = kind == "spm" and add_space_prefix
        if kind == "bpe":
            if pre not in PRE_TOKENIZERS:
                raise ValueError(f"pre-tokenizer {pre!r} is not supported; supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}")
            self.pre = PRE_TOKENIZERS[pre]
            self._hf = self._build_bpe(merges)
            default_add_bos = self.pre.add_bos
        elif kind == "gemma4":  # llama.cpp always adds its BOS, whatever the file says
            self._hf = gemma4.build(self._vocab(), merges)
            self._newlines = gemma4.NewlineRuns(self.tokens, self._vocab())
            default_add_bos = add_bos = True
        else:
            self._hf = self._build_spm(scores)
            default_add_bos = True
        self.add_bos = default_add_bos if add_bos is None else bool(add_bos)
        self.fim = fim_ids
        self._add_special_tokens()
        self.rstrip_ids = self._phi3_rstrip_ids(name)
        table = _byte_level_table()
        self._bytes = [_piece_bytes(t, ty, kind, table) for t, ty in zip(self.tokens, self.types)]
        self.eog_ids = frozenset(i for i in (eos_id, eot_id, eom_id) if i is not None) | frozenset(
            i for i in self._ids_of_types(CONTROL, USER_DEFINED) if self.tokens[i] in _EOG_TEXTS)
        for i in self.eog_ids:  # llama.cpp makes one of _EOG_TEXTS a control token (Gemma 4's <|tool_response>)
            if self.types[i] == USER_DEFINED and self.tokens[i] in _EOG_TEXTS:
                self.types[i] = CONTROL
        self._harmony()

    def _harmony(self) -> None:
        """gpt-oss's o200k_harmony vocabulary as llama.cpp treats it: <|end|> ends a message, not the reply (that
        ends at <|return|> or a tool's <|call|>); HARMONY_SHOWN are shown in the text, its channels read there."""
        ends = {self.tokens[i] for i in self.eog_ids}
        if not {"<|return|>", "<|call|>"} <= ends:
            return
        self.eog_ids = frozenset(i for i in self.eog_ids if self.tokens[i] != "<|end|>")
        for i in self._ids_of_types(CONTROL):
            if self.tokens[i] in HARMONY_SHOWN:
                self.types[i] = USER_DEFINED  # (its bytes are its text already)

    # -- construction ------------------------------------------------------------------------------

    def _vocab(self) -> dict[str, int]:
        # a duplicated string keeps its first id, as llama.cpp does: the first is the last one written
        n = len(self.tokens)
        return dict(zip(reversed(self.tokens), range(n - 1, -1, -1)))

    def _build_bpe(self, merges: Sequence[str]) -> _HFTokenizer:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        hf = _HFTokenizer(_models.BPE(self._vocab(), pairs, ignore_merges=self.pre.ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _build_spm(self, scores: Sequence[float] | None) -> _HFTokenizer:
        if scores is None:
            scores = [-float(i) for i in range(len(self.tokens))]
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        model = _models.BPE(self._vocab(), spm_merges(self.tokens, scores, self.types),
                            unk_token=unk, byte_fallback=True, fuse_unk=True)
        hf = _HFTokenizer(model)
        # Applied to each stretch of text between special tokens: llama.cpp prefixes a space at the
        # start and after every special token, then makes spaces visible.
        steps = [normalizers.Prepend(SPACE)] if self.add_space_prefix else []
        hf.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
        return hf

    def _add_special_tokens(self) -> None:
        # llama.cpp matches control, user-defined and unknown tokens (<unk>) in the text as wholes.
        # No rstrip=True for Phi-3 here: tokenizers would strip Unicode whitespace (U+00A0, U+3000...)
        # where llama.cpp strips only isspace() bytes; ``_strip_after_specials`` does it instead.
        ids = sorted(set(self._ids_of_types(CONTROL, USER_DEFINED, UNKNOWN)) | set(self.fim or ()))
        special = [(i, self.tokens[i], self.types[i]) for i in ids if self.tokens[i]]
        self._added_ids = frozenset(i for i, _, _ in special)
        self._hf.add_tokens([AddedToken(t, special=ty != USER_DEFINED, normalized=False)
                             for _, t, ty in special])

    def _phi3_rstrip_ids(self, name: str) -> frozenset[int]:
        """The special tokens after which whitespace is dropped. llama.cpp (llama_vocab::impl::load,
        "per token attributes") gives every special token the RSTRIP attribute when the lowercased
        general.name contains "phi-3" or "phi3", and takes it back from <unk>, <s> and
        <|endoftext|>: so Phi-3's template loses the newline after <|user|>, <|end|>, <|assistant|>.
        (llama.cpp refuses such a file if one of those three or </s> is missing; here a missing one is
        simply skipped.)"""
        lowered = name.encode("utf-8", "replace").lower()  # ASCII only, like C's tolower()
        if b"phi-3" not in lowered and b"phi3" not in lowered:
            return frozenset()
        last_id = {t: i for i, t in enumerate(self.tokens)}  # llama.cpp's token_to_id: last one wins
        keep = {last_id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        return frozenset(self._added_ids - keep)

    def _ids_of_types(self, *types: int) -> list[int]:
        """The ids whose token type is one of `types`, in order (one numpy pass: a vocabulary is 150k+)."""
        return np.flatnonzero(np.isin(np.asarray(self.types), types)).tolist()

    # -- use ---------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_text(self, token_id: int | None) -> str:
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < self.n_vocab else ""

    @property
    def bos_token(self) -> str:
        return self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        return self.token_text(self.eos_id)

    def is_special(self, token_id: int) -> bool:
        return self.types[token_id] in (CONTROL, UNKNOWN, UNUSED)

    @functools.cached_property
    def _longest_piece(self) -> int:
        """The most characters of input text one token can stand for (a byte-level token's string
        has a character per byte, at least as many as the text it covers)."""
        return max(1, max(map(len, self.tokens), default=1), max(map(len, self._bytes), default=1))

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), known without tokenizing: no token covers more than
        the longest piece's characters (and where whitespace after some specials is stripped, only
        the other characters count)."""
        kept = len(text) - sum(map(text.count, _C_WHITESPACE)) if self.rstrip_ids else len(text)
        return kept // self._longest_piece

    def encode_fragment(self, text: str) -> list[int]:
        """Token ids of `text` as a piece inside a longer text: no BOS and, for SentencePiece, no space
        prefixed (what a grammar engine needs to spell out the bytes it forces)."""
        text = _LONE_SURROGATE.sub("\ufffd", text)
        if self.kind == "spm":
            return [t.id for t in self._hf.model.tokenize(text.replace(" ", SPACE))] if text else []
        return self._encoded(text)[0]

    def _encoded(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The library's ids and their offsets in `text`; Gemma 4's runs of newlines settled as llama.cpp does."""
        encoding = self._hf.encode(text, add_special_tokens=False)
        if self.kind == "gemma4":
            return self._newlines.apply(text, encoding.ids, encoding.offsets, self._added_ids)
        return encoding.ids, encoding.offsets

    def enough_text(self, text: str, n_tokens: int) -> str:
        """A prefix of `text` whose tokens include the first `n_tokens` of the whole: what truncating
        to them needs tokenized, however long the text."""
        return text[:(n_tokens + 1) * self._longest_piece]

    def enough_tail(self, text: str, n_tokens: int) -> str:
        """A suffix of `text` whose tokens end with the last `n_tokens` of the whole (the tokens at the
        cut it starts with may differ): what truncating from the front needs tokenized."""
        return text[max(0, len(text) - (n_tokens + 1) * self._longest_piece):] if n_tokens > 0 else ""

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids. A BOS is
        added when the model asks for one (or ``add_bos``), unless the text already starts with it.
        A lone surrogate (from a command line's undecodable bytes, say) is read as U+FFFD."""
        text = _LONE_SURROGATE.sub("\ufffd", text)
        ids, offsets = self._encoded(text)
        if self.rstrip_ids:
            ids = self._strip_after_specials(text, ids, offsets)
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _strip_after_specials(self, text: str, ids: list[int],
                              offsets: list[tuple[int, int]]) -> list[int]:
        """llama.cpp's RSTRIP (tokenizer_st_partition): the text between a special token in
        ``rstrip_ids`` and the next special token loses its leading C whitespace (' \\t\\n\\v\\f\\r',
        however many) and is tokenized again on its own; nothing is left of it if it was all
        whitespace. ``offsets`` (characters of ``text``) tell the matched special tokens apart."""

        def matched(k: int) -> bool:  # a special token found in the text, not a piece of plain text
            start, end = offsets[k]
            return ids[k] in self._added_ids and text[start:end] == self.tokens[ids[k]]

        out: list[int] = []
        k, n = 0, len(ids)
        while k < n:
            out.append(ids[k])
            strip = ids[k] in self.rstrip_ids and matched(k)
            after = offsets[k][1]
            k += 1
            if not strip:
                continue
            nxt = k
            while nxt < n and not matched(nxt):
                nxt += 1
            fragment = text[after:offsets[nxt][0] if nxt < n else len(text)]
            stripped = fragment.lstrip(_C_WHITESPACE)
            if stripped == fragment:
                out += ids[k:nxt]
            elif stripped:
                out += self._encoded(stripped)[0]
            k = nxt
        return out

    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for; control tokens are empty unless ``special``."""
        if self.is_special(token_id) and not special:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of whole sequence of ids: the inverse of ``encode`` (the space SentencePiece put
        in front of the text is taken off again)."""
        text = b"".join(self.token_bytes(i, special=special) for i in ids).decode("utf-8", "replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self, *, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special=special)

    # -- from a GGUF file --------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: dict[str, Any], source: str) -> "Tokenizer":
        """Build from GGUF metadata; ``source`` (the file) names the culprit in errors."""
        kind = check_vocabulary(md, source)
        tokens = md["tokenizer.ggml.tokens"]
        ids = {name: md.get(f"tokenizer.ggml.{name}_token_id")
               for name in ("bos", "eos", "eot", "eom", "unknown")}
        try:
            return cls(tokens, md.get("tokenizer.ggml.token_type"), kind=kind,
                       merges=md.get("tokenizer.ggml.merges", ()),
                       scores=md.get("tokenizer.ggml.scores"),
                       pre=md.get("tokenizer.ggml.pre") or "default",
                       bos_id=ids["bos"], eos_id=ids["eos"], eot_id=ids["eot"], eom_id=ids["eom"],
                       unk_id=ids["unknown"], add_bos=md.get("tokenizer.ggml.add_bos_token"),
                       add_space_prefix=md.get("tokenizer.ggml.add_space_prefix", True),
                       name=md.get("general.name") or "", fim_ids=fim_token_ids(tokens, md))
        except Exception as exc:  # tokenizers' own errors: bad merges, bad regex...
            raise ModelError(f"{source}: cannot build the tokenizer: {exc}") from None


def spm_merges(tokens: Sequence[str], scores: Sequence[float],
               types: Sequence[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as a merge list: every split of a piece into two pieces, best score first.

    llama.cpp merges the adjacent pair whose concatenation has the highest score; a BPE merge list
    ordered by that score makes the same choices.
    """
    ids = {}
    for i, t in enumerate(tokens):
        if types[i] in (NORMAL, USER_DEFINED):
            ids.setdefault(t, i)
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


class StreamDecoder:
    """Turns generated token ids into text as they come, emitting only complete UTF-8 characters:
    a character split across tokens comes out with the token that completes it."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, special=self._special))

    def flush(self) -> str:
        """What is left at the end (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
