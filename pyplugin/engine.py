"""The model manager behind the HTTP API, free of any web framework.

An ``Engine`` resolves model names, loads each model once and keeps it for its keep_alive (Ollama's
rules: default 5 minutes, 0 unloads after the request, a negative value keeps it for good), builds
prompts (raw, a request's template, or the model's chat template with an optional system message),
and runs generations. Each loaded model has one worker thread that takes its requests in arrival
order, so two requests never share a KV cache or the model's store; a request that waits is simply
queued. A job's cancel flag is checked before every token, so a client that goes away stops its
generation and frees what it held. Counts are tokens, durations nanoseconds, as in Ollama.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from . import ollama_store, registry
from .errors import ModelError, OptionsError, PebblingError
from .loop import Generation, PebbledModel
from .model import Model, load_model
from .model.gguf_file import GGUFFile
from .options import Options
from .plan import PebblingOptions

DEFAULT_KEEP_ALIVE = 300.0  # seconds; Ollama's default
logger = logging.getLogger("pebbling")
FOREVER = math.inf


class ModelNotFoundError(ModelError, LookupError):
    """No model has that name (HTTP 404)."""


# ---------------------------------------------------------------------------------------------------
# request values


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
KEEP_ALIVE_HELP = 'seconds as a number, or a duration such as "10m", "1h30m" or "-1" (forever)'


def parse_keep_alive(value: Any, default: float = DEFAULT_KEEP_ALIVE) -> float:
    """Seconds to keep a model loaded after a request: None -> default, negative -> forever.

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
    return FOREVER if seconds < 0 else seconds


def _go_duration(text: str) -> float | None:
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
class Request:
    """One generate or chat request, as the HTTP layer has already type-checked it."""

    model: str
    prompt: str | None = None                       # generate
    messages: list[dict[str, str]] | None = None    # chat: [{"role", "content"}, ...]
    system: str | None = None
    template: str | None = None                     # generate: an Ollama (Go) template
    raw: bool = False
    context: list[int] | None = None                # generate: the ids a previous response returned
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive: Any = None
    started_ns: int = field(default_factory=time.perf_counter_ns)  # for total_duration


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

    def stats(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("total_duration", "load_duration", "prompt_eval_count",
                                              "prompt_eval_duration", "eval_count", "eval_duration")}


# ---------------------------------------------------------------------------------------------------
# jobs


class Job:
    """One queued or running generation. Iterate it for text pieces (str), then one ``Final``; or
    call ``drain()`` without blocking after ``on_event`` says something arrived (for async servers)."""

    _END = object()

    def __init__(self, request: Request, tokens: list[int], options: Options, pebbling: PebblingOptions,
                 keep_alive: float, load_ns: int):
        self.request, self.tokens, self.options, self.pebbling = request, tokens, options, pebbling
        self.keep_alive, self.load_ns = keep_alive, load_ns
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._notify: Callable[[], None] | None = None
        self._finished = False
        self._held: BaseException | None = None

    def cancel(self) -> None:
        """Stop at the next token (or before starting) and free what the generation holds."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def on_event(self, notify: Callable[[], None]) -> None:
        """``notify()`` is called from the worker thread after each event is queued."""
        self._notify = notify
        if not self._events.empty():
            notify()

    def _put(self, item: Any) -> None:
        self._events.put(item)
        if self._notify is not None:
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
# loaded models


@dataclass
class _Loaded:
    key: Path                         # the resolved file: two names for one file share one model
    name: str                         # the name it was first asked for by
    weights: str                      # the form its weights are held in (pebbling_weights)
    model: Model | None = None
    pebbled: PebbledModel | None = None  # the model's layers in a pebble store
    expires_at: float = FOREVER       # time.monotonic() deadline once idle
    active: int = 0                   # requests queued or running
    last_report: dict[str, Any] | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: queue.Queue = field(default_factory=queue.Queue)
    worker: threading.Thread | None = None


@dataclass(frozen=True)
class ModelListing:
    """A model that can be served, for /api/tags and /api/show."""

    name: str
    path: Path
    size: int
    modified: float                   # seconds since the epoch
    digest: str                       # hex
    details: dict[str, Any]


@dataclass(frozen=True)
class RunningModel:
    """A loaded model, for /api/ps."""

    name: str
    path: Path
    size: int                         # bytes it holds (host weights)
    size_vram: int                    # bytes it holds in device memory, as last measured
    expires_at: float                 # seconds since the epoch; inf = never
    details: dict[str, Any]
    digest: str
    active: int                       # requests queued or running on it


class Engine:
    """Loads models on demand and serves generations; thread-safe. Call ``close()`` when done."""

    def __init__(self, models_dir: str | Path | None = None, *,
                 default_keep_alive: float = DEFAULT_KEEP_ALIVE, backend: str | None = None):
        self.models_dir = Path(models_dir) if models_dir is not None else registry.default_models_dir()
        self.default_keep_alive = default_keep_alive
        self.backend = backend  # the store backend; None: PEBBLING_BACKEND, else the first that works
        self._lock = threading.Condition()
        self._loaded: dict[tuple[Path, str], _Loaded] = {}  # by file and weight form
        self._closed = False
        self._info_cache: dict[tuple, dict[str, Any]] = {}
        # Jobs "completed", "cancelled" (stopped mid-way), "dropped" (cancelled while queued), "failed".
        self.counts: Counter = Counter()
        self._reaper = threading.Thread(target=self._reap, name="pebbling-keep-alive", daemon=True)
        self._reaper.start()

    # -- names --------------------------------------------------------------------------------------

    def resolve(self, name: str) -> Path:
        """The GGUF file for a model name. InvalidModelName before any file access for a name that
        could be a path; ModelNotFoundError when nothing has that name."""
        ollama_store.parse_name(name)
        try:
            return registry.resolve(name, self.models_dir, allow_paths=False)
        except ModelError as exc:
            if name in (registry.DEMO_NAME, f"{registry.DEMO_NAME}:latest"):  # could not be written
                raise
            registry_error = exc
        # Namespaced Ollama names (me/model:tag) never reach the registry's own lookup.
        found = ollama_store.resolve(name)
        if found is not None:
            return found.path
        raise ModelNotFoundError(f"model '{name}' not found") from registry_error

    # -- generation ---------------------------------------------------------------------------------

    def submit(self, request: Request) -> Job:
        """Validate, load the model if needed, build the prompt and queue the generation.

        Raises before anything is queued: InvalidModelName / ModelNotFoundError for the name,
        OptionsError (and StrategyError) for options, ChatTemplateError for a refused conversation.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        pebbling = PebblingOptions.from_options(request.options)
        keep_alive = parse_keep_alive(request.keep_alive, self.default_keep_alive)
        entry, load_ns = self._acquire(request.model, pebbling.effective_weights)
        try:
            model = entry.model
            options = Options.from_dict(request.options, n_ctx_train=model.config.n_ctx_train)
            tokens = self._prompt_tokens(model, request)
            entry.pebbled.plan(options, pebbling, len(tokens))  # a budget that cannot fit is refused here
            if tokens and len(tokens) > options.num_ctx:
                raise OptionsError(f"the prompt is {len(tokens)} tokens, more than num_ctx "
                                   f"({options.num_ctx}); raise num_ctx (this model allows up to "
                                   f"{model.config.n_ctx_train}) or shorten the prompt")
            job = Job(request, tokens, options, pebbling, keep_alive, load_ns)
            if not tokens:  # Ollama: an empty prompt only loads the model, keep_alive 0 unloads it
                reason = "unload" if keep_alive == 0 else "load"
                self._release(entry, keep_alive)
                job._put(Final(request.model, reason, [], total_duration=_since(request.started_ns),
                               load_duration=load_ns))
                job._put(Job._END)
                return job
        except BaseException:
            self._release(entry, keep_alive)
            raise
        entry.jobs.put(job)  # entry.active counts it, so the worker cannot have been told to stop
        return job

    def _prompt_tokens(self, model: Model, request: Request) -> list[int]:
        if request.messages is not None:
            if not request.messages:
                return []
            text = model.chat_prompt(list(request.messages))
        else:
            prompt = request.prompt or ""
            if not prompt and not request.context:
                return []
            if request.raw:
                text = prompt
            elif request.template is not None:
                text = render_go_template(request.template, {"System": request.system or "",
                                                             "Prompt": prompt, "Response": ""})
            else:
                messages = [{"role": "system", "content": request.system}] if request.system else []
                text = model.chat_prompt(messages + [{"role": "user", "content": prompt}])
        context = list(request.context or [])
        bad = [t for t in context if not 0 <= t < model.config.n_vocab]
        if bad:
            raise OptionsError(f"context holds token ids {bad[:5]} outside this model's vocabulary "
                               f"(0..{model.config.n_vocab - 1}); send the context a response of this "
                               "model returned")
        # After a context the text continues a sequence, so no second BOS.
        return context + model.tokenizer.encode(text, add_bos=False if context else None)

    def _run(self, entry: _Loaded, job: Job) -> Final | None:
        """Generate for one job, streaming its text; its Final, or None if it was cancelled first."""
        if job.cancelled:  # the client left while the request waited
            return None
        gen = Generation(entry.model, job.options, layers=entry.pebbled.layers(job.options, job.pebbling, len(job.tokens)),
                         xp=entry.pebbled.xp, should_stop=lambda: job.cancelled)
        for piece in gen.text(job.tokens):
            if job.cancelled:
                break
            job._put(piece)
        stats, report = gen.stats, _report(gen, job.pebbling)
        entry.last_report = report
        return Final(job.request.model, "cancelled" if job.cancelled else stats.done_reason or "stop",
                     job.tokens + gen.generated, total_duration=_since(job.request.started_ns),
                     load_duration=job.load_ns, prompt_eval_count=stats.prompt_tokens,
                     prompt_eval_duration=stats.prompt_ns, eval_count=stats.generated_tokens,
                     eval_duration=stats.generate_ns, report=report)
        # `gen`, and the KV cache it holds, is freed on return: before the next job allocates its own.

    def _work(self, entry: _Loaded) -> None:
        while True:
            job = entry.jobs.get()
            if job is None:
                return
            try:
                outcome: Final | BaseException | None = self._run(entry, job)
            except Exception as exc:
                if not isinstance(exc, PebblingError):  # a bug, not a bad request: keep the trace
                    logger.exception("generation for %r failed", job.request.model)
                outcome = exc
            with self._lock:
                self.counts["failed" if isinstance(outcome, Exception) else "dropped" if outcome is None
                            else "cancelled" if job.cancelled else "completed"] += 1
            # Released before the client hears the end, so keep_alive 0 has unloaded by then.
            self._release(entry, job.keep_alive)
            if outcome is not None:
                job._put(outcome)
            job._put(Job._END)

    # -- loading and keep_alive ---------------------------------------------------------------------

    def _acquire(self, name: str, weights: str) -> tuple[_Loaded, int]:
        """The loaded entry for `name` with its weights in form `weights`, counted as active; (entry, ns
        spent loading it here). Another form of the same file is another entry, as a load-time option
        is in Ollama: loaded beside the first, each unloading on its own keep_alive."""
        path = self.resolve(name)
        key = (path.resolve(), weights)
        with self._lock:
            entry = self._loaded.setdefault(key, _Loaded(key[0], name, weights))
            entry.active += 1
        with entry.load_lock:
            if entry.model is not None:
                return entry, 0
            start = time.perf_counter_ns()
            try:
                entry.model = load_model(path, weights=weights, progress=False)
                entry.pebbled = PebbledModel(entry.model, backend=self.backend, keep_host_weights=False)
            except BaseException:
                with self._lock:  # a request still waiting on load_lock tries again, and says why
                    entry.active -= 1
                    if entry.active == 0 and self._loaded.get(key) is entry:
                        del self._loaded[key]
                raise
            entry.worker = threading.Thread(target=self._work, args=(entry,), daemon=True,
                                            name=f"pebbling-model-{name}")
            entry.worker.start()
            return entry, time.perf_counter_ns() - start

    def _release(self, entry: _Loaded, keep_alive: float | None) -> None:
        """One request is done with `entry`; keep_alive (seconds) sets when it unloads once idle."""
        with self._lock:
            entry.active -= 1
            if keep_alive is not None:
                entry.expires_at = time.monotonic() + keep_alive
            if entry.active == 0 and entry.expires_at <= time.monotonic():
                self._unload(entry)
            self._lock.notify_all()

    def _unload(self, entry: _Loaded) -> None:
        # Called with self._lock held and entry idle. The worker thread ends on the sentinel.
        if self._loaded.get((entry.key, entry.weights)) is entry:
            del self._loaded[(entry.key, entry.weights)]
        entry.model = None
        if entry.pebbled is not None:
            entry.pebbled.close()
            entry.pebbled = None
        entry.jobs.put(None)

    def _reap(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for entry in list(self._loaded.values()):
                    if entry.active == 0 and entry.model is not None and entry.expires_at <= now:
                        self._unload(entry)
                deadlines = [e.expires_at for e in self._loaded.values() if e.active == 0]
                wait = min(deadlines, default=FOREVER) - now
                self._lock.wait(timeout=None if wait == FOREVER else max(wait, 0.01))

    def unload(self, name: str) -> None:
        """Unload `name` as soon as no request uses it."""
        path = self.resolve(name).resolve()
        with self._lock:
            for entry in [e for e in self._loaded.values() if e.key == path]:
                entry.expires_at = 0.0
                if entry.active == 0:
                    self._unload(entry)

    def close(self) -> None:
        """Stop taking requests; each model unloads once the requests it has queued are done."""
        with self._lock:
            self._closed = True
            for entry in list(self._loaded.values()):
                entry.expires_at = 0.0
                if entry.active == 0:
                    self._unload(entry)
            self._lock.notify_all()

    # -- listing ------------------------------------------------------------------------------------

    def list_models(self) -> list[ModelListing]:
        """Every model that can be served: the demo, the models directory, Ollama's store."""
        found: dict[str, Path] = {}
        for name in registry.available(self.models_dir):
            try:
                found[name] = registry.resolve(name, self.models_dir, allow_paths=False)
            except ModelError:
                continue  # e.g. the demo cannot be written here; /api/tags still answers
        for m in ollama_store.list_models():
            found.setdefault(m.name, m.path)
        listings = []
        for name, path in sorted(found.items()):
            try:
                listings.append(self._listing(name, path))
            except (ModelError, OSError):
                continue  # an unreadable file is not offered; asking for it by name says why
        return listings

    def show(self, name: str) -> tuple[ModelListing, dict[str, Any]]:
        """(listing, extra) for /api/show: extra holds model_info (GGUF metadata), template, parameters."""
        path = self.resolve(name)
        listing = self._listing(name, path)
        return listing, self._info(path)["show"]

    def running(self) -> list[RunningModel]:
        with self._lock:
            entries = [e for e in self._loaded.values() if e.model is not None]
        now_mono, now = time.monotonic(), time.time()
        out = []
        for e in entries:
            model = e.model
            if model is None:
                continue
            nb = model.nbytes
            expires = FOREVER if e.expires_at == FOREVER else now + max(0.0, e.expires_at - now_mono)
            if e.active:  # in use: it will be kept at least until its keep_alive after this request
                expires = max(expires, now)
            info = self._info(e.key)
            details = {**info["details"], "pebbling_weights": e.weights}
            out.append(RunningModel(e.name, e.key, sum(nb.layer_host) + nb.outer_host,
                                    _device_bytes(e.last_report), expires, details, info["digest"], e.active))
        return out

    def _listing(self, name: str, path: Path) -> ModelListing:
        info = self._info(path)
        return ModelListing(name, path, info["size"], info["modified"], info["digest"], info["details"])

    def _info(self, path: Path) -> dict[str, Any]:
        """Details read from the file's header, cached while the file is unchanged."""
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        info = self._info_cache.get(key)
        if info is None:
            info = _read_info(path, st)
            self._info_cache[key] = info
        return info


# ---------------------------------------------------------------------------------------------------
# helpers


def _since(start_ns: int) -> int:
    return time.perf_counter_ns() - start_ns


def _report(gen: Generation, pebbling: PebblingOptions) -> dict[str, Any]:
    """The loop's pebbling report; until the loop makes one, what was asked for (nothing measured)."""
    report = getattr(gen, "report", None)
    if callable(report):
        report = report()
    if isinstance(report, dict):
        return _plain(report)
    return {"strategy": str(pebbling.strategy) if pebbling.strategy else None,
            "enabled": pebbling.enabled, "budget_bytes": pebbling.memory_limit}


def _plain(value: Any) -> Any:
    """JSON-ready: numpy scalars become Python numbers, tuples lists (a report may hold either)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else value


def _device_bytes(report: dict[str, Any] | None) -> int:
    """Device memory a model held at its last request: only a measurement on a real GPU counts."""
    if not report or report.get("backend") != "cuda":
        return 0
    return int(report.get("measured_peak_bytes") or 0)


def _read_info(path: Path, st) -> dict[str, Any]:
    with GGUFFile(path) as f:
        md = f.metadata
        arch = str(md.get("general.architecture", "unknown"))
        n_params = sum(math.prod(t.shape) for t in f.tensors.values())
        by_type = Counter()
        for t in f.tensors.values():
            if len(t.shape) >= 2:
                by_type[t.qtype.name] += t.nbytes
        scalars = {k: v for k, v in md.items()
                   if not isinstance(v, (list, bytes)) and k != "tokenizer.chat_template"}
    most_bytes = by_type.most_common(1)[0][0] if by_type else "unknown"
    quant = _file_type(md.get("general.file_type")) or most_bytes
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
               "parameter_size": format_parameters(n_params), "quantization_level": quant}
    # Content digests of multi-GB files are too slow for a listing; the blob name is one for
    # Ollama's store, and elsewhere the path, size and mtime identify this version of the file.
    digest = path.name[len("sha256-"):] if path.name.startswith("sha256-") else hashlib.sha256(
        f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    scalars["general.parameter_count"] = n_params
    show = {"model_info": scalars, "template": md.get("tokenizer.chat_template", ""),
            "parameters": "", "license": str(md.get("general.license", "")),
            "modelfile": f"# pebbling serves this GGUF file as is\nFROM {path}\n",
            "capabilities": ["completion"]}
    return {"size": st.st_size, "modified": st.st_mtime, "digest": digest, "details": details,
            "show": show}


def _file_type(value: Any) -> str | None:
    from gguf import LlamaFileType
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def format_parameters(n: int) -> str:
    """Ollama's parameter_size: 8.0B, 494.03M, 12.34K."""
    for unit, size, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 2)):
        if n >= size:
            return f"{n / size:.{digits}f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------------
# Ollama's `template` request field: the part of Go's text/template that prompt templates use


_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
TEMPLATE_HELP = ("{{ .System }}, {{ .Prompt }}, {{ .Response }}, {{ if .X }}...{{ else }}...{{ end }} "
                 "and the '-' trim markers")


def render_go_template(template: str, values: Mapping[str, str]) -> str:
    """Render a Go text/template that uses only variables and if/else/end on them.

    Anything else (range, functions, pipelines) is refused with a message, rather than rendered
    wrongly: a prompt that silently differs from what the template meant is worse than an error.
    """
    tokens: list[tuple[str, str]] = []  # ("text", s) or ("action", body)
    pos = 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if tokens and tokens[-1][0] == "trim_next":
            tokens.pop()
            text = text.lstrip()
        tokens.append(("text", text))
        tokens.append(("action", m.group(2)))
        if m.group(3):
            tokens.append(("trim_next", ""))
        pos = m.end()
    rest = template[pos:]
    if tokens and tokens[-1][0] == "trim_next":
        tokens.pop()
        rest = rest.lstrip()
    tokens.append(("text", rest))

    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this branch is taken, the enclosing output is on)

    def on() -> bool:  # each entry's `outer` already folds in the ones below it
        return not stack or (stack[-1][0] and stack[-1][1])

    for kind, body in tokens:
        if kind == "text":
            if on():
                out.append(body)
            continue
        if body.startswith("/*"):
            continue  # a comment
        var = re.fullmatch(r"\.(\w+)", body)
        cond = re.fullmatch(r"if\s+\.(\w+)", body)
        if var:
            if on():
                out.append(_template_value(values, var.group(1)))
        elif cond:
            stack.append((bool(_template_value(values, cond.group(1))), on()))
        elif body == "else" and stack:
            taken, outer = stack.pop()
            stack.append((not taken, outer))
        elif body == "end" and stack:
            stack.pop()
        else:
            raise OptionsError(f"template: {{{{ {body} }}}} is not supported; supported: {TEMPLATE_HELP}")
    if stack:
        raise OptionsError("template: an {{ if }} has no {{ end }}")
    return "".join(out)


def _template_value(values: Mapping[str, str], name: str) -> str:
    if name not in values:
        raise OptionsError(f"template: .{name} is not a field; fields: "
                           f"{', '.join('.' + k for k in values)}")
    return values[name]
