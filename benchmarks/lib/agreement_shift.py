"""Does pebbling shift a full context as llama.cpp does? A generation past num_ctx, on both, on the same file.

    python benchmarks/agreement.py shift [--only llama,gemma2] [--kv-type f16] [--json FILE]

For each architecture `agreement.py llamacpp` knows (the dense ones, the mixtures of experts, and gemma3 with
global layers among its sliding ones), it writes the same small random-weight GGUF with F32 weights (the
weight types are `agreement.py llamacpp`'s business; here only the shift is judged) and:

  pebbling   generates N_GEN greedy tokens after an N_PROMPT-token prompt at num_ctx N_CTX through its own
             loop (Generation.next_token / wants_forward, a store plan of every:2), which shifts the context
             itself when it is full (model/kv_shift.py): its tokens, the logits each came from, its shifts.
  llama.cpp  is fed the same tokens one at a time (llama-cpp-python) and shifts its KV cache as its server
             does (tools/server, update_slots): once n_past + 1 >= n_ctx, n_keep = num_keep + the BOS its
             vocabulary adds (at most n_ctx - 4), n_discard = (n_past - n_keep) / 2, then
             llama_memory_seq_rm(n_keep, n_keep + n_discard) and llama_memory_seq_add(n_keep + n_discard,
             n_past, -n_discard), which re-rotates the kept keys (its K shift) before the next decode.

and compares, step by step through every shift:

  schedule   pebbling's shifts (when, kept, dropped) are the ones llama.cpp's server rule makes;
  logits     each step's ||pebbling - llama.cpp|| / ||llama.cpp|| within the tolerance, before the first
             shift and after it alike. The tolerance is agreement_llamacpp's for F32 weights and this KV type
             (f16: 1e-4 + 2e-3, as llama.cpp rounds q to fp16 against an f16 cache and pebbling does not;
             f32: 1e-4), or twice the Gemmas' GELU floor where that is larger;
  greedy     each of pebbling's tokens is llama.cpp's argmax at that step, or a near-tie: llama.cpp's gap
             between its top token and pebbling's is at most 2 x tolerance x max|llama.cpp's logits|, twice
             what the tolerance lets one logit move (each of the two may move that far, the other way);
             within it llama.cpp's own rounding decides the order, and either token is right;
  control    the same tokens through pebbling with the kept keys NOT re-rotated at a shift: how far a
             shift that moves the rows but forgets RoPE lands from llama.cpp (it must land past the
             tolerance, or the comparison could not see such an error).

A case whose forward passes already part by more than the tolerance before any shift (a quantized KV type
moving a mixture of experts' routing, or q4_0's rounding on the Gemmas) is "not judged" here:
`agreement.py llamacpp --kv-type` judges the forward pass. The Gemmas run with ggml's fp16 GELU rounding
(agreement_llamacpp.gelu_as_ggml), and their floor (pebbling's float32 GELU vs that) is measured, as
agreement_llamacpp judges them. End-of-generation tokens are masked on both sides, so that every run makes
N_GEN tokens.

llama.cpp shifts a sliding-window model only where its window cache has as many cells as its full one
(llama_memory_can_shift): where num_ctx is at most the window plus n_ubatch (padded to 256 cells), or with
swa_full. Elsewhere its server turns context shift off and a generation ends at num_ctx, and so does
Ollama's, which runs that server without --swa-full. At this comparison's num_ctx both caches are 256 cells
and llama.cpp shifts (a file it refused would be compared with swa_full on, and say so); the @4096 column
says whether it could at its default n_ctx 4096 and n_ubatch 512 (for these files' 8-position windows: no).
With the real windows, probed the same way (llama-cpp-python 0.3.36, n_ubatch 512): Gemma 3's 1024 shifts at
no n_ctx from 2048 up, Gemma 2's 4096 at 4096 but not at 8192. pebbling shifts a sliding layer's ring
wherever its window after the shift lies past the kept positions (model/kv_shift.shiftable).

Exit status: 0 when every case agrees, 1 when one does not (or llama.cpp fails on a file), 2 when
llama-cpp-python is missing (and says how to install it beside pebbling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from lib import agreement_llamacpp as base
from pyplugin.kv_types import KV_TYPES
from pyplugin.model import kv_shift, load_model
from pyplugin.model.synth import write_gguf
from pyplugin.runtime import PebbledModel, PebblingOptions
from pyplugin.runtime.options import Options

N_PROMPT, N_CTX, N_GEN, NUM_KEEP = 12, 32, 48, 4   # 47 tokens forwarded past a 12-token prompt: 3 shifts
STRATEGY = "every:2"                                # half the layers streamed: the store's shift path


@dataclass
class Case:
    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)


# gemma3 with 6 layers, so that its own period (every 6th layer global) gives it a global layer, as every real
# Gemma 3 has: llama.cpp aborts shifting a file whose layers are all sliding (agreement_llamacpp's 4-layer gemma3):
# its K shift builds a graph for the full-attention cache, which then holds no layer (GGML_ASSERT(buffer)).
CASES = [Case(a, a) for a in base.ARCHS + base.MOE_ARCHS if a != "gemma3"] + [
    Case("gemma3 6 layers 1 global", "gemma3", {"n_layer": 6}),
    Case("gemma3 6 layers global every 3rd", "gemma3", {"n_layer": 6, "swa_pattern": 3, "rope_linear_factor": 8.0})]
PROBE_CTX, PROBE_UBATCH = 4096, 512                 # llama.cpp's defaults (and Ollama's num_ctx 4096)


def spec_of(case: Case) -> dict[str, Any]:
    arch = base.FILE_ARCH.get(case.arch, case.arch)
    spec = dict(base.SHAPE, arch=arch, vocab=base.VOCAB_OF[arch], weight_type="F32", seed=7)
    spec.update(base.ARCH_SPEC.get(case.arch, {}))
    spec.update(case.overrides)
    return spec


def llama_server_shift(n_past: int, n_ctx: int, num_keep: int, add_bos: bool) -> tuple[int, int] | None:
    """llama.cpp's server's context shift before its next token (update_slots), written out again here: None
    while n_past + 1 < n_ctx, else (n_keep, n_discard)."""
    if n_past + 1 < n_ctx:
        return None
    n_keep = min(n_ctx - 4, num_keep + int(add_bos))
    return n_keep, (n_past - n_keep) // 2


# ---------------------------------------------------------------------------------------------------
# pebbling


@dataclass
class Run:
    tokens: list[int]
    logits: list[np.ndarray]                           # what each token was chosen from
    shifts: list[tuple[int, int, int]]                 # (token index forwarded next, kept, dropped)
    done_reason: str | None


def run_pebbling(model, prompt: list[int], kv_type: str, forced: list[int] | None = None) -> Run:
    """pebbling's own loop past num_ctx: greedy (end-of-generation tokens masked), or `forced` tokens."""
    options = Options(temperature=0.0, repeat_penalty=1.0, top_k=0, top_p=1.0, seed=0, num_ctx=N_CTX,
                      num_predict=N_GEN, num_keep=NUM_KEEP, kv_type=kv_type)
    ends = np.array(sorted(model.tokenizer.eog_ids), dtype=np.int64)
    pebbled = PebbledModel(model)
    try:
        gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": STRATEGY}), len(prompt))
        script, sample = iter(forced or ()), gen.sample
        gen.sample = (lambda logits, history: next(script)) if forced else \
            (lambda logits, history: sample(masked(logits, ends), history))
        gen.start(prompt)
        tokens, logits, shifts = [], [], []
        while True:
            logits.append(np.array(gen.logits, dtype=np.float32))
            token = gen.next_token()
            if token is None:
                break
            tokens.append(token)
            before = len(gen.shifts)
            if not gen.wants_forward():
                break
            shifts += [(len(tokens) - 1, *s) for s in gen.shifts[before:]]
            gen.logits = gen.decode_one(token)
        return Run(tokens, logits[:len(tokens)], shifts, gen.stats.done_reason)
    finally:
        pebbled.close()


def ggml_gelu(model):
    """agreement_llamacpp's GELU rounded as ggml's for a model with a GELU (the Gemmas), else nothing."""
    return base.gelu_as_ggml() if model.config.activation == "gelu" else nullcontext()


def masked(logits: np.ndarray, ends: np.ndarray) -> np.ndarray:
    out = np.array(logits, dtype=np.float32)
    out[ends[ends < out.size]] = -np.inf
    return out


def expected_shifts(n_prompt: int, n_tokens: int, n_ctx: int, add_bos: bool) -> list[tuple[int, int, int]]:
    """The shifts llama.cpp's server makes while n_tokens - 1 tokens follow an n_prompt-token prompt."""
    shifts, n_past = [], n_prompt
    for i in range(n_tokens - 1):
        shift = llama_server_shift(n_past, n_ctx, NUM_KEEP, add_bos)
        if shift:
            shifts.append((i, *shift))
            n_past -= shift[1]
        n_past += 1
    return shifts


# ---------------------------------------------------------------------------------------------------
# llama.cpp, in a forked child per file (agreement_llamacpp.in_fork's reasons)


def in_llama(path: Path, settings: dict[str, Any], job, *args):
    return base.in_fork(_child, path, settings, job, *args)


def _child(path: Path, log: Path, settings: dict[str, Any], job, *args):
    llama_cpp = base.import_llama_cpp()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    kv = KV_TYPES[settings["kv_type"]]
    n_ctx = settings["n_ctx"]
    n_batch = settings.get("n_ubatch", n_ctx)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=2,
                          n_threads_batch=2, logits_all=True, type_k=kv.ggml_type, type_v=kv.ggml_type,
                          flash_attn=kv.quantized, swa_full=settings["swa_full"], seed=0, verbose=True)
    return job(llama_cpp, llm, n_ctx, *args)


def _can_shift_job(llama_cpp, llm, n_ctx: int) -> bool:
    return bool(llama_cpp.llama_memory_can_shift(llama_cpp.llama_get_memory(llm._ctx.ctx)))


def _forced_shift_job(llama_cpp, llm, n_ctx: int, prompt: list[int], tokens: list[int]):
    """llama.cpp's logits before each of `tokens` fed after the prompt, shifting as its server does; None
    where its memory cannot shift. Also its shifts and whether its vocabulary adds a BOS."""
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))
    if not llama_cpp.llama_memory_can_shift(mem):
        return None, [], add_bos
    llm.reset()
    llm.eval(prompt)
    logits, shifts = [np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)], []
    for i, token in enumerate(tokens[:-1]):
        n_past = llm.n_tokens
        shift = llama_server_shift(n_past, n_ctx, NUM_KEEP, add_bos)
        if shift:
            keep, discard = shift
            llama_cpp.llama_memory_seq_rm(mem, 0, keep, keep + discard)
            llama_cpp.llama_memory_seq_add(mem, 0, keep + discard, n_past, -discard)
            llm.input_ids[keep:n_past - discard] = llm.input_ids[keep + discard:n_past].copy()
            llm.n_tokens = n_past - discard      # the next token goes in at the shifted position
            shifts.append((i, keep, discard))
        llm.eval([token])
        logits.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    return logits, shifts, add_bos


# ---------------------------------------------------------------------------------------------------
# one case


def pebbling_half(case: Case, workdir: Path, kv_type: str):
    """The file, its prompt and pebbling's run past num_ctx (what the test runs where llama.cpp is not)."""
    path = workdir / (case.name.replace(" ", "_").replace("/", "-") + ".shift.gguf")
    write_gguf(path, **spec_of(case))
    model = load_model(path, weights="f16", progress=False)
    tok = model.tokenizer
    n_normal = sum(1 for t in tok.types if t == 1)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    prompt = bos + [int(t) for t in rng.integers(0, n_normal, N_PROMPT - len(bos))]
    with ggml_gelu(model):
        run = run_pebbling(model, prompt, kv_type)
    return path, model, prompt, run


def compare_case(case: Case, workdir: Path, kv_type: str) -> dict[str, Any]:
    path, model, prompt, run = pebbling_half(case, workdir, kv_type)
    tol = base.TOLERANCE["F32"] + base.KV_TOLERANCE[kv_type]
    row: dict[str, Any] = {"case": case.name, "tolerance": tol, "tokens": len(run.tokens),
                           "shifts": [list(s) for s in run.shifts]}
    settings = {"n_ctx": N_CTX, "kv_type": kv_type, "swa_full": False}
    try:
        # Would llama.cpp (and so Ollama's runner) shift this file at its default context and micro-batch?
        row["llama_shifts_at_4096"] = in_llama(path, dict(settings, n_ctx=PROBE_CTX, n_ubatch=PROBE_UBATCH),
                                               _can_shift_job)
        ref, l_shifts, add_bos = in_llama(path, settings, _forced_shift_job, prompt, run.tokens)
        if ref is None:  # a sliding-window cache of the window's size: llama.cpp cannot shift it
            row["llama_default"] = "refuses to shift (llama_memory_can_shift false without swa_full)"
            ref, l_shifts, add_bos = in_llama(path, dict(settings, swa_full=True), _forced_shift_job, prompt,
                                              run.tokens)
            row["swa_full"] = True
    except base.LlamaFailed as exc:
        row.update(status="llama.cpp failed", detail=str(exc))
        return row
    if ref is None:
        row.update(status="llama.cpp refuses to shift", detail="even with swa_full")
        return row
    if model.config.activation == "gelu":  # pebbling's own float32 GELU on the same tokens: ggml's rounding's floor
        plain = run_pebbling(model, prompt, kv_type, forced=run.tokens)
        row["gelu_floor"] = max(base.rel_err(a, b) for a, b in zip(plain.logits, run.logits))
        row["tolerance"] = tol = max(tol, 2 * row["gelu_floor"])  # agreement_llamacpp's: both sides round
    ends = np.array(sorted(model.tokenizer.eog_ids), dtype=np.int64)
    first = run.shifts[0][0] if run.shifts else len(run.tokens)  # logits past it come after a shift
    rels, ties, misses = [], [], []
    for i, (p, l) in enumerate(zip(run.logits, ref)):
        rels.append(base.rel_err(p, l))
        top, t = int(np.argmax(masked(l, ends))), run.tokens[i]
        if top != t:  # a near-tie: llama.cpp's gap within twice what the tolerance lets a logit move
            gap, band = float(l[top] - l[t]), 2 * tol * float(np.abs(l).max())
            (ties if gap <= band else misses).append({"step": i, "llama": top, "pebbling": t, "gap": gap,
                                                      "band": band})
    with mock.patch.object(kv_shift, "rotate", lambda cfg, rows, delta: rows), ggml_gelu(model):
        control = run_pebbling(model, prompt, kv_type, forced=run.tokens)
    schedule_ok = l_shifts == run.shifts == expected_shifts(len(prompt), len(run.tokens), N_CTX, add_bos)
    row.update(llama_shifts=[list(s) for s in l_shifts], schedule_equal=schedule_ok,
               rel_err_before=max(rels[:first + 1]), rel_err_after=max(rels[first + 1:], default=0.0),
               near_ties=ties, mismatches=misses,
               control_after=max((base.rel_err(p, l) for p, l in zip(control.logits[first + 1:], ref[first + 1:])),
                                 default=0.0))
    if not (schedule_ok and len(run.tokens) == N_GEN and run.shifts):
        row["status"] = "DISAGREE (schedule)"
    elif row["rel_err_before"] > tol:
        row["status"] = ("not judged: the forward passes part before any shift (agreement.py llamacpp "
                         f"--kv-type {kv_type} judges them)")
    elif row["rel_err_after"] > tol or misses:
        row["status"] = "DISAGREE"
    elif row["control_after"] <= tol:
        row["status"] = "inconclusive: without re-rotation it is within the tolerance too"
    else:
        row["status"] = "ok" + (" (near-tie)" if ties else "")
    if row.get("swa_full"):
        row["status"] += " (llama.cpp with swa_full; its default refuses)"
    return row


# ---------------------------------------------------------------------------------------------------
# report


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'case':32} {'tokens':>6} {'shifts (at, kept, dropped)':26} {'sched':>5} {'before':>9} "
            f"{'after':>9} {'tol':>7} {'ties':>4} {'unrotated':>9} {'@4096':>5}  status")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "rel_err_before" not in r:
            print(f"{r['case']:32} {r['status']}: {r['detail']}")
            continue
        shifts = " ".join(f"{a},{k},{d}" for a, k, d in r["shifts"])
        print(f"{r['case']:32} {r['tokens']:6} {shifts:26} {'same' if r['schedule_equal'] else 'NO':>5} "
              f"{r['rel_err_before']:9.2e} {r['rel_err_after']:9.2e} {r['tolerance']:7.1e} {len(r['near_ties']):4} "
              f"{r['control_after']:9.2e} {'yes' if r['llama_shifts_at_4096'] else 'NO':>5}  {r['status']}")
    print(f"\nshifts: (token index forwarded next, positions kept, positions dropped), pebbling's; sched: the same\n"
          f"as llama.cpp's server made; before / after: worst ||pebbling - llama.cpp|| / ||llama.cpp|| of the\n"
          f"logits up to the first shift / after it; ties: steps where llama.cpp's argmax is not pebbling's token\n"
          f"but within 2 x tol x max|logit| of it (0: every step's greedy token the same); unrotated: the worst\n"
          f"after the first shift with pebbling's kept keys not re-rotated (the control); @4096: whether llama.cpp\n"
          f"can shift this file at n_ctx {PROBE_CTX}, n_ubatch {PROBE_UBATCH} (llama_memory_can_shift; NO: its server, "
          f"and Ollama's\nrunner, turn context shift off).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(c.name for c in CASES),
                    help="cases, comma-separated (the architecture names, or the gemma3 variant's name)")
    ap.add_argument("--kv-type", default="f16", choices=list(KV_TYPES), help="KV cache type of both sides")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    llama_cpp = base.import_llama_cpp()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    wanted = args.only.split(",")
    print(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}; {N_PROMPT}-token prompt, {N_GEN} greedy "
          f"tokens at num_ctx {N_CTX}, num_keep {NUM_KEEP}, KV cache {args.kv_type}, F32 weights\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pebbling-shift-vs-llamacpp-") as tmp:
        for case in (c for c in CASES if c.name in wanted):
            rows.append(compare_case(case, Path(tmp), args.kv_type))
            print(f"  {case.name}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r["case"] for r in rows if not r["status"].startswith("ok")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} cases agree" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
