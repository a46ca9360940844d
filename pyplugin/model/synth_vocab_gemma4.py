"""The Gemma 4 flavour of the synthetic vocabularies (synth_vocab.build_vocab("gemma4")): Gemma 4's tokenizer
("gemma4": BPE merges over SentencePiece-style pieces, model/tokenizer_gemma4.py) learned from the built-in text,
its special tokens, byte fallback, and a chat template in Gemma 4's format.

The template is ours, written after the format Gemma 4's published template writes: turns ``<|turn>ROLE\\n ...
<turn|>\\n`` (the assistant's role "model"); a system turn first where there is a system message, tools or thinking
(``<|think|>`` switches thinking on); each tool declared as ``<|tool>declaration:NAME{...}<tool|>``; an
assistant's calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, followed in the same turn by the results
``<|tool_response>response:NAME{...}<tool_response|>``; strings in these quoted by ``<|"|>``; its thinking, where
it comes before calls that answer the last user message, as ``<|channel>thought\\n...<channel|>``; and, when
thinking is off, an empty thought after the generation prompt.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable

from .tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, UNUSED, USER_DEFINED
from .tokenizer_gemma4 import SHOWN, SPLIT

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
            "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
            "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>", "<|video|>"]
# Whole runs of newlines (and a tab) as Gemma 4's vocabulary has them, which no merge makes: llama.cpp takes such
# a run whole (the fourth newline run is left out, so that four newlines are merged from single ones).
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n\n", "\t"]

# Values, keys and declarations in Gemma 4's notation: strings between <|"|>, keys sorted, no spaces.
_MACROS = r"""
{%- macro value(v, quote_keys=true) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is mapping -%}{
{%- for k, item in v | dictsort -%}{{ ',' if not loop.first }}
{%- if quote_keys %}<|"|>{{ k }}<|"|>{% else %}{{ k }}{% endif %}:{{ value(item, quote_keys) }}
{%- endfor %}}
{%- elif v is sequence -%}[{% for item in v %}{{ ',' if not loop.first }}{{ value(item, quote_keys) }}{% endfor %}]
{%- else -%}{{ v }}
{%- endif -%}
{%- endmacro -%}
{%- macro names(items) -%}[{% for n in items %}{{ ',' if not loop.first }}<|"|>{{ n }}<|"|>{% endfor %}]{%- endmacro -%}
{%- macro schema(properties) -%}
{%- set fixed = ['description', 'type', 'properties', 'required', 'nullable'] -%}
{%- for key, p in properties | dictsort if key not in fixed -%}
{%- set kind = p['type'] | upper -%}
{%- set parts = [] -%}
{%- if p['description'] %}{% set parts = parts + ['description:<|"|>' ~ p['description'] ~ '<|"|>'] %}{% endif -%}
{%- if kind == 'STRING' and p['enum'] %}{% set parts = parts + ['enum:' ~ value(p['enum'])] %}{% endif -%}
{%- if kind == 'ARRAY' and p['items'] is mapping and p['items'] -%}
{%- set inner = namespace(parts=[]) -%}
{%- for ik, iv in p['items'] | dictsort if iv is not none -%}
{%- if ik == 'properties' -%}
{%- set inner.parts = inner.parts + ['properties:{' ~ (schema(iv) if iv is mapping else '') ~ '}'] -%}
{%- elif ik == 'required' -%}{% set inner.parts = inner.parts + ['required:' ~ names(iv)] %}
{%- elif ik == 'type' -%}
{%- set inner.parts = inner.parts + ['type:' ~ value(iv | upper if iv is string else iv | map('upper') | list)] -%}
{%- else -%}{% set inner.parts = inner.parts + [ik ~ ':' ~ value(iv)] %}
{%- endif -%}
{%- endfor -%}
{%- set parts = parts + ['items:{' ~ inner.parts | join(',') ~ '}'] -%}
{%- endif -%}
{%- if p['nullable'] %}{% set parts = parts + ['nullable:true'] %}{% endif -%}
{%- if kind == 'OBJECT' -%}
{%- set parts = parts + ['properties:{' ~ schema(p['properties'] if p['properties'] is mapping else p) ~ '}'] -%}
{%- if p['required'] %}{% set parts = parts + ['required:' ~ names(p['required'])] %}{% endif -%}
{%- endif -%}
{{ ',' if not loop.first }}{{ key }}:{{ '{' }}{{ (parts + ['type:<|"|>' ~ kind ~ '<|"|>']) | join(',') }}}
{%- endfor -%}
{%- endmacro -%}
{%- macro declaration(f) -%}
declaration:{{ f['name'] }}{description:<|"|>{{ f['description'] }}<|"|>
{%- set params = f['parameters'] -%}
{%- if params -%},parameters:{
{%- if params['properties'] %}properties:{ {{- schema(params['properties']) -}} },{% endif -%}
{%- if params['required'] %}required:{{ names(params['required']) }},{% endif -%}
{%- if params['type'] %}type:<|"|>{{ params['type'] | upper }}<|"|>}{% endif -%}
{%- endif -%}
{%- if 'response' in f -%},response:{
{%- if f['response']['description'] %}description:<|"|>{{ f['response']['description'] }}<|"|>,{% endif -%}
{%- if f['response']['type'] | upper == 'OBJECT' %}type:<|"|>OBJECT<|"|>}{% endif -%}
{%- endif -%}
}
{%- endmacro -%}
{%- macro result(name, r) -%}
<|tool_response>response:{{ name }}{
{%- if r is mapping -%}{% for k, v in r | dictsort %}{{ ',' if not loop.first }}{{ k }}:{{ value(v, false) }}{% endfor %}
{%- else -%}value:{{ value(r, false) }}{%- endif -%}
}<tool_response|>
{%- endmacro -%}
{%- macro text(content) -%}
{%- if content is string %}{{ content }}{% elif content is iterable -%}
{%- for part in content if part['type'] == 'text' %}{{ part['text'] }}{% endfor -%}{%- endif -%}
{%- endmacro -%}
"""

GEMMA4_TEMPLATE = _MACROS + r"""
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set first_system = messages and messages[0]['role'] in ['system', 'developer'] -%}
{%- set turns = messages[1:] if first_system else messages -%}
{{- bos_token -}}
{%- if thinking or tools or first_system -%}
<|turn>system
{% if thinking %}<|think|>
{% endif -%}
{%- if first_system %}{{ messages[0]['content'] | trim }}{% endif -%}
{%- for tool in tools or [] %}<|tool>{{ declaration(tool['function']) | trim }}<tool|>{% endfor -%}
<turn|>
{% endif -%}
{%- set last_user = namespace(at=-1) -%}
{%- for m in turns if m['role'] == 'user' %}{% set last_user.at = loop.index0 %}{% endfor -%}
{%- set state = namespace(after=none, previous=none) -%}
{%- for m in turns -%}
{%- if m['role'] != 'tool' -%}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
{%- if not (role == 'model' and state.previous == 'assistant') %}<|turn>{{ role }}
{% endif -%}
{%- set state.previous = m['role'] -%}
{%- set state.after = none -%}
{%- set reasoning = m.get('reasoning') or m.get('reasoning_content') -%}
{%- if reasoning and m.get('tool_calls') and last_user.at < loop.index0 -%}
<|channel>thought
{{ reasoning }}
<channel|>
{%- endif -%}
{%- for call in m.get('tool_calls') or [] -%}
<|tool_call>call:{{ call['function']['name'] }}{
{%- set args = call['function']['arguments'] -%}
{%- if args is mapping %}{% for k, v in args | dictsort %}{{ ',' if not loop.first }}{{ k }}:{{ value(v, false) }}{% endfor %}
{%- elif args is string %}{{ args }}{% endif -%}
}<tool_call|>
{%- set state.after = 'call' -%}
{%- endfor -%}
{%- set answered = namespace(any=false, open=true) -%}
{%- if m.get('tool_responses') -%}
{%- for r in m['tool_responses'] %}{{ result(r['name'] | default('unknown'), r['response']) }}{% endfor -%}
{%- set answered.any = true -%}
{%- set state.after = 'result' -%}
{%- elif m.get('tool_calls') -%}
{%- for k in range(loop.index0 + 1, turns | length) -%}
{%- set r = turns[k] -%}
{%- if r['role'] != 'tool' %}{% set answered.open = false %}{% endif -%}
{%- if answered.open -%}
{%- set name = namespace(v=r.get('name') | default('unknown')) -%}
{%- for call in m['tool_calls'] if call.get('id') == r.get('tool_call_id') %}{% set name.v = call['function']['name'] %}{% endfor -%}
{{ result(name.v, text(r.get('content')) if r.get('content') is not string and r.get('content') is iterable else r.get('content')) }}
{%- set answered.any = true -%}
{%- set state.after = 'result' -%}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- set body = text(m['content']) if m['content'] is not none else '' -%}
{%- if role == 'model' -%}
{%- set kept = namespace(s='') -%}
{%- for piece in body.split('<channel|>') %}{% set kept.s = kept.s + piece.split('<|channel>')[0] %}{% endfor -%}
{{ kept.s | trim }}
{%- else %}{{ body | trim }}{% endif -%}
{%- if state.after == 'call' and not answered.any %}<|tool_response>
{%- elif not (answered.any and not m['content']) %}<turn|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and state.after not in ['call', 'result'] -%}
<|turn>model
{% if not thinking %}<|channel>thought
<channel|>{% endif -%}
{%- endif -%}"""


def gemma4_vocab(corpus: str, learn_merges: Callable[[Counter, int], list[tuple[str, str]]], n_merges: int,
                 pad_to: int = 0) -> dict[str, Any]:
    """synth_vocab.Vocab's fields for Gemma 4's layout: <pad> <eos> <bos> <unk> <mask>, the turn, thinking and
    tool markers (those its reply is read by user-defined, so shown in the text), byte fallback, whole runs of
    newlines, then the pieces of the merges `learn_merges` learned from `corpus` (each line a word, spaces as '▁').
    `pad_to`: unused pieces up to that many tokens."""
    lines = re.findall(SPLIT, corpus.replace(" ", SPACE))
    words = Counter(w for w in lines if "\n" not in w)
    merges = learn_merges(words, n_merges)
    chars = sorted({c for w in words for c in w})
    pieces = [p for p in dict.fromkeys([a + b for a, b in merges] + chars) if p not in NEWLINES]
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + NEWLINES + pieces
    types = ([USER_DEFINED if t in SHOWN else UNKNOWN if t == "<unk>" else CONTROL for t in SPECIALS]
             + [BYTE] * 256 + [NORMAL] * (len(NEWLINES) + len(pieces)))
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(NEWLINES) + len(pieces))]
    filler = max(0, pad_to - len(tokens))
    tokens += [f"<unused{i}>" for i in range(filler)]
    types += [UNUSED] * filler
    scores += [0.0] * filler
    return dict(model="gemma4", tokens=tokens, types=types, merges=[f"{a} {b}" for a, b in merges], scores=scores,
                bos_id=SPECIALS.index("<bos>"), eos_id=SPECIALS.index("<eos>"), unk_id=SPECIALS.index("<unk>"),
                add_bos=True, chat_template=GEMMA4_TEMPLATE, add_space_prefix=False)
