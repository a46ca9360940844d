"""The prompt a request becomes: rendered, tokenized and, where it does not fit the context, shortened
from the front as Ollama does rather than refused.

A prompt longer than num_ctx is cut so that it leaves room to answer: room for num_predict tokens
where the request sets it (at most half the context), else half the context, as llama.cpp's server
leaves. A chat loses its oldest messages first, never its system messages nor the newest message
(Ollama's rule); what is still too long (one long message, a generate prompt, a `context` with more
after it) keeps its first num_keep tokens and loses the ones after them. Each cut is said in the log
and in the response's report. Only as much text as can survive the cut is ever tokenized, so a prompt
of megabytes costs what a prompt of num_ctx tokens costs.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import OptionsError
from ..model import Model
from ..runtime import Options
from .go_template import parsed
from .jobs import GenerationRequest


def answer_room(options: Options) -> int:
    """Tokens a shortened prompt leaves free for the answer."""
    half = options.num_ctx // 2
    return min(options.num_predict, half) if options.num_predict > 0 else half


def fit_messages(model: Model, messages: Sequence[dict], render: Callable[[list[dict]], str],
                 options: Options) -> tuple[str, int]:
    """The rendered chat and how many of its oldest messages were left out to fit num_ctx."""
    messages = list(messages)
    text = render(messages)
    if _fits(model, text, options.num_ctx):
        return text, 0
    budget = options.num_ctx - answer_room(options)
    # Oldest first among those that may go: everything but system messages and the newest message.
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

    def without(k: int) -> list[dict]:
        gone = set(droppable[:k])
        return [m for i, m in enumerate(messages) if i not in gone]

    # The fewest dropped that fit the budget: the prompt only shrinks as more go, so bisect.
    low, high = 0, len(droppable)
    while low < high:
        mid = (low + high) // 2
        if _fits(model, render(without(mid)), budget):
            high = mid
        else:
            low = mid + 1
    return render(without(low)), low


def fit_tokens(model: Model, text: str, context: Sequence[int], options: Options) -> tuple[list[int], bool]:
    """`context` followed by the tokens of `text`, and whether it was cut to fit num_ctx."""
    tokenizer, num_ctx = model.tokenizer, options.num_ctx
    context = list(context)

    def encode(text: str) -> list[int]:
        if not context:
            return tokenizer.encode(text)
        # After a context the text continues a sequence: no second BOS, not even one the template wrote.
        ids = tokenizer.encode(text, add_bos=False)
        return ids[1:] if ids[:1] == [tokenizer.bos_id] else ids

    if len(context) + tokenizer.fewest_tokens(text) <= num_ctx:
        tokens = context + encode(text)
        if len(tokens) <= num_ctx:
            return tokens, False
    budget = num_ctx - answer_room(options)
    keep = min(options.num_keep, budget)
    tail_text = tokenizer.enough_tail(text, budget - keep)
    if len(tail_text) == len(text):  # a short text after a long context: all of it is cheap
        whole = context + encode(text)
        return whole[:keep] + whole[len(whole) - (budget - keep):], True
    head = context[:keep]
    if len(head) < keep:  # the start that is kept runs on into the text
        head += encode(tokenizer.enough_text(text, keep))[:keep - len(head)]
    tail = tokenizer.encode(tail_text, add_bos=False)
    return head + tail[len(tail) - (budget - keep):], True


def insert_prompt(model: Model, request: GenerationRequest, template: str | None) -> str:
    """The fill-in-the-middle prompt of a generate with a `suffix` (the text after the gap; `prompt` the
    text before it), as Ollama renders it: through a Go template that reads .Suffix, given Prompt, Suffix
    and an empty Response only (no system message: a FIM prompt has no place for one), and else, as
    llama.cpp's /infill builds it, from the vocabulary's FIM tokens, in Qwen2.5-Coder's order:
    <|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>. `template`: the request's Go template,
    else the model's TEMPLATE layer (None: neither). A model with neither is refused, as Ollama refuses
    a model without the insert capability."""
    if request.raw:
        raise OptionsError("'suffix' is rendered through the model's template or its fill-in-the-middle tokens: "
                           "leave out raw (or leave out suffix and write the whole prompt yourself)")
    values = {"Prompt": request.prompt or "", "Suffix": request.suffix, "Response": ""}
    if template is not None:
        go = parsed(template)
        if "suffix" in go.fields:
            return go.render(values)
        if request.template is not None:
            raise OptionsError("the request's template does not read .Suffix, so 'suffix' would be lost: give one "
                               "that does ({{ .Prompt }}, {{ .Suffix }}), or leave out template")
    tokenizer = model.tokenizer
    if tokenizer.fim is None:
        raise OptionsError(f"{request.model} does not support insert: its template does not read .Suffix and its "
                           "vocabulary has no fill-in-the-middle tokens")
    prefix, suffix, middle = (tokenizer.tokens[i] for i in tokenizer.fim)
    return f"{prefix}{values['Prompt']}{suffix}{values['Suffix']}{middle}"


def cut_note(dropped: int, cut: bool, n_tokens: int, num_keep: int) -> str:
    """What was cut from a prompt to fit num_ctx, in words ("" if nothing)."""
    keep = min(num_keep, n_tokens)
    notes = ([f"left out the {dropped} oldest messages"] if dropped else []) + \
        ([f"kept the first {keep} and the last {n_tokens - keep} tokens"] if cut else [])
    return "; ".join(notes)


def check_context(model: Model, context: Sequence[int]) -> None:
    bad = [t for t in context if not 0 <= t < model.config.n_vocab]
    if bad:
        raise OptionsError(f"context holds token ids {bad[:5]} outside this model's vocabulary "
                           f"(0..{model.config.n_vocab - 1}); send the context a response of this "
                           "model returned")


def _fits(model: Model, text: str, limit: int) -> bool:
    if model.tokenizer.fewest_tokens(text) > limit:
        return False  # known without tokenizing
    return len(model.tokenizer.encode(text)) <= limit


def embed_inputs(model: Model, texts: Sequence[str], truncate: bool, num_ctx: int) -> list[list[int]]:
    """The token ids of each text to embed: cut to num_ctx where `truncate`, else refused past it."""
    inputs = []
    for n, text in enumerate(texts):
        if not text:  # its tokens would be the BOS alone: an embedding of nothing
            raise OptionsError(f"input {n} is empty: there is nothing to embed")
        if truncate:
            text = model.tokenizer.enough_text(text, num_ctx)
        elif model.tokenizer.fewest_tokens(text) > num_ctx:
            raise OptionsError(f"input {n} is more than num_ctx ({num_ctx}) tokens; set truncate to true, raise "
                               "num_ctx or shorten it")
        tokens = model.tokenizer.encode(text)
        if len(tokens) > num_ctx and not truncate:
            raise OptionsError(f"input {n} is {len(tokens)} tokens, more than num_ctx ({num_ctx}); set truncate "
                               "to true, raise num_ctx or shorten it")
        inputs.append(tokens[:num_ctx])
    return inputs
