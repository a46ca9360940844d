"""A request's life between the HTTP layer and a model's worker thread: the request as the HTTP layer
has checked it, its keep_alive, the queued or running `Job`, and the `Final` that ends its response.
Counts are tokens, durations nanoseconds, as in Ollama.
"""

from __future__ import annotations

import math
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import OptionsError
from ..runtime import Generation, Options, PebblingOptions
from ..runtime.logprobs import MAX_TOP_LOGPROBS

DEFAULT_KEEP_ALIVE = 300.0  # seconds; Ollama's default
FOREVER = math.inf
# Go's longest time.Duration (2^63 - 1 ns, about 292 years): a longer keep_alive is kept for good, as a
# negative one is, rather than overflowing a clock or a timer.
MAX_KEEP_ALIVE = (2**63 - 1) / 1e9


# ---------------------------------------------------------------------------------------------------
# request values


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
# A person's spelling of a unit ("5 minutes", "1 hour 30 mins"), read as the Go unit it stands for.
_UNIT_WORDS = re.compile(r"\s*(milliseconds?|msecs?|seconds?|secs?|minutes?|mins?|hours?|hrs?)\b", re.I)
_WORD_UNIT = {"msec": "ms", "millisecond": "ms", "sec": "s", "second": "s", "min": "m", "minute": "m",
              "hr": "h", "hour": "h"}
KEEP_ALIVE_HELP = 'seconds as a number, or a duration such as "10m", "1h30m" or "-1" (forever)'


def parse_keep_alive(value: Any, default: float = DEFAULT_KEEP_ALIVE) -> float:
    """Seconds to keep a model loaded after a request: None -> default, negative or past MAX_KEEP_ALIVE
    (1e10, 1e308, "3000000h") -> forever.

    Strings are Go durations as Ollama takes them ("5m", "1h30m", "0"), or a bare number of seconds.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        raise OptionsError(f"keep_alive: got {value!r}; accepted: {KEEP_ALIVE_HELP}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _go_duration(value.strip())
        if seconds is None:
            raise OptionsError(f"keep_alive: cannot read {value!r} as a duration; "
                               f"accepted: {KEEP_ALIVE_HELP}")
    else:
        raise OptionsError(f"keep_alive: got {type(value).__name__}; accepted: {KEEP_ALIVE_HELP}")
    if math.isnan(seconds):
        raise OptionsError(f"keep_alive: got {value!r}; accepted: {KEEP_ALIVE_HELP}")
    return FOREVER if seconds < 0 or seconds > MAX_KEEP_ALIVE else seconds


def spelled_duration(text: str) -> str:
    """A duration a person typed with its units spelled out ("5 minutes", "1 hour 30 min", "1h 30m") as
    the Go duration Ollama's API takes ("5m", "1h30m"); anything else comes back as it was. For the
    command line only: the API itself, as Ollama's, takes Go durations and numbers."""
    if not any(c.isalpha() for c in text):
        return text
    spelled = _UNIT_WORDS.sub(lambda m: _WORD_UNIT[m.group(1).lower().rstrip("s")], text.strip())
    return "".join(spelled.split())


def _go_duration(text: str) -> float | None:
    """A Go duration ("1h30m", "300ms") or a bare number of seconds; None when it is neither."""
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)  # a bare number: seconds
    except ValueError:
        pass
    if not body or _GO_PART.sub("", body):
        return None
    return sign * sum(float(n) * _GO_UNITS[unit] for n, unit in _GO_PART.findall(body))


@dataclass
class GenerationRequest:
    """One generate, chat or embed request, as the HTTP layer has already type-checked it."""

    model: str
    prompt: str | None = None                       # generate
    messages: list[dict[str, Any]] | None = None    # chat: [{"role", "content"}, ...], HF's tool_calls...
    system: str | None = None
    template: str | None = None                     # generate: an Ollama (Go) template
    suffix: str | None = None                       # generate: the text after the gap to fill (prompt: before it)
    raw: bool = False
    context: list[int] | None = None                # generate: the ids a previous response returned
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive: Any = None
    format: Any = None                              # generate, chat: "json" or a JSON schema the output follows
    tools: list[dict] | None = None                 # chat: functions the model may call, rendered by its template
    tool_choice: Any = None                         # chat: None/"auto", "required" or {"function": {"name"}}
    think: bool | str | None = None                 # generate, chat: on, off, a level (low, medium, high) or the default
    shift: bool = True                              # generate, chat: a full context shifts (else the reply ends)
    embed: list[str] | None = None                  # embed: the texts, one vector each
    truncate: bool = True                           # embed: cut an input longer than num_ctx (else refuse)
    dimensions: int | None = None                   # embed: keep the first N values of each vector
    normalize: bool = True                          # embed: unit length (not for the legacy /api/embeddings)
    logprobs: int | None = None                     # generate, chat: None, or logprobs with the N most likely
    started_ns: int = field(default_factory=time.perf_counter_ns)  # for total_duration

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise OptionsError(f"top_logprobs: got {self.logprobs}; accepted: 0 to {MAX_TOP_LOGPROBS}")

    @property
    def loads_only(self) -> bool:
        """Whether the request gives nothing to generate from, so that it only loads the model (or, with
        keep_alive 0, unloads it), as in Ollama: a chat without messages, a generate without a prompt (or a
        context to go on from). Asked of the request as the client sent it: a SYSTEM or MESSAGE turns of
        the model's Modelfile (modelfile.with_layers) are no prompt."""
        if self.embed is not None:
            return False
        return not self.messages if self.messages is not None else not self.prompt and not self.context


@dataclass(frozen=True)
class Final:
    """The end of a response: Ollama's counts (tokens) and durations (ns), plus pebbling's report."""

    model: str
    done_reason: str                  # "stop", "length", "load", "unload" or "cancelled"
    context: list[int]                # prompt + generated ids (generate's `context`)
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    report: dict[str, Any] | None = None
    embeddings: list[list[float]] | None = None  # an embed request's vectors, one per input
    logprobs: list[dict[str, Any]] | None = None  # every token's of the text, when the request asked

    def stats(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("total_duration", "load_duration", "prompt_eval_count",
                                              "prompt_eval_duration", "eval_count", "eval_duration")}


class Piece(str):
    """A piece of generated text that also carries the log probabilities of the tokens it came from
    (each {token, logprob, bytes, top_logprobs}): sent only when a request asks for logprobs, and a
    plain str to everything that only wants the text."""

    logprobs: list[dict[str, Any]]

    def __new__(cls, text: str, logprobs: list[dict[str, Any]]) -> "Piece":
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece

    @classmethod
    def of(cls, text: str, gen: Generation, sent: list[dict[str, Any]]) -> "Piece":
        """`text` with the logprobs of the tokens `gen` made since those in `sent` (which it extends)."""
        fresh = [t.json(gen.model.tokenizer) for t in gen.logprobs[len(sent):]]
        sent += fresh
        return cls(text, fresh)


# ---------------------------------------------------------------------------------------------------
# jobs


class Job:
    """One queued or running generation. Iterate it for text pieces (str), then one ``Final``; or
    call ``drain()`` without blocking after ``on_event`` says something arrived (for async servers)."""

    _END = object()

    def __init__(self, request: GenerationRequest, tokens: list[int], options: Options, pebbling: PebblingOptions,
                 keep_alive: float, load_ns: int):
        self.request, self.tokens, self.options, self.pebbling = request, tokens, options, pebbling
        self.inputs: list[list[int]] | None = None  # an embed job's token ids, one list per input
        self.constraint = None                      # the grammar its output follows (format), if any
        self.truncated = ""                         # what was cut from the prompt to fit num_ctx
        self.parser = None                          # splits its text into content, thinking and tool calls
        self.keep_alive, self.load_ns = keep_alive, load_ns
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._notify: Callable[[], None] | None = None
        self._notify_final_only = False
        self._finished = False
        self._held: BaseException | None = None

    @classmethod
    def answered(cls, request: GenerationRequest, reason: str, load_ns: int = 0) -> "Job":
        """A job over already: the done response ("load", "unload") of a request that only loads or unloads."""
        job = cls(request, [], Options(), PebblingOptions(), 0.0, load_ns)
        job._put(Final(request.model, reason, [], total_duration=since(request.started_ns), load_duration=load_ns))
        job._put(cls._END)
        return job

    def cancel(self) -> None:
        """Stop at the next token (or before starting) and free what the generation holds."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def on_event(self, notify: Callable[[], None], *, final_only: bool = False) -> None:
        """``notify()`` is called from the worker thread after each event is queued; with `final_only`
        (a response sent whole), only after the Final or an error, so that a batch of such requests does
        not wake the server's event loop once a token each."""
        self._notify, self._notify_final_only = notify, final_only
        if not self._events.empty():
            notify()

    def _put(self, item: Any) -> None:
        self._events.put(item)
        if self._notify is not None and (not self._notify_final_only or item is self._END
                                         or isinstance(item, (Final, BaseException))):
            self._notify()

    def drain(self) -> list[str | Final]:
        """What has arrived so far, without waiting. The generation's error is raised by the call
        after the one that returns the text that came before it."""
        items: list[str | Final] = []
        while not self._finished:
            if self._held is not None:
                item, self._held = self._held, None
            else:
                try:
                    item = self._events.get_nowait()
                except queue.Empty:
                    break
            if isinstance(item, BaseException) and items:
                self._held = item
                break
            if not self._consume(item):
                items.append(item)
        return items

    @property
    def finished(self) -> bool:
        return self._finished

    def __iter__(self) -> Iterator[str | Final]:
        while not self._finished:
            item = self._events.get()
            if not self._consume(item):
                yield item

    def result(self) -> tuple[str, Final]:
        """Waits for the whole response: (text, final)."""
        pieces = list(self)
        return "".join(p for p in pieces if isinstance(p, str)), pieces[-1]

    def _consume(self, item: Any) -> bool:
        """True for the end marker; raises an error item; False for text and the Final."""
        if item is self._END or isinstance(item, BaseException):
            self._finished = True
        if isinstance(item, BaseException):
            raise item
        return item is self._END


# ---------------------------------------------------------------------------------------------------
# values of a Final


def since(start_ns: int) -> int:
    return time.perf_counter_ns() - start_ns


def json_ready(value: Any) -> Any:
    """JSON-ready: numpy scalars become Python numbers, tuples lists (a report may hold either)."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else value
