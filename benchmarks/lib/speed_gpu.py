"""pebbling on a GPU at Llama-3-8B's shape: every strategy at batch 1 and 8, beside its peers, one JSON.

    python benchmarks/speed.py gpu [--backend cuda|host|stub] [--shape llama3-8b|tiny] [--layers N]
        [--types Q4_K_M,F16] [--rows none,50%,25%,minimal] [--batches 1,8] [--prompt 512] [--tokens 128]
        [--num-ctx 4096] [--peers transformers,llama.cpp|none] [--dir D] [--json FILE] [--text FILE]

Random-weight files of the shape (gpu_model.py: 32 layers of 4096, 32 heads / 8 KV, FFN 14336,
vocabulary 128256) in a Q4_K_M-like mix and in F16, each loaded once and run per row:
  none      every layer resident (when it fits the device)
  50%, 25%  adaptive at budget(F) = F x the layers' weight bytes + every other byte `none` needs
            (agreement_transformers.fraction_budget, computed for the row's batch size)
  minimal   two working slots, everything streams
at batch 1 and batch 8 (8 prompts prefilled, then decoded in one native call per step). Per row: prefill
and decode tokens/s; device memory at its peak (the report's, and NVML sampled every 2 ms through the row)
beside the plan's estimate; bytes restored per step and the host->device rate they were moved at, against
the bus's rate measured in this run through the store; weight bytes read per step over the time per step,
against a device-to-device copy measured in this run (the roofline fraction); greedy tokens equal to none's;
where a step's time goes: its wall time, the host's time inside the library's step call, and (on a GPU)
the device's time over the call's work, from CUDA events on its stream (StepTimes); the estimate in its
parts beside the store's device-tier peak and CuPy's pool's sampled peak (memory_parts: which part a peak
over the estimate came from).
Peers: transformers + accelerate (random F16 weights of the same shape, fully on the GPU and with
max_memory[0] at each budget), llama.cpp on the Q4_K_M file where llama_cpp imports (else recorded absent).
Every figure is measured in this run, except those listed under "estimates" in the JSON and marked (est.)
in the text. The JSON is rewritten after each row, so a run cut short keeps what it measured.
On a CPU machine: --backend host --shape tiny --layers 2 --tokens 4 checks the script in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lib import ram_dir
from lib.agreement_transformers import fraction_budget
from lib.gpu_acceptance import acceptance, acceptance_lines
from lib.gpu_model import SHAPES, TYPES, spec_for, write_model
from lib.gpu_peers import PeakSampler, llama_cpp_rows, transformers_rows
from lib.memory_store import measure as measure_bus
from pyplugin.model import load_model
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.batch import decode_batch
from pyplugin.runtime.generation import Generation
from pyplugin.runtime.measure import median_seconds
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions, full_residency_peak
from pyplugin.runtime.store_layers import StoreLayers
from pyplugin.store import probe, select_backend
from pyplugin.store.kernels import Decoder

ESTIMATES = {
    "estimated_peak_bytes": "the plan's estimate of the row's peak device memory, shown beside the measured peaks",
    "bus.nominal_link_GBps": "the PCIe link's nominal rate (generation x width, from NVML), not a measurement",
    "llama.cpp n_gpu_layers at a budget": "pebbling's resident layers at that budget, taken as what fits it",
    "memory, but for its two *_peak_bytes": "the parts of the plan's estimate (store limit, slots, fixed, workspace, "
                                            "overhead, margin, experts, decoder); the two peaks beside them are "
                                            "measured",
}
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def hbm_bandwidth(backend, nbytes: int = 1 << 30, repeats: int = 10) -> dict:
    """A device-to-device copy (bytes read + bytes written over its median time): the memory roof."""
    xp = backend.xp
    src = xp.asarray(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8))
    dst = xp.empty_like(src)
    seconds = median_seconds(lambda: xp.copyto(dst, src), backend.synchronize, repeats)
    where = "device-to-device copy" if backend.measures_memory else "host memory copy (no GPU: not HBM)"
    del src, dst
    return {"GBps": round(2 * nbytes / seconds / 1e9, 2), "bytes": nbytes, "repeats": repeats, "how": where}


def nominal_bus() -> dict:
    try:
        import pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        gen, width = n.nvmlDeviceGetMaxPcieLinkGeneration(h), n.nvmlDeviceGetMaxPcieLinkWidth(h)
        n.nvmlShutdown()
        return {"pcie_gen": gen, "pcie_width": width, "nominal_link_GBps": round(PCIE_LANE_GBPS[gen] * width, 1),
                "estimated": True}
    except Exception as exc:  # noqa: BLE001 - no NVML (a CPU machine): recorded, not guessed
        return {"nominal_link_GBps": None, "why": f"{type(exc).__name__}: {exc}"}


class StepTimes:
    """Each decode step's library call (Decoder.step, one a step) timed while in use: the host's time inside
    the call, and on a GPU the device's from just before the call's work to just after it (CUDA events on
    the step's stream). Beside the step's wall time they say where a token goes: the device's work, the
    launches and waits inside the call, or the Python around it (embedding, the logits' copy, sampling)."""

    def __init__(self, xp, profile: bool = False):
        """`profile`: the CUDA profiler on while in use (cudaProfilerStart/Stop), for a profiler started with
        profiling off (ncu --profile-from-start off: the decode steps' kernels alone)."""
        cuda = getattr(xp, "cuda", None)
        self.cuda = cuda if cuda is not None and hasattr(cuda, "Event") else None
        self.profile = profile and self.cuda is not None
        self.inside, self.calls, self._events = 0.0, 0, []

    def __enter__(self) -> "StepTimes":
        self._step, timer = Decoder.step, self
        if self.profile:
            self.cuda.profiler.start()

        def timed(decoder, *args, **kwargs):
            stream = decoder._stream() if timer.cuda else None
            begin = timer._record(stream)
            start = time.perf_counter()
            try:
                return timer._step(decoder, *args, **kwargs)
            finally:
                timer.inside += time.perf_counter() - start
                timer.calls += 1
                if begin is not None:
                    timer._events.append((begin, timer._record(stream)))
        Decoder.step = timed
        return self

    def __exit__(self, *exc) -> None:
        Decoder.step = self._step
        if self.profile:
            self.cuda.profiler.stop()

    def _record(self, stream):
        if self.cuda is None:
            return None
        event = self.cuda.Event()
        event.record(stream)
        return event

    def device_seconds(self) -> float | None:
        """The device's time over every call (None without events); waits for the last."""
        if not self._events:
            return None
        self._events[-1][1].synchronize()
        return sum(self.cuda.get_elapsed_time(a, b) for a, b in self._events) / 1e3


def run_row(pebbled: PebbledModel, options: Options, prompts: list[list[int]], case: dict, n_decode: int,
            profile: bool = False) -> dict:
    """One row: the prompts prefilled, then n_decode greedy steps for all of them together (`profile`: with
    the CUDA profiler on for those steps alone: StepTimes). case["pebbling"]: more pebbling options, if any."""
    pebbling = PebblingOptions.from_options({"pebbling_strategy": case["strategy"],
                                             "pebbling_memory_limit": case["budget"], **case.get("pebbling", {})})
    backend = pebbled.backend
    backend.free_pool()
    # The row's plan is put in place (the last row's resident layers given back, this one's slots made)
    # before sampling starts: sampled from before, the first streamed row after `none` was charged the
    # layers `none` had left resident (2.26 GB against a report of 1.78, H200 2026-11-26).
    if len(prompts) == 1:
        gens, source = [pebbled.generation(options, pebbling, len(prompts[0]))], None
    else:
        source = StoreLayers(pebbled, pebbled.plan(options, pebbling, len(prompts[0]), n_seqs=len(prompts)),
                             options, pebbling)
        gens = [Generation(pebbled.model, options, layers=source.sequence(s)) for s in range(len(prompts))]
    pool = PeakSampler(lambda: PoolUse(backend.pool_bytes()), backend.measures_memory, "CuPy's pool")
    with PeakSampler(backend.used_memory, backend.measures_memory, f"the {backend.name} backend") as sampler, pool:
        start = time.perf_counter()
        for gen, prompt in zip(gens, prompts):
            gen.start(prompt)
        prefill_s = time.perf_counter() - start
        tokens = [[] for _ in prompts]
        with StepTimes(backend.xp, profile) as timer:
            start = time.perf_counter()
            for _ in range(n_decode):
                step = [gen.next_token() for gen in gens]
                for out, token in zip(tokens, step):
                    out.append(token)
                if len(gens) == 1:
                    gens[0].logits = gens[0].decode_one(step[0])
                else:
                    for gen, logits in zip(gens, decode_batch(source, gens, step)):
                        gen.logits = logits
            decode_s = time.perf_counter() - start
    report = gens[0].report() if len(gens) == 1 else source.report(gens[0].stats, 0)
    return {"tokens": tokens, "report": report, "prefill_s": prefill_s, "decode_s": decode_s,
            "nvml_peak_bytes": sampler.peak, "nvml_peak_how": sampler.how, "step_calls": timer.calls,
            "inside_step_s": timer.inside, "device_step_s": timer.device_seconds(),
            "memory": memory_parts(source if source is not None else getattr(gens[0].layers, "shared", None),
                                   pool.peak)}


class PoolUse(NamedTuple):
    """What CuPy's pool holds, as PeakSampler reads it."""
    bytes: int
    how: str = "CuPy's pool total_bytes()"


def memory_parts(layers, pool_peak: int | None) -> dict | None:
    """The row's estimate in its parts beside the two measured parts they bound, so that a peak over the
    estimate names the part it missed: the store's device tier (resident layers and their KV: native
    memory) peaked at store_device_peak_bytes against store_limit_bytes; CuPy's pool (slots, output
    weights, workspace, activations) at pool_peak_bytes (sampled every 2 ms) against the slots, fixed and
    workspace bytes; what NVML saw beyond both is the overhead's (context, libraries) and the decoder's
    scratch's. `layers` is the row's StoreLayers; None (no plan) gives None."""
    plan = getattr(layers, "plan", None)
    if plan is None:
        return None
    m = plan.memory
    return {"store_limit_bytes": plan.store_limit, "slots_bytes": plan.n_slots * m.footprint(plan.slot_bytes),
            "fixed_bytes": m.fixed_bytes, "workspace_bytes": m.workspace_bytes, "overhead_bytes": m.overhead_bytes,
            "margin_bytes": m.margin_bytes, "expert_bytes": plan.expert_bytes, "decoder_bytes": m.decoder_bytes,
            "store_device_peak_bytes": int(layers.store.stats().device_peak_bytes), "pool_peak_bytes": pool_peak}


def row_figures(case: dict, batch: int, run: dict, n_prompt: int, n_decode: int, weight_bytes: int,
                bus_bps: float, hbm_bps: float) -> dict:
    r = run["report"]
    step_s = run["decode_s"] / n_decode
    # A batch's report is sequence 0's: its share of each step's restores, a step's bytes over the batch.
    per_step = (r.get("bytes_restored_per_token") or 0) * batch
    measured = run["nvml_peak_bytes"] or r["measured_peak_bytes"]
    return {
        "label": case["label"], "strategy": r["strategy"], "batch": batch, "budget_bytes": case["budget"],
        "note": case["note"], "resident_layers": r["resident_layers"], "n_layers": r["n_layers"],
        "prefill_tokens_per_s": round(batch * n_prompt / run["prefill_s"], 2),
        "decode_tokens_per_s": round(batch * n_decode / run["decode_s"], 3),
        "decode_ms_per_step": round(step_s * 1e3, 3),
        # where a step's time goes (StepTimes): the library call's host time, the device's time over it
        "step_calls": run["step_calls"],
        "inside_step_ms": round(run["inside_step_s"] / max(run["step_calls"], 1) * 1e3, 3),
        "device_step_ms": None if run["device_step_s"] is None else
        round(run["device_step_s"] / max(run["step_calls"], 1) * 1e3, 3),
        "estimated_peak_bytes": r["estimated_peak_bytes"],
        "report_peak_bytes": r["measured_peak_bytes"], "report_peak_how": r["measured_peak_how"],
        "nvml_peak_bytes": run["nvml_peak_bytes"], "nvml_peak_how": run["nvml_peak_how"],
        "peak_over_estimate": round(measured / r["estimated_peak_bytes"], 4),
        "within_budget": None if case["budget"] is None else measured <= case["budget"],
        "bytes_restored": r["bytes_restored"], "bytes_restored_per_step": per_step,
        "achieved_h2d_GBps": round(per_step / step_s / 1e9, 3) if per_step else None,
        "transfer_bound_ms": round(per_step / bus_bps * 1e3, 3),
        "efficiency_vs_bus": round(per_step / bus_bps / step_s, 4) if per_step else None,
        "weight_bytes_per_step": weight_bytes,
        "weights_GBps": round(weight_bytes / step_s / 1e9, 3),
        "roofline_fraction": round(weight_bytes / step_s / hbm_bps, 4),
        "memory": run.get("memory"),
        "tokens": run["tokens"],
    }


def cases_for(pebbled: PebbledModel, options: Options, n_prompt: int, batch: int, labels: list[str]) -> list[dict]:
    memory = pebbled.memory_model(options, n_prompt, n_seqs=batch)
    free, cases = pebbled.backend.free_memory(), []
    for label in labels:
        if label == "none":
            peak = full_residency_peak(memory)
            if free is not None and peak > free:
                print(f"  none at batch {batch} skipped: it needs {peak / 2**30:.2f} GiB, {free / 2**30:.2f} free")
                continue
            cases.append({"label": "none", "strategy": "none", "budget": None, "note": ""})
        elif label == "minimal":
            cases.append({"label": "minimal", "strategy": "minimal", "budget": None, "note": ""})
        else:
            budget, note = fraction_budget(memory, float(label.rstrip("%")) / 100)
            cases.append({"label": label, "strategy": "adaptive", "budget": budget, "note": note})
    return cases


def run_file(type_name: str, args, backend, result: dict, save) -> None:
    entry = {"type": type_name, "rows": []}
    result["files"].append(entry)
    spec = spec_for(args.shape, type_name, args.layers, args.num_ctx)
    path = Path(args.workdir) / f"bench-{args.shape}-{spec.n_layer}L-{type_name}.gguf"
    t = time.perf_counter()
    write_model(path, spec, seed=args.seed)
    entry.update(path=path, file_bytes=path.stat().st_size, write_s=round(time.perf_counter() - t, 2))
    t = time.perf_counter()
    model = load_model(path, weights="quantized", progress=False)
    model.tokenizer.eog_ids = frozenset()  # a fixed-length decode: a random model may hit an end id
    pebbled = PebbledModel(model, backend=backend)
    entry["load_s"] = round(time.perf_counter() - t, 2)
    try:
        run_rows(entry, pebbled, path, args, result, save)
    finally:
        pebbled.close()
        del pebbled, model
        gc.collect()
        backend.free_pool()


def run_rows(entry: dict, pebbled: PebbledModel, path: Path, args, result: dict, save) -> None:
    backend, type_name = pebbled.backend, entry["type"]
    n_prompt, n_decode = args.prompt, args.tokens
    options = Options(temperature=0, repeat_penalty=1.0, num_predict=n_decode + 1, num_ctx=args.num_ctx,
                      num_batch=n_prompt)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(x) for x in rng.integers(0, 600, n_prompt)] for _ in range(max(args.batches))]
    run_row(pebbled, dataclasses.replace(options, num_predict=3), prompts[:1],  # warm-up: kernels, handles
            {"strategy": "minimal", "budget": None}, 2)
    memory = pebbled.memory_model(options, n_prompt)
    stored = sum(t.n_bytes for t in _reader(path).tensors if t.name.startswith("blk."))
    entry.update(layer_bytes_stored=int(stored), layer_bytes_on_device=int(sum(memory.layer_weight_bytes)),
                 device_over_stored=round(sum(memory.layer_weight_bytes) / stored, 4),
                 weight_bytes_per_step=int(sum(memory.layer_weight_bytes) + memory.fixed_bytes),
                 cases_batch1=cases_for(pebbled, options, n_prompt, 1, args.rows))
    if "bus" not in result:
        slot_mib = max(1, max(memory.layer_weight_bytes) >> 20)
        result["bus"] = {**measure_bus(backend, slot_mib, repeats=5), **nominal_bus()}
        result["hbm"] = hbm_bandwidth(backend, min(1 << 30, 8 * (slot_mib << 20)))
        save()
    bus_bps, hbm_bps = result["bus"]["h2d_restore_GBps"] * 1e9, result["hbm"]["GBps"] * 1e9
    for batch in args.batches:
        reference = None
        # Each row's budget from the memory model as it stands just before the row: the backend's measured
        # overhead grows as the rows before it load kernels, and a budget of the first plan's floor fell
        # below a later plan's (Q4_K_M 25%, H200 2026-11-26)
        for label in args.rows:
            cases = cases_for(pebbled, options, n_prompt, batch, [label])
            if not cases:
                continue
            case = cases[0]
            try:
                run = run_row(pebbled, options, prompts[:batch], case, n_decode, args.profile_decode)
            except Exception as exc:  # noqa: BLE001 - a row that breaks is a finding: the next rows still run
                entry["rows"].append({"label": case["label"], "batch": batch, "error": _error(exc)})
                save()
                print(f"  {type_name} batch {batch} {case['label']:8s} ERROR {entry['rows'][-1]['error']}", flush=True)
                continue
            row = row_figures(case, batch, run, n_prompt, n_decode, entry["weight_bytes_per_step"], bus_bps, hbm_bps)
            reference = reference or (row["label"], row["tokens"])
            row["tokens_compared_with"] = reference[0]
            row["tokens_equal"] = row["tokens"] == reference[1]
            entry["rows"].append(row)
            save()
            print(f"  {type_name} batch {batch} {row['label']:8s} decode {row['decode_tokens_per_s']:9.2f} tok/s, "
                  f"prefill {row['prefill_tokens_per_s']:9.1f} tok/s, peak {row['peak_over_estimate']:.3f}x est.",
                  flush=True)


def _error(exc: Exception) -> str:
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
    return f"{type(exc).__name__}: {str(exc)[:500]} (at {where})"


def _reader(path: Path):
    from gguf import GGUFReader
    return GGUFReader(path)


def _ms(value) -> str:
    return f"{value:8.3f}" if value is not None else f"{'-':>8s}"


def table(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [f"speed.py gpu: {cfg['shape']} ({cfg['n_layer']} layers), backend {cfg['backend']}, prompt "
             f"{cfg['prompt']}, {cfg['tokens']} decoded, num_ctx {cfg['num_ctx']}",
             f"  bus h2d {result.get('bus', {}).get('h2d_restore_GBps')} GB/s measured "
             f"(nominal link {result.get('bus', {}).get('nominal_link_GBps') or 'n/a'} GB/s est.), memory roof "
             f"{result.get('hbm', {}).get('GBps')} GB/s measured ({result.get('hbm', {}).get('how')})",
             f"  {'file':7s} {'row':8s} {'B':>2s} {'decode t/s':>11s} {'prefill t/s':>12s} {'peak GiB':>9s} "
             f"{'est. GiB':>9s} {'MB/step':>9s} {'bus eff':>8s} {'roofline':>9s} same {'ms/step':>8s} {'in call':>8s} "
             f"{'device':>8s}"]
    for f in result["files"]:
        if f.get("error"):
            lines.append(f"  {f['type']:7s} ERROR {f['error'][:300]}")
        for r in f["rows"]:
            if r.get("error"):
                lines.append(f"  {f['type']:7s} {r['label']:8s} {r['batch']:2d} ERROR {r['error'][:200]}")
                continue
            peak = r["nvml_peak_bytes"] or r["report_peak_bytes"]
            eff = "-" if r["efficiency_vs_bus"] is None else f"{r['efficiency_vs_bus']:.3f}"
            lines.append(f"  {f['type']:7s} {r['label']:8s} {r['batch']:2d} {r['decode_tokens_per_s']:11.2f} "
                         f"{r['prefill_tokens_per_s']:12.1f} {peak / 2**30:9.3f} {r['estimated_peak_bytes'] / 2**30:9.3f} "
                         f"{r['bytes_restored_per_step'] / 1e6:9.1f} {eff:>8s} {r['roofline_fraction']:9.4f} "
                         f"{'yes' if r['tokens_equal'] else ' NO'} {r['decode_ms_per_step']:8.3f} "
                         f"{_ms(r.get('inside_step_ms'))} {_ms(r.get('device_step_ms'))}")
    for name, peer in result.get("peers", {}).items():
        if not peer.get("present"):
            lines.append(f"  peer {name}: absent ({peer.get('why')})")
        if peer.get("error"):
            lines.append(f"  peer {name}: ERROR {peer['error'][:300]}")
        for r in peer.get("rows", []):
            if r.get("error"):
                lines.append(f"  peer {name} {r['label']:8s} ERROR {r['error'][:200]}")
                continue
            lines.append(f"  peer {name} {r['label']:8s} decode {r['decode_tokens_per_s']:.2f} tok/s, prefill "
                         f"{r['prefill_tokens_per_s']:.1f} tok/s {r.get('how', '')}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "host", "stub"))
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (a slice of the model)")
    parser.add_argument("--types", default="Q4_K_M,F16")
    parser.add_argument("--rows", default="none,50%,25%,minimal")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded per sequence")
    parser.add_argument("--num-ctx", type=int, default=4096)
    parser.add_argument("--peers", default="transformers,llama.cpp", help="or none")
    parser.add_argument("--peer-tokens", type=int, default=32, help="tokens the peers decode (timed after a warm-up)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--profile-decode", action="store_true",
                        help="the CUDA profiler on for each row's decode steps alone (under ncu --profile-from-start off)")
    parser.add_argument("--dir", help="where the GGUF files are written (and deleted)")
    parser.add_argument("--json")
    parser.add_argument("--text")
    args = parser.parse_args(argv)
    args.types, args.rows = args.types.split(","), args.rows.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if unknown := [t for t in args.types if t not in TYPES]:
        parser.error(f"--types: {unknown} unknown; choose from {', '.join(TYPES)}")
    if args.prompt + args.tokens + 1 > args.num_ctx:
        parser.error("--prompt + --tokens must stay below --num-ctx")
    name = args.backend or ("cuda" if probe("cuda").usable else "host" if probe("host").usable else "stub")
    backend = select_backend(name)
    spec = spec_for(args.shape, args.types[0], args.layers, args.num_ctx)
    result = {"config": {"shape": args.shape, "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head,
                         "n_head_kv": spec.n_head_kv, "n_ff": spec.n_ff, "n_vocab": spec.vocab_size,
                         "backend": backend.name, "prompt": args.prompt, "tokens": args.tokens,
                         "num_ctx": args.num_ctx, "batches": args.batches, "rows": args.rows, "seed": args.seed,
                         "weights": "random blocks (gpu_model.py)"},
              "estimates": ESTIMATES, "files": [], "peers": {}}
    started = time.perf_counter()

    def save() -> None:
        result["acceptance"] = acceptance(result)
        result["table"] = table(result) + acceptance_lines(result["acceptance"])
        result["total_s"] = round(time.perf_counter() - started, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    with tempfile.TemporaryDirectory(dir=ram_dir(args.dir, 40 * 2**30), prefix="pebbling-bench-gpu-") as work:
        args.workdir = work
        for type_name in args.types:
            try:
                run_file(type_name, args, backend, result, save)
            except Exception as exc:  # noqa: BLE001 - recorded; the next file and the peers still run
                result["files"][-1]["error"] = _error(exc)
                print(f"  {type_name}: ERROR {result['files'][-1]['error']}", flush=True)
                save()
        peers = [p for p in args.peers.split(",") if p and p != "none"]
        f16 = next((f for f in result["files"] if f["type"] == "F16" and "cases_batch1" in f), None)
        q4 = next((f for f in result["files"] if f["type"] == "Q4_K_M" and f.get("path")), None)
        for peer in peers:
            try:
                if peer == "transformers":
                    got = transformers_rows(spec, f16["cases_batch1"] if f16 else [], args, backend.measures_memory)
                elif peer == "llama.cpp":
                    got = llama_cpp_rows(q4, args, backend.measures_memory) if q4 else {
                        "present": False, "why": "no Q4_K_M file in --types"}
                else:
                    got = {"present": False, "why": f"unknown peer {peer!r}: transformers or llama.cpp"}
            except Exception as exc:  # noqa: BLE001 - a peer that breaks is recorded, the result still written
                got = {"present": True, "error": _error(exc), "rows": []}
            result["peers"][peer] = got
            save()
        for f in result["files"]:
            f["path"] = Path(f["path"]).name if f.get("path") else None
    save()
    text = "\n".join(result["table"]) + "\n"
    print(text, end="")
    if args.text:
        Path(args.text).write_text(text)
    return result

