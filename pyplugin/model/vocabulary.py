"""The checks a GGUF file's tokenizer arrays must pass before a tokenizer is built from them (a load
and create both make them, so create takes no file that cannot be served), and its fill-in-the-middle
tokens, which /api/show reads without building one."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ModelError


def check_vocabulary(md: dict[str, Any], source: str) -> str:
    """The tokenizer's kind ('bpe', 'spm' or 'gemma4') from GGUF metadata, once the arrays it is built from are
    checked: ModelError naming the key for one that is missing, of the wrong type or not one entry per token (a
    token's type and score are looked up by its id: a short array would fail at generation), or for a merge of
    pieces the vocabulary lacks. Loading a model and create both call it: create takes no file that cannot be served."""
    kind = {"gpt2": "bpe", "llama": "spm", "gemma4": "gemma4"}.get(md.get("tokenizer.ggml.model"))
    if kind is None:
        raise ModelError(f"{source}: tokenizer model {md.get('tokenizer.ggml.model')!r} is not "
                         "supported; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece), "
                         "'gemma4' (Gemma 4's BPE)")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{source}: missing metadata key 'tokenizer.ggml.tokens'")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{source}: 'tokenizer.ggml.tokens' must be an array of strings")
    for key, what, of_type in (("token_type", "integers", int), ("scores", "numbers", (int, float))):
        values = md.get(f"tokenizer.ggml.{key}")
        if values is None:
            continue
        if not isinstance(values, list) or not all(isinstance(v, of_type) for v in values):
            raise ModelError(f"{source}: 'tokenizer.ggml.{key}' must be an array of {what}, one per token")
        if len(values) != len(tokens):
            raise ModelError(f"{source}: 'tokenizer.ggml.{key}' has {len(values)} entries and "
                             f"'tokenizer.ggml.tokens' {len(tokens)}: expected one per token")
    if kind in ("bpe", "gemma4"):
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise ModelError(f"{source}: {'byte-level ' if kind == 'bpe' else ''}BPE tokenizer without "
                             "'tokenizer.ggml.merges'")
        if not isinstance(merges, list):
            raise ModelError(f"{source}: 'tokenizer.ggml.merges' must be an array of strings")
        vocabulary = set(tokens)
        for i, merge in enumerate(merges):
            left, space, right = _split(merge, kind)
            if not (space and left in vocabulary and right in vocabulary and left + right in vocabulary):
                raise ModelError(f"{source}: 'tokenizer.ggml.merges'[{i}] is {str(merge)[:60]!r}: expected two "
                                 "tokens of the vocabulary separated by a space, which together are one too")
    return kind


def _split(merge: Any, kind: str) -> tuple[str, str, str]:
    """A merge's (left, " ", right), ("", "", "") for one that is not two pieces. Gemma 4's is cut at its first
    space after the first character, as llama.cpp reads them (a piece of it may start with a space)."""
    if not isinstance(merge, str):
        return "", "", ""
    at = merge.find(" ", 1 if kind == "gemma4" else 0)
    return (merge[:at], " ", merge[at + 1:]) if at >= 0 else ("", "", "")


# Fill-in-the-middle tokens (prefix, suffix, middle), found as llama.cpp finds them (llama_vocab::impl::load):
# the GGUF's ids, else the first token of one of these texts, in this order.
FIM_KEYS = (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
            ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
            ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"))
FIM_TEXTS = (("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
              "<|code_prefix|>"),
             ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
              "<|code_suffix|>"),
             ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
              "<|code_middle|>"))


def fim_token_ids(tokens: Sequence[str], metadata: dict[str, Any] | None = None) -> tuple[int, int, int] | None:
    """The vocabulary's fill-in-the-middle tokens (prefix, suffix, middle; Qwen2.5-Coder's <|fim_prefix|>,
    <|fim_suffix|>, <|fim_middle|>), from the GGUF's ids where it gives them, else by their text; None
    unless all three are there."""
    metadata = metadata or {}
    wanted = {text for texts in FIM_TEXTS for text in texts}
    first = {}
    for i, token in enumerate(tokens):
        if token in wanted:
            first.setdefault(token, i)
    found = []
    for keys, texts in zip(FIM_KEYS, FIM_TEXTS):
        given = next((metadata[k] for k in keys if isinstance(metadata.get(k), int) and 0 <= metadata[k] < len(tokens)),
                     None)
        found.append(given if given is not None else next((first[t] for t in texts if t in first), None))
    return tuple(found) if None not in found else None
