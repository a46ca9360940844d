"""The model manager behind the HTTP API, free of any web framework.

An ``Engine`` resolves model names, loads each model once and keeps it for its keep_alive (Ollama's
rules: default 5 minutes, 0 unloads after the request, a negative value keeps it for good), builds
prompts (raw, a request's template, or the model's chat template with an optional system message),
and runs generations. Each loaded model has one worker thread that takes its requests in arrival
order and decodes up to num_parallel of them together, each with a KV cache of its own, one pass over
the layers per step (batching.py says which requests share a batch); the rest wait in its queue. A
job's cancel flag is checked before every token, so a client that goes away stops its generation and
frees what it held. Counts are tokens, durations nanoseconds, as in Ollama.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..errors import OptionsError, PebblingError
from ..kv_types import default_kv_type, kv_fallback
from ..model import Model, load_model
from ..runtime import Options, PebbledModel, PebblingOptions
from ..runtime.constraint import Constraint
from ..runtime.embedding import check_pooling, normalize, pool
from ..store import choose_backend
from .catalogue import Catalogue, ModelListing, RunningModel, ServerBusyError, model_errors, with_tag
from .batching import Batcher
from .loaded import Loaded
from .go_template import parsed
from .jobs import DEFAULT_KEEP_ALIVE, FOREVER, Final, GenerationRequest, Job, json_ready, parse_keep_alive, since
from .modelfile import ModelLayers, chat_renderer, show_fields, template_source, with_layers
from .prompt import check_context, cut_note, embed_inputs, fit_messages, fit_tokens, insert_prompt
from .reply import ReplyPlan
from .settings import (DEFAULT_MAX_CONTEXT, DEFAULT_MAX_QUEUE, DEFAULT_PARKED_KV_MIB, MAX_CONTEXT_ENV, MAX_QUEUE_ENV,
                       PARKED_KV_ENV, env_limit, parallel_limit)

logger = logging.getLogger("pebbling")


class Engine:
    """Loads models on demand and serves generations; thread-safe. Call ``close()`` when done."""

    def __init__(self, models_dir: str | Path | None = None, *,
                 default_keep_alive: float = DEFAULT_KEEP_ALIVE, backend: str | None = None,
                 max_queue: int | None = None, max_context: int | None = None, num_parallel: int | None = None,
                 parked_kv_bytes: int | None = None):
        """`max_queue`: requests queued or running at once across models, past which a request is
        refused with ServerBusyError (default $PEBBLING_MAX_QUEUE, else 512, as OLLAMA_MAX_QUEUE);
        `max_context`: the largest num_ctx served whatever a model file allows (default
        $PEBBLING_MAX_CONTEXT, else 131072), since the KV cache is reserved at num_ctx; `num_parallel`:
        the most requests to one model that decode together (default $PEBBLING_NUM_PARALLEL, else
        $OLLAMA_NUM_PARALLEL, else 4), each holding a KV cache at its num_ctx."""
        self.max_queue = env_limit(MAX_QUEUE_ENV, DEFAULT_MAX_QUEUE) if max_queue is None else max_queue
        self.max_context = env_limit(MAX_CONTEXT_ENV, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
        self.num_parallel = num_parallel if num_parallel is not None else parallel_limit()
        # Host memory per model for the KV caches of conversations a new one displaces (runtime/conversations.py).
        self.parked_kv_bytes = env_limit(PARKED_KV_ENV, DEFAULT_PARKED_KV_MIB) << 20 if parked_kv_bytes is None \
            else parked_kv_bytes
        if self.num_parallel < 1:
            raise ValueError(f"num_parallel must be at least 1, got {self.num_parallel}")
        default_kv_type()  # an unknown PEBBLING_KV_CACHE_TYPE is refused now, not by every request
        self.catalogue = Catalogue(models_dir)
        self.models_dir = self.catalogue.models_dir
        self.default_keep_alive = default_keep_alive
        self.backend = backend  # the store backend; None: PEBBLING_BACKEND, else the first that works
        self._lock = threading.Condition()
        self._loaded: dict[tuple[Path, str], Loaded] = {}  # by file and weight form
        self._closed = False
        # Jobs "completed", "cancelled" (stopped mid-way), "dropped" (cancelled while queued), "failed".
        self.counts: Counter = Counter()
        self._listeners: list[Callable[[Final], None]] = []
        self._reaper = threading.Thread(target=self._reap, name="pebbling-keep-alive", daemon=True)
        self._reaper.start()

    def on_final(self, listener: Callable[[Final], None]) -> None:
        """`listener(final)` is called, on the model's worker thread, as each generation or embedding ends."""
        self._listeners.append(listener)

    def _finished(self, final: Final) -> None:
        for listener in self._listeners:
            try:
                listener(final)
            except Exception:  # a listener's bug must not fail the request it observes
                logger.exception("a listener of finished requests failed")

    # -- names --------------------------------------------------------------------------------------

    def find(self, name: str) -> tuple[Path, ModelLayers]:
        """The GGUF file for a model name and its Modelfile layers (see Catalogue.find)."""
        return self.catalogue.find(name)

    def resolve(self, name: str) -> Path:
        return self.find(name)[0]

    # -- generation ---------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Job:
        """Validate, load the model if needed, build the prompt and queue the generation.

        Raises before anything is queued: InvalidModelName / ModelNotFoundError for the name,
        OptionsError (and StrategyError) for options, ChatTemplateError for a refused conversation.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        path, layers = self.find(request.model)
        only_loads = request.loads_only  # asked of what the client sent, before the Modelfile adds to it
        request = with_layers(request, layers)  # the Modelfile's params, system message and opening turns
        pebbling = PebblingOptions.from_options(request.options)
        keep_alive = parse_keep_alive(request.keep_alive, self.default_keep_alive)
        if only_loads and keep_alive == 0:  # Ollama: unloads the model as it is loaded, loading nothing
            self._expire(path, pebbling.weights)
            return Job.answered(request, "unload")
        entry, load_ns = self._acquire(request.model, path, pebbling.effective_weights)
        try:
            model = entry.model
            options = replace(Options.from_dict(request.options, n_ctx_train=model.config.n_ctx_train,
                                                max_ctx=self.max_context, head_dim=model.config.head_dim),
                              shift=request.shift)
            asked = request.options.get("num_ctx") if isinstance(request.options, dict) else None
            if isinstance(asked, (int, float)) and asked > options.num_ctx:
                logger.warning("model=%s: num_ctx=%s lowered to %d (the most this model and server allow)",
                               entry.name, asked, options.num_ctx)
            if request.embed is not None:
                return self._submit_embed(entry, request, options, pebbling, keep_alive, load_ns)
            plan = ReplyPlan.of(request, template_source(layers, model.chat_template.source))
            grammar = plan.grammar()  # tool_choice required or named: the call is constrained decoding
            constraint = (Constraint.from_lark(model.tokenizer, grammar, "tool_choice") if grammar
                          else Constraint.from_format(model.tokenizer, request.format))
            render = chat_renderer(layers, request) or model.chat_prompt
            tokens, prompt, truncated = ([], "", "") if only_loads else \
                self._prompt_tokens(model, request, options, plan, render, layers.template)
            if truncated:
                logger.warning("model=%s: the prompt did not fit num_ctx=%d: %s", entry.name,
                               options.num_ctx, truncated)
            # A budget that cannot fit is refused here, before anything is queued.
            entry.pebbled.plan(options, pebbling, len(tokens), self._others(entry))
            if only_loads:  # Ollama: a request with nothing to generate from only loads the model
                self._release(entry, keep_alive)
                return Job.answered(request, "load", load_ns)
            job = Job(request, tokens, options, pebbling, keep_alive, load_ns)
            job.constraint, job.parser, job.truncated = constraint, plan.parser(prompt), truncated
        except BaseException:
            self._release(entry, keep_alive)
            raise
        entry.jobs.put(job)  # entry.active counts it, so the worker cannot have been told to stop
        return job

    def _submit_embed(self, entry: Loaded, request: GenerationRequest, options: Options,
                      pebbling: PebblingOptions, keep_alive: float, load_ns: int) -> Job:
        """Queues an embed request (the caller releases the entry if this raises)."""
        check_pooling(entry.model.config.pooling)  # a model that pools nothing is refused before anything runs
        inputs = embed_inputs(entry.model, request.embed, request.truncate, options.num_ctx)
        job = Job(request, [], options, pebbling, keep_alive, load_ns)
        job.inputs = inputs
        if not inputs:
            self._release(entry, keep_alive)
            job._put(Final(request.model, "stop", [], total_duration=since(request.started_ns),
                           load_duration=load_ns, embeddings=[]))
            job._put(Job._END)
            return job
        entry.pebbled.plan(options, pebbling, max(map(len, inputs)), self._others(entry))
        entry.jobs.put(job)
        return job

    def _prompt_tokens(self, model: Model, request: GenerationRequest, options: Options, plan: ReplyPlan,
                       render: Callable[..., str], go_template: str | None = None) -> tuple[list[int], str, str]:
        """(token ids, the text they encode past any context, what was cut to fit num_ctx or "");
        `go_template`: the model's TEMPLATE layer, if it has one."""
        context = list(request.context or [])
        check_context(model, context)
        dropped = 0
        if request.messages is not None:
            text, dropped = fit_messages(
                model, request.messages,
                lambda messages: plan.finish_prompt(render(messages, **plan.template_args)), options)
        else:
            prompt = request.prompt or ""
            if request.think is not None and plan.thinker and (request.raw or request.template is not None
                                                               or request.suffix):
                raise OptionsError("think works through the model's chat template: leave out raw, template and "
                                   "suffix")
            turn = [{"role": "system", "content": request.system}] * bool(request.system) + \
                [{"role": "user", "content": prompt}]
            if request.suffix:  # fill in the middle: Ollama's insert
                text = insert_prompt(model, request, request.template if request.template is not None
                                     else go_template)
            elif request.raw:
                text = prompt
            elif request.template is not None:  # a request's own Go template, run as Ollama runs it
                text = parsed(request.template).render_chat(turn)
            else:
                text = plan.finish_prompt(render(turn, **plan.template_args))
        tokens, cut = fit_tokens(model, text, context, options)
        return tokens, text, cut_note(dropped, cut, len(tokens), options.num_keep)

    def _run_embed(self, entry: Loaded, job: Job) -> Final | None:
        """One vector per input, each through the model's store under the request's plan."""
        request, vectors, tokens, prompt_ns, report = job.request, [], 0, 0, None
        for ids in job.inputs:
            if job.cancelled:
                return None
            gen = entry.pebbled.generation(job.options, job.pebbling, len(ids), others=self._others(entry))
            vector = pool(gen.hidden_states(ids), entry.model.config.pooling)
            vector = normalize(vector, request.dimensions) if request.normalize else vector[:request.dimensions]
            vectors.append([float(v) for v in vector])
            tokens, prompt_ns, report = tokens + gen.stats.prompt_tokens, prompt_ns + gen.stats.prompt_ns, gen.report()
        report = json_ready(report)
        entry.size_vram = report["measured_peak_bytes"] if entry.pebbled.backend.measures_memory else 0
        if job.truncated:
            report["prompt_truncated"] = job.truncated
        return Final(request.model, "stop", [], total_duration=since(request.started_ns),
                     load_duration=job.load_ns, prompt_eval_count=tokens, prompt_eval_duration=prompt_ns,
                     report=report, embeddings=vectors)

    def _job_done(self, entry: Loaded, job: Job, outcome: Final | BaseException | None) -> None:
        """A job has ended (outcome: its Final, its error, or None when it was cancelled before it ran)."""
        with self._lock:
            self.counts["failed" if isinstance(outcome, Exception) else "dropped" if outcome is None
                        else "cancelled" if job.cancelled else "completed"] += 1
        # Released before the client hears the end, so keep_alive 0 has unloaded by then.
        self._release(entry, job.keep_alive)
        if isinstance(outcome, Final):
            self._finished(outcome)
        if outcome is not None:
            job._put(outcome)
        job._put(Job._END)

    # -- loading and keep_alive ---------------------------------------------------------------------

    def _acquire(self, name: str, path: Path, weights: str) -> tuple[Loaded, int]:
        """The loaded entry for `name` (the file at `path`) with its weights in form `weights`, counted as
        active; (entry, ns spent loading it here). Another form of the same file is another entry, as a
        load-time option is in Ollama: loaded beside the first, each unloading on its own keep_alive."""
        key = (path.resolve(), weights)
        with self._lock:
            waiting = sum(e.active for e in self._loaded.values())
            if waiting >= self.max_queue:
                raise ServerBusyError(f"the server is busy: {waiting} requests are queued or running, its limit "
                                      f"(PEBBLING_MAX_QUEUE) is {self.max_queue}; try again later")
            entry = self._loaded.setdefault(key, Loaded(key[0], name, weights))
            entry.active += 1
        with entry.load_lock:
            if entry.model is not None:
                return entry, 0
            start = time.perf_counter_ns()
            try:
                with model_errors(name, path):
                    entry.model = load_model(path, weights=weights, progress=False)
                    entry.digest = self.catalogue.model_id(with_tag(name), path)
                    entry.details = self.catalogue.info(path)["details"]
                entry.pebbled = PebbledModel(entry.model, backend=self.backend, keep_host_weights=False,
                                             parked_kv_bytes=self.parked_kv_bytes)
            except BaseException:
                with self._lock:  # a request still waiting on load_lock tries again, and says why
                    entry.active -= 1
                    if entry.active == 0 and self._loaded.get(key) is entry:
                        del self._loaded[key]
                raise
            batcher = Batcher(entry, self.num_parallel, finish=lambda job, outcome: self._job_done(entry, job, outcome),
                              others=lambda: self._others(entry), run_embed=lambda job: self._run_embed(entry, job))
            entry.worker = threading.Thread(target=batcher.run, daemon=True, name=f"pebbling-model-{name}")
            entry.worker.start()
            batcher.ready.wait()  # the overhead measured on the model's thread before a request plans
            load_ns = time.perf_counter_ns() - start
            logger.info("loaded model=%s weights=%s backend=%s layers=%d in %.0f ms", name, weights,
                        entry.pebbled.backend.name, entry.model.config.n_layer, load_ns / 1e6)
            if fallback := kv_fallback(entry.model.config.head_dim):  # requests naming no KV type hold f16
                logger.warning("model=%s: %s", name, fallback)
            return entry, load_ns

    def _expire(self, path: Path, weights: str | None) -> None:
        """Unloads each loaded copy of `path` (of form `weights`, else any) once idle, loading none, as Ollama."""
        with self._lock:
            for entry in [e for e in self._loaded.values() if e.key == path.resolve() and weights in (None, e.weights)]:
                entry.expires_at = time.monotonic()
                if entry.active == 0:
                    self._unload(entry)
            self._lock.notify_all()

    def _release(self, entry: Loaded, keep_alive: float | None) -> None:
        """One request is done with `entry`; keep_alive (seconds) sets when it unloads once idle."""
        with self._lock:
            entry.active -= 1
            if keep_alive is not None:
                entry.expires_at = time.monotonic() + keep_alive
            if entry.active == 0 and entry.expires_at <= time.monotonic():
                self._unload(entry)
            self._lock.notify_all()

    def _unload(self, entry: Loaded) -> None:
        # Called with self._lock held and entry idle. The worker thread ends on the sentinel.
        if self._loaded.get((entry.key, entry.weights)) is entry:
            del self._loaded[(entry.key, entry.weights)]
        if entry.model is not None:
            logger.info("unloaded model=%s weights=%s", entry.name, entry.weights)
        entry.model = None
        if entry.pebbled is not None:
            entry.pebbled.close()
            entry.pebbled = None
        entry.jobs.put(None)

    # The reaper wakes at least this often, so no deadline is ever handed to a timer as one huge wait.
    _REAP_WAKE = 60.0

    def _reap(self) -> None:
        """Unloads idle models whose keep_alive has run out; one failure is logged and the next pass goes on,
        so that no request can stop every model from unloading."""
        with self._lock:
            while not self._closed:
                wait = self._REAP_WAKE
                try:
                    now = time.monotonic()
                    for entry in list(self._loaded.values()):
                        if entry.active == 0 and entry.model is not None and entry.expires_at <= now:
                            self._unload(entry)
                    deadlines = [e.expires_at for e in self._loaded.values() if e.active == 0]
                    wait = min(min(deadlines, default=FOREVER) - now, self._REAP_WAKE)
                except Exception:
                    logger.exception("the keep_alive reaper failed on one pass; it goes on")
                    wait = 1.0  # soon again: what failed may have been passing
                self._lock.wait(timeout=max(wait, 0.01))

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
        return self.catalogue.list_models()

    def show(self, name: str) -> tuple[ModelListing, dict[str, Any]]:
        """(listing, extra) for /api/show and /v1/models/NAME (the listing named with its tag, as /api/tags
        lists it): model_info, modelfile, parameters, template, system, license, capabilities, and
        pebbling_notes where something keeps it from being served."""
        path, layers = self.find(name)
        with model_errors(name, path):
            listing, gguf = self.catalogue.listing(with_tag(name), path), self.catalogue.info(path)["show"]
        fields = show_fields(with_tag(name), layers, gguf, path)
        notes = gguf.get("pebbling_notes", []) + fields.pop("pebbling_notes", [])
        return listing, {"model_info": gguf["model_info"], **fields, **({"pebbling_notes": notes} if notes else {})}

    def running(self) -> list[RunningModel]:
        """The loaded models, for /api/ps."""
        with self._lock:
            entries = [e for e in self._loaded.values() if e.model is not None]
        return [m for e in entries if (m := e.running(self.max_context)) is not None]

    def _others(self, entry: Loaded) -> int:
        """Device memory the other loaded models hold between their requests (an adaptive budget
        leaves it to them)."""
        with self._lock:
            others = [e.pebbled for e in self._loaded.values() if e is not entry and e.pebbled is not None]
        return sum(p.device_bytes_held() for p in others if p.backend.measures_memory)


def describe(models_dir: str | Path | None = None, backend: str | None = None) -> str:
    """What a server says when it starts: the store backend (choosing it logs why) and the models it serves."""
    try:
        said = f"store backend {choose_backend(backend).backend.name}"
    except PebblingError as exc:  # said again, as a 400 or 500, by every request that needs a model
        said = f"no usable store backend ({exc})"
    catalogue = Catalogue(models_dir)
    names = [m.name for m in catalogue.list_models()]
    return (f"{said}; models directory {catalogue.models_dir}; serving {len(names)} model(s): "
            f"{', '.join(names) or 'none'}")
