"""The byte-level BPE pre-tokenizers a GGUF file names in ``tokenizer.ggml.pre``: llama.cpp's regexes
(llama-vocab.cpp), each splitting the pieces the previous one produced, keeping matches and gaps alike.
"""

from __future__ import annotations

from dataclasses import dataclass

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a whole pre-token found in the vocabulary is used as is
    add_bos: bool = False         # llama.cpp's default when the file does not say


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER_PRE = PreTokenizer((r"\p{N}", _GPT2))
# gpt-oss's (o200k): llama.cpp's spelling of it, an upper-case letter as a letter not a-z (so that it splits
# text beyond ASCII as llama.cpp does, not as the original regex's \p{Lu})
_CASED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CASED +
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CASED +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_PRE = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_PRE),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"), _GPT2_PRE),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
                    _STARCODER_PRE),
    "gpt-4o": PreTokenizer((_GPT4O,)),
    "default": _DEFAULT_PRE,
}
