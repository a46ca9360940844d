"""pebbling's host backend beside llama.cpp on the same CPU, the same files, the same threads.

    python benchmarks/speed.py cpu --llama-python PYTHON [--runs 5] [--prompt-tokens 128]
        [--decode-tokens 64] [--threads 2] [--types Q4_K_M,Q8_0,Q4_1] [--shape NAME] [--n-layer N]
        [--busy-neighbour] [--json FILE]

Two random-weight files of Qwen2-0.5B's shape (24 layers of 1024, 16 heads of 64, 2 KV heads, a 4864
feed-forward, a tied output over a vocabulary padded to 151936; 1024 rather than Qwen2-0.5B's 896 so
that every row is whole 256-element blocks) are written with pyplugin.model.synth: a Q4_K_M-like one
(Q4_K, with Q6_K for attn_v, ffn_down and the tied token_embd, as llama.cpp's Q4_K_M has for the
output) and a Q8_0 one. Each run starts a fresh process per engine, the engines interleaved (llama.cpp,
pebbling `none`, pebbling `minimal`, then again), and each process measures:

  load     from nothing to ready to prefill: llama.cpp's Llama(...); pebbling's load_model, the
           PebbledModel that saves the layers into the store, and the request's generation
  prefill  the prompt (random token ids) in one batch, tokens/s
  decode   --decode-tokens greedy tokens (argmax of the logits; end-of-generation does not stop),
           tokens/s
  RSS      the process's peak resident set (getrusage), the interpreter and numpy included on both
           sides

and the greedy tokens. --busy-neighbour runs it all beside a process spinning on one core, as a
shared machine is. The table gives medians over --runs, the ratios pebbling / llama.cpp of
those medians, each run's decode ratio over the llama.cpp run of the same round (and their median), and
whether the greedy tokens are equal. Every figure is measured here; the machine may be shared, which
moves absolute figures between runs: the interleaving is there so that the ratios see the same
conditions.

--shape qwen3-30b-a3b is issue 28's acceptance 3: a Qwen3-30B-A3B-shaped mixture of experts (48 layers of
2048, 32 query and 4 KV heads of 128, 128 experts of 768 with 8 used, an untied output over 151936), its
Q4_K_M-like file (Q4_K; Q6_K for the embedding, the output, and attn_v and ffn_down_exps on every other
layer) 17.3 GiB, its blocks random and written directly rather than quantized from floats. On a quiet
machine with 24 GiB of memory and the disk for it (--dir keeps the file between runs):

    python benchmarks/speed.py cpu --llama-python PYTHON --shape qwen3-30b-a3b --types Q4_K_M \
        --threads 2 --runs 3 --prompt-tokens 32 --decode-tokens 32 --strategies none --dir DIR

(--n-layer 2 makes a 1.1 GiB file of the same layers, to try it first.)

llama-cpp-python is NOT a pebbling dependency: --llama-python names an interpreter that has it, built for
the CPU it runs on: `python3 -m venv V && V/bin/pip install numpy && CMAKE_ARGS=-DGGML_NATIVE=ON
V/bin/pip install --no-binary llama-cpp-python llama-cpp-python` (then it uses AVX-512 VNNI and its
repacked Q4_K GEMMs where the CPU has them; a plain `pip install` has been seen to build for AVX2 only,
which flatters pebbling by up to 1.6x). The table prints llama.cpp's build beside each file and warns
where it lacks what this CPU has. Only numpy and llama_cpp are imported there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lib import entry
from lib.shapes import FILES, SHAPES, write_files


# ---------------------------------------------------------------------------------------------------
# children: one engine, one run, JSON on stdout

_PATH_ARGS = ("llama_python", "dir", "json")

def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM, which (unlike getrusage's maxrss, kept across exec)
    is this program's own."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # elsewhere: KiB on Linux, bytes on macOS


def llama_child(path: str, prompt: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp  # noqa: PLC0415 - only in the interpreter that has it

    n_ctx = len(prompt) + n_decode + 8
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=len(prompt), n_ubatch=len(prompt),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    start = time.perf_counter()
    llm.eval(prompt)
    token = int(np.argmax(last_logits()))
    prefill_s = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in range(n_decode - 1):
        llm.eval([token])
        token = int(np.argmax(last_logits()))
        tokens.append(token)
    decode_s = time.perf_counter() - start
    build = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return dict(load_s=load_s, prefill_s=prefill_s, decode_s=decode_s, tokens=tokens, rss=peak_rss_bytes(),
                build=build)


def pebbling_child(path: str, prompt: list[int], n_decode: int, strategy: str) -> dict:
    from pyplugin.model import load_model  # noqa: PLC0415 - the child imports what it measures
    from pyplugin.runtime import PebbledModel
    from pyplugin.runtime.options import Options
    from pyplugin.runtime.plan import PebblingOptions

    start = time.perf_counter()
    pebbled = PebbledModel(load_model(path, weights="quantized", progress=False), backend="host")
    options = Options(temperature=0, num_ctx=len(prompt) + n_decode + 8, num_batch=len(prompt),
                      num_predict=n_decode)
    gen = pebbled.generation(options, PebblingOptions.from_options({"pebbling_strategy": strategy}), len(prompt))
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    token = int(np.argmax(gen.prefill(prompt)))
    prefill_s = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in range(n_decode - 1):
        token = int(np.argmax(gen.decode_one(token)))
        tokens.append(token)
    decode_s = time.perf_counter() - start
    report = gen.report() or {}
    return dict(load_s=load_s, prefill_s=prefill_s, decode_s=decode_s, tokens=tokens, rss=peak_rss_bytes(),
                accounted=report.get("peak_memory_bytes") or report.get("measured_peak_bytes"))


# ---------------------------------------------------------------------------------------------------
# the parent

def run_child(python: str, engine: str, path: Path, prompt: list[int], args) -> dict:
    job = json.dumps(dict(engine=engine, path=str(path), prompt=prompt, n_decode=args.decode_tokens,
                          threads=args.threads))
    env = {**os.environ, "PEBBLING_THREADS": str(args.threads)}
    done = subprocess.run([python, entry("speed"), "cpu", "--child", job], capture_output=True, text=True, env=env,
                          timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{engine} on {path.name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], n_prompt: int, n_decode: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return dict(load_s=med("load_s"), prefill_tok_s=n_prompt / med("prefill_s"),
                decode_tok_s=(n_decode - 1) / med("decode_s"), peak_rss=med("rss"),
                accounted=runs[0].get("accounted"), tokens=runs[0]["tokens"],
                tokens_stable=all(r["tokens"] == runs[0]["tokens"] for r in runs))


def paired_ratios(base: list[dict], runs: list[dict]) -> dict:
    """Each run's prefill and decode rate over the llama.cpp run of the same round, and their medians: on a
    machine whose speed drifts during the runs, the ratio of the two medians can fall on runs of different
    conditions, where each pair saw nearly the same."""
    decode = [b["decode_s"] / r["decode_s"] for b, r in zip(base, runs)]
    prefill = [b["prefill_s"] / r["prefill_s"] for b, r in zip(base, runs)]
    return dict(decode=decode, prefill=prefill, decode_median=statistics.median(decode),
                prefill_median=statistics.median(prefill))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=sys.executable, help="an interpreter with llama_cpp")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="Q4_K_M,Q8_0")
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES),
                        help="the real model whose shape the random-weight files take")
    parser.add_argument("--n-layer", type=int, default=None, help="fewer (or more) layers than the shape's")
    parser.add_argument("--dir", default=None, help="where the files are written (default: a temporary one)")
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="run every measurement beside a process that spins on one core (a busy neighbour): "
                             "a pool whose threads spin rather than share collapses there")
    parser.add_argument("--strategies", default="none,minimal",
                        help="pebbling's strategies to run beside llama.cpp (comma-separated)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        job = json.loads(args.child)
        if job["engine"] == "llama.cpp":
            out = llama_child(job["path"], job["prompt"], job["n_decode"], job["threads"])
        else:
            out = pebbling_child(job["path"], job["prompt"], job["n_decode"], job["engine"].split()[-1])
        print(json.dumps(out))
        return

    names = [n for n in args.types.split(",") if n]
    unknown = [n for n in names if n not in FILES]
    if unknown:
        parser.error(f"--types: {', '.join(unknown)} unknown; choose from {', '.join(FILES)}")
    engines = ["llama.cpp", *(f"pebbling {s}" for s in args.strategies.split(",") if s)]
    neighbour = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_neighbour else None)
    try:
        results = run_all(args, names, engines)
    finally:
        if neighbour is not None:
            neighbour.kill()
    print_table(results, args)
    if args.json:
        # the arguments as run, but for where this machine keeps things (an interpreter, a directory, a file)
        recorded = {k: Path(v).name if k in _PATH_ARGS and v else v for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps(dict(args=recorded, cpu=cpu_model(), results=results), indent=1))


def run_all(args, names: list[str], engines: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp)
        paths = write_files(directory, names, args.shape, args.n_layer)
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, 600, args.prompt_tokens)]
        results: dict[str, dict] = {}
        for name, path in paths.items():
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            for i in range(args.runs):
                for engine in engines:
                    python = args.llama_python if engine == "llama.cpp" else sys.executable
                    runs[engine].append(run_child(python, engine, path, prompt, args))
                    r = runs[engine][-1]
                    print(f"  {name} run {i + 1} {engine:17s} load {r['load_s']:.2f} s, prefill "
                          f"{args.prompt_tokens / r['prefill_s']:.1f} tok/s, decode "
                          f"{(args.decode_tokens - 1) / r['decode_s']:.1f} tok/s, peak RSS {r['rss'] / 2**20:.0f} MiB",
                          file=sys.stderr, flush=True)
            results[name] = {e: summarize(runs[e], args.prompt_tokens, args.decode_tokens) for e in engines}
            for e in engines[1:]:
                results[name][e]["paired"] = paired_ratios(runs["llama.cpp"], runs[e])
            results[name]["file_bytes"] = path.stat().st_size
            results[name]["llama_cpp_build"] = runs["llama.cpp"][0].get("build", "unknown")
    return results


def cpu_model() -> str:
    """The CPU's name and its vector extensions that the kernels use, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni") if f in flags]
    return f"{name} ({', '.join(simd) or 'no AVX2'})"


def build_warning(build: str) -> str | None:
    """What llama.cpp's build lacks of this CPU's vector extensions that pebbling's kernels use: a build
    without them (a generic wheel, GGML_NATIVE off) is slower here than it could be, and the comparison flatters
    pebbling."""
    cpu = cpu_model()
    missing = [ext for flag, ext in (("avx512f", "AVX512"), ("avx512_vnni", "AVX512_VNNI"))
               if flag in cpu and f"{ext} = 1" not in build]
    if not missing:
        return None
    return (f"llama.cpp here was built without {', '.join(missing)}, which this CPU has and pebbling uses: the "
            "ratios flatter pebbling; rebuild it for this CPU (CMAKE_ARGS=-DGGML_NATIVE=ON pip install "
            "--no-binary llama-cpp-python --force-reinstall llama-cpp-python)")


def print_table(results: dict, args) -> None:
    print(f"\nmedians of {args.runs} interleaved runs, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
          f"{args.decode_tokens} greedy tokens, {args.shape} shape, "
          f"{args.n_layer or SHAPES[args.shape]['n_layer']} layers, CPU: {cpu_model()} (all measured on this machine"
          + (", beside a process spinning on one core" if args.busy_neighbour else "") + ")")
    for name, r in results.items():
        base = r["llama.cpp"]
        print(f"\n{name} ({r['file_bytes'] / 2**20:.0f} MiB file); llama.cpp's build: {r['llama_cpp_build']}")
        warning = build_warning(r["llama_cpp_build"])
        if warning:
            print(f"  WARNING: {warning}")
        print(f"  {'engine':17s} {'load s':>7s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'peak RSS MiB':>13s}"
              f"  {'ratios (prefill, decode, load, RSS)':36s} greedy tokens")
        for engine in (e for e in r if e == "llama.cpp" or e.startswith("pebbling ")):
            e = r[engine]
            ratios = (f"{e['prefill_tok_s'] / base['prefill_tok_s']:.2f}x {e['decode_tok_s'] / base['decode_tok_s']:.2f}x "
                      f"{e['load_s'] / base['load_s']:.2f}x {e['peak_rss'] / base['peak_rss']:.2f}x")
            same = "" if engine == "llama.cpp" else (
                "equal" if e["tokens"] == base["tokens"] else
                f"differ from token {next(i for i, (a, b) in enumerate(zip(e['tokens'], base['tokens'])) if a != b)}")
            print(f"  {engine:17s} {e['load_s']:7.2f} {e['prefill_tok_s']:14.1f} {e['decode_tok_s']:13.1f} "
                  f"{e['peak_rss'] / 2**20:13.0f}  {ratios:36s} {same}")
            if e.get("paired"):
                pr = e["paired"]
                print(f"  {'':17s} run by run, over the llama.cpp run of its round: decode "
                      f"{' '.join(f'{x:.2f}' for x in pr['decode'])} (median {pr['decode_median']:.2f}x), prefill "
                      f"median {pr['prefill_median']:.2f}x")
            if e.get("accounted"):
                print(f"  {'':17s} (the store's accounted peak: {e['accounted'] / 2**20:.0f} MiB)")
        none, minimal = r.get("pebbling none"), r.get("pebbling minimal")
        if none and minimal:
            print(f"  minimal / none decode: {minimal['decode_tok_s'] / none['decode_tok_s']:.2f}x")

