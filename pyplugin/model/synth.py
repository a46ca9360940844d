"""Synthetic GGUF models: random weights in the layouts llama.cpp's converter writes, a real
tokenizer learned from a small built-in text, and a chat template.

Tests build their tiny models with it and the demo model (pyplugin.serving.registry) is one. Every file it
writes says "random weights" in general.name and carries ``pebbling.random_weights = true``.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, RopeScalingType
from tokenizers import Regex, pre_tokenizers

from ..ggml_types import SUPPORTED_NAMES
from .load import RANDOM_WEIGHTS_KEY, SUPPORTED_ARCHS
from .synth_quant import quantize
from .tokenizer import BYTE, CONTROL, NORMAL, PRE_TOKENIZERS, SPACE, UNKNOWN, UNUSED, bytes_to_unicode

T = GGMLQuantizationType

CORPUS = """\
The quick brown fox jumps over the lazy dog. A memory plugin moves the state of each layer between
the device and the host, so a model runs in any budget at or above its smallest footprint. Pebbles
are red when they sit in device memory and blue when they wait in the host tier. It's a game of
trade-offs: we don't keep what we can restore in time, and they'll stream what they must.
Numbers such as 12, 345 and 6789 appear in text; so do prices like $42.50 and dates like 2024-05-17.
Hello world! Hello again, world. How are you today? I'm fine, thanks; and you?
Café, naïve, façade, über, smörgåsbord. 日本語のテキスト。Привет, мир! 🙂
def forward(x):
    return layer(x) + x
"""

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% if messages and messages[0]['role'] not in ('system', 'user') %}"
    "{{ raise_exception('the first message must come from the system or the user') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF metadata holds it."""

    model: str                          # tokenizer.ggml.model: "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    chat_template: str = ""


@dataclass(frozen=True)
class SynthSpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 512
    vocab: str = "llama3"               # "llama3" or "chatml" (byte-level BPE), "spm" (SentencePiece)
    pre: str | None = None              # BPE pre-tokenizer name; by default the flavour's own
    n_merges: int = 300
    pad_vocab_to: int = 0               # pad the vocabulary with unused tokens to this size (Qwen2's 151936)
    weight_type: str = "F32"            # every matrix, unless tensor_types says otherwise
    tensor_types: dict[str, str] = field(default_factory=dict)  # role ("ffn_down", "token_embd"...) -> type
    tied_output: bool = False           # no output.weight: the output reuses token_embd
    rope_theta: float = 10000.0
    rope_dims: int | None = None        # default: the whole head
    rope_linear_factor: float | None = None
    rope_freqs: bool = False            # a llama3-style rope_freqs tensor
    rms_eps: float = 1e-5
    chat_template: str | None = None    # None: the vocab flavour's template; "": none at all
    name: str | None = None
    description: str = "synthetic model with random weights, written by pyplugin.model.synth"
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # keys written last, over the ones above

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def write_gguf(path: str | os.PathLike, spec: SynthSpec | None = None, **overrides) -> Path:
    """Write a random-weight GGUF for ``spec`` (fields may be given as keywords) to ``path``."""
    spec = replace(spec or SynthSpec(), **overrides)
    if spec.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch {spec.arch!r}: choose one of {', '.join(SUPPORTED_ARCHS)}")
    for name in {spec.weight_type, *spec.tensor_types.values()}:
        if name not in T.__members__:  # any GGUF type: tests write unsupported ones to see them refused
            raise ValueError(f"tensor type {name!r}: choose one of {', '.join(SUPPORTED_NAMES)}")
    vocab = build_vocab(spec.vocab, spec.n_merges, spec.pre)
    if spec.pad_vocab_to > len(vocab.tokens):  # a real-sized output matrix, as padded vocabularies have
        pad = range(len(vocab.tokens), spec.pad_vocab_to)
        vocab = replace(vocab, tokens=vocab.tokens + [f"[PAD{i}]" for i in pad],
                        types=vocab.types + [UNUSED] * len(pad))
    path = Path(path)
    writer = GGUFWriter(path, spec.arch)
    _add_hparams(writer, spec, len(vocab.tokens))
    _add_vocab(writer, vocab, spec)
    for key, value in spec.metadata.items():  # e.g. a crafted value, to see it refused
        writer.kv_data[0].pop(key, None)
        writer.add_key_value(key, value, _VALUE_TYPES[type(value)])  # np.uint32 for UINT32 keys
    for name, array, qtype in _tensors(spec, len(vocab.tokens)):
        try:
            data = quantize(array, qtype)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------------
# metadata


_VALUE_TYPES = {bool: GGUFValueType.BOOL, int: GGUFValueType.INT64, float: GGUFValueType.FLOAT32,
                str: GGUFValueType.STRING, np.uint32: GGUFValueType.UINT32}


def _add_hparams(w: GGUFWriter, spec: SynthSpec, n_vocab: int) -> None:
    w.add_name(spec.name or f"pebbling synthetic {spec.arch} (random weights)")
    w.add_description(spec.description)
    w.add_bool(RANDOM_WEIGHTS_KEY, True)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.rope_dims or spec.head_dim)
    if spec.rope_linear_factor:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_linear_factor)
    w.add_vocab_size(n_vocab)


def _add_vocab(w: GGUFWriter, vocab: Vocab, spec: SynthSpec) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    for add, token_id in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                          (w.add_eot_token_id, vocab.eot_id), (w.add_unk_token_id, vocab.unk_id)):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(vocab.add_bos)
    template = vocab.chat_template if spec.chat_template is None else spec.chat_template
    if template:
        w.add_chat_template(template)


# ---------------------------------------------------------------------------------------------------
# tensors


def _tensors(spec: SynthSpec, n_vocab: int) -> Iterable[tuple[str, np.ndarray, GGMLQuantizationType]]:
    """(name, float32 array in numpy order [out, in], type) for every tensor, as the converter names
    and lays them out."""
    e, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    q_rows, kv_rows = spec.n_head * hd, spec.n_head_kv * hd

    def matrix(role: str, name: str, rows: int, cols: int, scale: float | None = None):
        qtype = T[spec.tensor_types.get(role, spec.weight_type)]
        return name, _random(spec.seed, name, (rows, cols), scale or cols ** -0.5), qtype

    def vector(name: str, n: int, mean: float, scale: float):
        return name, mean + _random(spec.seed, name, (n,), scale), T.F32

    yield matrix("token_embd", "token_embd.weight", n_vocab, e, 1.0)
    yield vector("output_norm.weight", e, 1.0, 0.1)
    if not spec.tied_output:
        yield matrix("output", "output.weight", n_vocab, e)
    if spec.rope_freqs:
        n = (spec.rope_dims or hd) // 2
        yield "rope_freqs.weight", np.linspace(1.0, 8.0, n, dtype=np.float32), T.F32
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        yield vector(f"{b}.attn_norm.weight", e, 1.0, 0.1)
        yield vector(f"{b}.ffn_norm.weight", e, 1.0, 0.1)
        if spec.arch == "phi3":
            yield matrix("attn_qkv", f"{b}.attn_qkv.weight", q_rows + 2 * kv_rows, e)
            yield matrix("ffn_up", f"{b}.ffn_up.weight", 2 * ff, e)    # gate rows, then up rows
        else:
            name, wq, qt = matrix("attn_q", f"{b}.attn_q.weight", q_rows, e)
            name_k, wk, kt = matrix("attn_k", f"{b}.attn_k.weight", kv_rows, e)
            if spec.arch == "llama":  # the converter's row order, for GGML's normal RoPE mode
                wq, wk = permute_qk(wq, spec.n_head), permute_qk(wk, spec.n_head_kv)
            yield name, wq, qt
            yield name_k, wk, kt
            yield matrix("attn_v", f"{b}.attn_v.weight", kv_rows, e)
            yield matrix("ffn_gate", f"{b}.ffn_gate.weight", ff, e)
            yield matrix("ffn_up", f"{b}.ffn_up.weight", ff, e)
            if spec.arch == "qwen2":
                for t, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                    yield vector(f"{b}.{t}.bias", rows, 0.0, 0.1)
        yield matrix("attn_output", f"{b}.attn_output.weight", e, q_rows)
        yield matrix("ffn_down", f"{b}.ffn_down.weight", e, ff)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation of llama Q/K rows: within each head, rows (i, i + d/2) of the
    Hugging Face layout become the adjacent rows (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random(seed: int, name: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
    # Seeded per tensor name, so one tensor's values do not depend on which others are written.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(scale)  # in place: large models are written too
    return values


# ---------------------------------------------------------------------------------------------------
# vocabularies


def learn_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair (ties: the smallest
    pair), so the same text always gives the same merges."""
    words = Counter({tuple(w): c for w, c in words.items()})
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = Counter({_merge(w, best): c for w, c in words.items()})
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def build_vocab(flavour: str, n_merges: int = 300, pre: str | None = None) -> Vocab:
    """A small real tokenizer: 'llama3' or 'chatml' (byte-level BPE), or 'spm' (SentencePiece)."""
    if flavour == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
        return _byte_level_vocab(specials, pre or "llama-bpe", n_merges, bos=0, eos=1, eot=4,
                                 add_bos=True, template=LLAMA3_TEMPLATE)
    if flavour == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return _byte_level_vocab(specials, pre or "qwen2", n_merges, bos=0, eos=2, eot=2,
                                 add_bos=False, template=CHATML_TEMPLATE)
    if flavour == "spm":
        return _spm_vocab(n_merges)
    raise ValueError(f"vocab {flavour!r}: choose llama3, chatml or spm")


def _byte_level_vocab(specials: list[str], pre: str, n_merges: int, *, bos: int, eos: int, eot: int,
                      add_bos: bool, template: str) -> Vocab:
    splitter = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre].regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    words = Counter(w for w, _ in splitter.pre_tokenize_str(CORPUS))
    merges = learn_merges(words, n_merges)
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    normal = _unique(byte_chars + [a + b for a, b in merges])
    tokens = normal + specials  # specials last, as in Llama 3 and Qwen vocabularies
    n = len(normal)
    return Vocab("gpt2", tokens, [NORMAL] * n + [CONTROL] * len(specials),
                 merges=[f"{a} {b}" for a, b in merges], pre=pre, bos_id=n + bos, eos_id=n + eos,
                 eot_id=n + eot, add_bos=add_bos, chat_template=template)


def _spm_vocab(n_merges: int) -> Vocab:
    specials = ["<unk>", "<s>", "</s>"]
    chat = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    words = Counter(SPACE + w for w in CORPUS.split())
    merges = learn_merges(words, n_merges)
    chars = sorted({c for w in words for c in w})
    pieces = _unique([a + b for a, b in merges] + chars)  # best merges first: highest scores
    # <|endoftext|> last, after the pieces (so no id moves), as Phi-3's vocabulary has it: llama.cpp
    # looks it up in a file whose name says phi3 and refuses the file without it.
    tail = ["<|endoftext|>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + chat + pieces + tail
    types = ([UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [CONTROL] * len(chat) + [NORMAL] * len(pieces)
             + [CONTROL] * len(tail))
    scores = ([0.0] * (len(tokens) - len(pieces) - len(tail)) + [-float(i) for i in range(len(pieces))]
              + [0.0] * len(tail))
    return Vocab("llama", tokens, types, scores=scores, bos_id=1, eos_id=2,
                 eot_id=len(specials) + 256 + chat.index("<|end|>"), unk_id=0, add_bos=True,
                 chat_template=PHI3_TEMPLATE)
