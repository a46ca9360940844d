"""Tokenizers for synthetic models: small real vocabularies learned from a built-in text, in the
layouts GGUF files of each family carry them (byte-level BPE as Llama 3 and Qwen write it, SentencePiece
as Llama 2 / Phi-3 and Gemma write it), with each family's chat template.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from tokenizers import Regex, pre_tokenizers

from .synth_vocab_gemma4 import GEMMA4_TEMPLATE, gemma4_vocab  # noqa: F401 (the template: for the tests)
from .tokenizer import (BYTE, CONTROL, NORMAL, PRE_TOKENIZERS, SPACE, UNKNOWN, UNUSED, USER_DEFINED,
                        bytes_to_unicode)

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

# The Llama 3 and ChatML flavours take tools as their families' templates do (Llama 3.1's JSON calls with
# "parameters", Qwen2.5's <tool_call> blocks); without tools they render as the plain formats.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call these functions. To call one, "
    "respond with JSON in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% elif message['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message['tool_calls'] %}{\"name\": \"{{ call['function']['name'] }}\", \"parameters\": "
    "{{ call['function']['arguments'] | tojson }}}{% endfor %}<|eot_id|>"
    "{% else %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% if messages and messages[0]['role'] not in ('system', 'user') %}"
    "{{ raise_exception('the first message must come from the system or the user') }}{% endif %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures within <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each call, return a JSON object "
    "with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['tool_calls'] %}<|im_start|>assistant\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] %}\n<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen 3's published chat template (its tokenizer_config.json, as its GGUF files carry it): the thinking of
# earlier turns dropped from the history, and enable_thinking false writing an empty thinking block.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
GEMMA_TEMPLATE = (  # Gemma's turns: a system message joins the first user turn; the assistant is "model"
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# gpt-oss's harmony format, written short after its own template: a system message with the reasoning effort, a
# developer message with the instructions and the tools as a TypeScript namespace, each turn a message on its
# channel; an assistant's thinking on the analysis channel where a call follows it, its calls on the commentary
# channel addressed to the function, the results from the function back to the assistant.
HARMONY_TEMPLATE = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- set instructions = messages[0].content if messages and messages[0].role in ("system", "developer") else none %}
{%- if instructions or tools %}<|start|>developer<|message|>
{%- if instructions %}# Instructions

{{ instructions }}
{%- endif %}
{%- if tools %}

# Tools

## functions

namespace functions {
{%- for t in tools %}

// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}

} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- for m in messages if m.role not in ("system", "developer") %}
{%- if m.role == "user" %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>
{{- c.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == "tool" %}<|start|>functions.{{ m.name or m.tool_name }} to=assistant<|channel|>commentary<|message|>
{{- m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF metadata holds it."""

    model: str                          # tokenizer.ggml.model: "gpt2", "llama" or "gemma4"
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
    add_space_prefix: bool | None = None  # SentencePiece's leading space; None: not written (llama.cpp: on)


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


def build_vocab(flavour: str, n_merges: int = 300, pre: str | None = None, pad_to: int = 0) -> Vocab:
    """A small real tokenizer: 'llama3', 'chatml', 'coder' (ChatML with Qwen2.5-Coder's fill-in-the-middle
    tokens), 'qwen3' or 'harmony' (gpt-oss's special tokens and chat format) (byte-level BPE), 'spm' or 'gemma'
    (SentencePiece), 'gemma4' (Gemma 4's BPE: synth_vocab_gemma4.py). `pad_to`: a Gemma vocabulary filled with
    unused pieces up to that many tokens."""
    if flavour == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
        return _byte_level_vocab(specials, pre or "llama-bpe", n_merges, bos=0, eos=1, eot=4,
                                 add_bos=True, template=LLAMA3_TEMPLATE)
    if flavour == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return _byte_level_vocab(specials, pre or "qwen2", n_merges, bos=0, eos=2, eot=2,
                                 add_bos=False, template=CHATML_TEMPLATE)
    if flavour == "coder":  # ChatML and Qwen2.5-Coder's fill-in-the-middle tokens, in its order
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
        return _byte_level_vocab(specials, pre or "qwen2", n_merges, bos=0, eos=2, eot=2,
                                 add_bos=False, template=CHATML_TEMPLATE)
    if flavour == "qwen3":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        return _byte_level_vocab(specials, pre or "qwen2", n_merges, bos=0, eos=2, eot=2,
                                 add_bos=False, template=QWEN3_TEMPLATE)
    if flavour == "harmony":  # o200k_harmony's special tokens (gpt-oss), in its order
        specials = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]
        return _byte_level_vocab(specials, pre or "gpt-4o", n_merges, bos=0, eos=2, eot=2,
                                 add_bos=False, template=HARMONY_TEMPLATE)
    if flavour == "spm":
        return _spm_vocab(n_merges)
    if flavour == "gemma":
        return _gemma_vocab(n_merges, pad_to)
    if flavour == "gemma4":
        return Vocab(**gemma4_vocab(CORPUS, learn_merges, n_merges, pad_to))
    raise ValueError(f"vocab {flavour!r}: choose llama3, chatml, coder, qwen3, harmony, spm, gemma or gemma4")


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


def _gemma_vocab(n_merges: int, pad_to: int = 0) -> Vocab:
    """Gemma's SentencePiece layout: <pad> <eos> <bos> <unk>, the turn markers, byte fallback, pieces; no
    leading space added to the text. `pad_to`: filler pieces up to that many tokens, as Gemma 3's 262144
    (unused pieces, so the tokenizer's size and not its behaviour grows)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    words = Counter(w for line in CORPUS.splitlines() for w in line.replace(" ", SPACE).split(SPACE) if w)
    words.update(SPACE + w for w in CORPUS.split())
    merges = learn_merges(words, n_merges)
    chars = sorted({c for w in words for c in w})
    pieces = _unique([a + b for a, b in merges] + chars)
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, USER_DEFINED, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    filler = max(0, pad_to - len(tokens))
    tokens += [f"<unused{i}>" for i in range(filler)]
    types += [UNUSED] * filler
    scores += [0.0] * filler
    return Vocab("llama", tokens, types, scores=scores, bos_id=2, eos_id=1, eot_id=specials.index("<end_of_turn>"),
                 unk_id=3, add_bos=True, chat_template=GEMMA_TEMPLATE, add_space_prefix=False)
