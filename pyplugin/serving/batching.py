"""A loaded model's worker: continuous batching of its requests.

Requests decode together when they share a plan: the same effective strategy, memory limit, num_ctx and
num_batch (the weight form is already the loaded model's). Such a group runs under one plan made for
`num_parallel` sequences, each with KV entries of its own, the estimate counting all of them, so none
can take its requests past their memory limit; where that many do not fit the limit, as many as fit,
and where two do not, one at a time under each request's own plan, as before batching.

Groups take turns, oldest first: when the batch is empty, the group of the request that has waited
longest starts, with every request of that group waiting then. A request of the running group that
arrives later joins the batch (at the next step, after its prefill) while no request of another group
waits; once one does, the batch takes no newcomers, drains, and the oldest waiting request's group goes
next. So no request starves: it waits at most for the turns of groups whose requests came before it.
Each sequence keeps its own sampler, options, stop strings, constraint, cancellation and stats; one that
finishes or is cancelled leaves at once, and its sequence takes the next request. A finished sequence's
KV entries keep its conversation until the sequence is claimed again: a request takes the free sequence
whose cache holds the longest start of its prompt, else the least recently used.

What a response reports as its own: its prefill, the restores of each decode step divided equally among
the sequences in that step, and as eval_duration the wall time of the steps it took part in (each
sequence waited for the whole step). Memory figures are the batch's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import OptionsError, PebblingError
from ..runtime.batch import decode_batch, prefill_batch, prefills_together
from ..runtime.generation import Generation
from ..runtime.stop_text import StopText
from ..runtime.store_layers import StoreLayers
from .jobs import Final, Job, Piece, json_ready, since

logger = logging.getLogger("pebbling")


def batch_key(job: Job) -> tuple:
    """What requests must share to decode in one batch: what their plan is made from."""
    if job.inputs is not None:  # embeddings run alone
        return ("embed", id(job))
    return (job.pebbling.effective_strategy, job.pebbling.memory_limit, job.options.num_ctx, job.options.num_batch)


@dataclass
class _Running:
    job: Job
    gen: Generation
    text: StopText
    sent: list = field(default_factory=list)  # the logprobs sent with its pieces so far

    def put(self, text: str) -> None:
        """Streams a piece of text, with its tokens' logprobs where the request asked for them."""
        if text and not self.job.cancelled:
            self.job._put(Piece.of(text, self.gen, self.sent) if self.gen.logprobs is not None else text)


class Batcher:
    """Serves one loaded model's queue (`entry.jobs`; None ends it) until told to stop.

    `finish(job, outcome)` receives each job's end: its Final, an exception, or None (cancelled before it
    started); `others()` is the device memory other loaded models hold; `run_embed(job)` serves an
    embedding request alone."""

    def __init__(self, entry: Any, num_parallel: int, *, finish: Callable[[Job, Any], None],
                 others: Callable[[], int], run_embed: Callable[[Job], Final | None]):
        self.entry, self.num_parallel = entry, num_parallel
        self.finish, self.others, self.run_embed = finish, others, run_embed
        self.source: StoreLayers | None = None
        self.key: tuple | None = None
        self.round: set[int] = set()  # the requests of the running group that were waiting when it started
        self.ready = threading.Event()  # set once the model's overhead is measured on this thread

    def run(self) -> None:
        try:  # on the thread that computes, so that its cuBLAS handle is in what plans count
            self.entry.pebbled.measure_overhead()
        except Exception:  # noqa: BLE001 - a request's plan measures again on its thread and says why
            logger.exception("model=%s: measuring the backend's overhead failed", self.entry.name)
        finally:
            self.ready.set()
        waiting: deque[Job] = deque()
        running: list[_Running] = []
        while True:
            block = not running and not waiting
            while True:
                try:
                    job = self.entry.jobs.get() if block else self.entry.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:  # the model unloads: it is idle
                    self.source = None
                    return
                waiting.append(job)
                block = False
            if not running:
                self._drained()
                if not waiting:
                    continue
                head = waiting[0]
                if head.cancelled or head.inputs is not None:
                    waiting.popleft()
                    self.finish(head, None if head.cancelled else _attempt(self.run_embed, head))
                    continue
                try:
                    self.source, self.key = self._source_for(head), batch_key(head)
                except Exception as exc:
                    waiting.popleft()
                    self.finish(head, _failure(exc, head))
                    continue
                self.round = {id(job) for job in waiting if batch_key(job) == self.key}
            joining = self._joining(waiting, self.source.n_seqs - len(running))
            if joining:
                running.extend(self._start(joining, running))
            running = self._step(running)

    def _joining(self, waiting: deque[Job], room: int) -> list[Job]:
        """The waiting requests that join the running batch now (taken from `waiting`), in arrival order:
        those of its group that were waiting when it started, and newcomers of its group while no request
        of another group waits."""
        others_wait = any(batch_key(job) != self.key for job in waiting)
        joining = []
        for job in list(waiting):
            if len(joining) == room:
                break
            if batch_key(job) == self.key and (id(job) in self.round or not others_wait):
                waiting.remove(job)
                joining.append(job)
        return joining

    def _drained(self) -> None:
        """No sequence is running: the plan's views and workspace go before another plan is made."""
        if self.source is not None:
            self.source.release()
        self.source = self.key = None

    def _source_for(self, head: Job) -> StoreLayers:
        """The plan of the group `head` starts: `num_parallel` sequences, else as many as fit its memory
        limit, else `head` alone under its own plan."""
        pebbled, others = self.entry.pebbled, self.others()
        for n in range(self.num_parallel, 1, -1):
            try:
                plan = pebbled.plan(head.options, head.pebbling, None, others, n_seqs=n)
                break
            except OptionsError:  # the limit does not hold n sequences' KV: fewer
                continue
        else:
            plan = pebbled.plan(head.options, head.pebbling, len(head.tokens), others)
        return StoreLayers(pebbled, plan, head.options, head.pebbling)

    def _start(self, jobs: list[Job], running: list[_Running]) -> list[_Running]:
        """Prefills `jobs` on free sequences of the plan, together in one pass where batch.prefills_together
        says each is then computed as alone, else one by one; those that started."""
        pebbled, ready = self.entry.pebbled, []
        for job in jobs:
            if job.cancelled:
                self.finish(job, None)
                continue
            busy = {r.gen.layers.seq for r in running} | {r.gen.layers.seq for r, _ in ready}
            free = [s for s in range(self.source.n_seqs) if s not in busy]
            try:
                seq, cached = pebbled.best_sequence(job.tokens, job.options.num_ctx, free, job.pebbling.cache_prompt,
                                                      job.options.kv_type)
                pebbled.claim(seq)
                gen = Generation(pebbled.model, job.options, layers=self.source.sequence(seq),
                                 should_stop=lambda job=job: job.cancelled, constraint=job.constraint,
                                 logprobs=job.request.logprobs)
                gen.stats.cache_restored = min(pebbled.restored.get(seq, 0), cached)  # from the host tier
                chunk = gen.begin(job.tokens, cached)
            except Exception as exc:
                self.finish(job, _failure(exc, job))
                continue
            ready.append((_Running(job, gen, StopText(pebbled.model.tokenizer, job.options.stop)), chunk))
        together = [(r, chunk) for r, chunk in ready if len(chunk) <= r.job.options.num_batch]
        if not prefills_together(self.source, [r.gen for r, _ in together]):
            together = []
        started = []
        if together:
            runs, chunks = [r for r, _ in together], [chunk for _, chunk in together]
            spent = self._pass(runs, lambda: prefill_batch(self.source, [r.gen for r in runs], chunks))
            if spent is not None:
                for r, chunk in together:  # each waited for the whole pass
                    r.gen.stats.prompt_tokens += len(chunk)
                    r.gen.stats.prompt_ns += spent
                started += runs
        in_pass = {id(r) for r, _ in together}
        for r, chunk in ready:
            if id(r) in in_pass:
                continue
            try:
                r.gen.logits = r.gen.prefill(chunk)
            except Exception as exc:
                self.finish(r.job, _failure(exc, r.job))
                continue
            started.append(r)
        return started

    def _pass(self, runs: list[_Running], compute: Callable[[], list]) -> int | None:
        """Runs `compute()`, a forward pass of `runs`' sequences, and gives each its row of the logits it
        returns; the pass's wall time in ns, or None when it failed (each of them then ends with the error)."""
        start = time.perf_counter_ns()
        try:
            logits = compute()
        except Exception as exc:
            for r in runs:
                self.finish(r.job, _failure(exc, r.job))
            return None
        spent = time.perf_counter_ns() - start
        for r, row in zip(runs, logits):
            r.gen.logits = row
        return spent

    def _step(self, running: list[_Running]) -> list[_Running]:
        """Samples a token for each running sequence, streams its text, and runs those that go on
        through the layers together; those still running."""
        forward: list[tuple[_Running, int]] = []
        for r in running:
            try:
                token = r.gen.next_token()
                if token is None:
                    self._end(r)
                    continue
                r.put(r.text.push(token))
                if r.text.stopped:
                    r.gen.stats.done_reason = "stop"
                    self._end(r)
                elif not r.gen.wants_forward():
                    self._end(r)
                else:
                    forward.append((r, token))
            except Exception as exc:
                self.finish(r.job, _failure(exc, r.job))
        if not forward:
            return []
        runs = [r for r, _ in forward]
        spent = self._pass(runs, lambda: decode_batch(self.source, [r.gen for r in runs], [t for _, t in forward]))
        if spent is None:
            return []
        for r in runs:
            r.gen.stats.generate_ns += spent
        return runs

    def _end(self, r: _Running) -> None:
        """A sequence is over: the rest of its text, what its KV entries hold, and its Final."""
        job, gen = r.job, r.gen
        tail = r.text.finish()
        if r.text.stopped:
            gen.stats.done_reason = "stop"
        r.put(tail)
        self.entry.pebbled.keep_cache(gen)
        stats, report = gen.stats, json_ready(gen.report())
        self.entry.size_vram = report["measured_peak_bytes"] if self.entry.pebbled.backend.measures_memory else 0
        if job.truncated:
            report["prompt_truncated"] = job.truncated
        self.finish(job, Final(
            job.request.model, "cancelled" if job.cancelled else stats.done_reason or "stop",
            job.tokens + gen.generated, total_duration=since(job.request.started_ns), load_duration=job.load_ns,
            prompt_eval_count=stats.prompt_tokens, prompt_eval_duration=stats.prompt_ns,
            eval_count=stats.generated_tokens, eval_duration=stats.generate_ns, report=report,
            logprobs=r.sent if gen.logprobs is not None else None))


def _attempt(run: Callable[[Job], Any], job: Job) -> Any:
    try:
        return run(job)
    except Exception as exc:
        return _failure(exc, job)


def _failure(exc: Exception, job: Job) -> Exception:
    if not isinstance(exc, PebblingError):  # a bug, not a bad request: keep the trace
        logger.exception("generation for %r failed", job.request.model, exc_info=exc)
    return exc
