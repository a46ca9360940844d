"""Issue 28's last item: a Qwen3-30B-A3B-shaped Q4_K_M-like file in a device budget (8 GiB by default), pebbling
with its experts as pebbles beside llama.cpp with the experts of its first N layers on the CPU (what
llama.cpp's --n-cpu-moe N does), N the fewest whose device memory fits the same budget.

    python benchmarks/speed.py moe [--backend cuda|host] [--shape qwen3-30b-a3b|gpt-oss-20b] [--type Q4_K_M|MXFP4_MOE]
        [--n-layer N] [--budget 8GiB] [--prompt 64] [--tokens 32] [--peers llama.cpp|none] [--dir D] [--json FILE]

The file: shapes.py's qwen3-30b-a3b shape (48 layers of 2048, 128 experts of 768, 8 used) by default, its
blocks written as random valid blocks (17 GB at 48 layers; --n-layer fewer for a check); --shape gpt-oss-20b
--type MXFP4_MOE is issue 51's (24 layers of 2880, 32 experts of 2880 with 4 used, MXFP4 experts: 11.3 GiB). pebbling: adaptive at
the budget with pebbling_expert_cache 128 (the plan keeps as many experts a layer as the budget leaves room
for), without and with speculative prefetch; per row prefill and decode tokens/s (greedy), the device peak
(NVML sampled every 2 ms, and the report's) beside the budget, the experts cached a layer, hit rate, expert
bytes restored a token and prefetch accuracy from the report. Random router weights route near-uniformly,
so the hit rate is about the cache's share of a layer's experts (`memory.py experts` has a Zipf
trace for locality).

llama.cpp (llama-cpp-python where it imports, else recorded absent): every layer offloaded, the expert
tensors of layers 0..N-1 kept in the CPU's buffer type through llama_model_params.tensor_buft_overrides
(llama-cpp-python has no argument for it; the parameter is set through ctypes). N starts from an estimate
(the file's tensor bytes, the KV cache and COMPUTE_BYTES of compute buffers, labelled so) and grows while
the measured peak is over the budget. Every other figure is measured in this run.
On a CPU machine, --backend host --n-layer 2 --budget 1GiB checks the script (llama.cpp then runs on the CPU
with the same overrides, which place nothing elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from lib.gpu_peers import PeakSampler, llama_cpp_greedy
from lib.shapes import SHAPES, write_files
from lib.speed_gpu import run_row
from pyplugin.model import GGUFFile, load_model
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import parse_size

SHAPE = "qwen3-30b-a3b"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
COMPUTE_BYTES = 512 << 20  # llama.cpp's compute buffers on the device, in the estimate of N (then measured)


def pebbling_rows(path: Path, args, prompt: list[int]) -> list[dict]:
    pebbled = PebbledModel(load_model(path, weights="quantized", progress=False), backend=args.backend)
    options = Options(temperature=0, repeat_penalty=1.0, num_predict=args.tokens + 1, num_ctx=args.num_ctx,
                      num_batch=args.prompt)
    rows = []
    try:
        for prefetch in (False, True):
            case = {"label": f"adaptive, experts cached{', prefetch' if prefetch else ''}", "strategy": "adaptive",
                    "budget": args.budget, "pebbling": {"pebbling_expert_cache": 128,
                                                        "pebbling_expert_prefetch": prefetch}}
            run = run_row(pebbled, options, [prompt], case, args.tokens)
            r, e = run["report"], run["report"]["experts"]
            peak = run["nvml_peak_bytes"] or r["measured_peak_bytes"]
            rows.append({"label": case["label"], "prefetch": prefetch,
                         "prefill_tokens_per_s": round(len(prompt) / run["prefill_s"], 2),
                         "decode_tokens_per_s": round(args.tokens / run["decode_s"], 3),
                         "peak_bytes": peak, "peak_how": run["nvml_peak_how"] if run["nvml_peak_bytes"] else
                         r["measured_peak_how"], "estimated_peak_bytes": r["estimated_peak_bytes"],
                         "within_budget": peak <= args.budget, "resident_layers": r["resident_layers"],
                         "experts_cached_per_layer": e["cache_per_layer"], "hit_rate": e["hit_rate"],
                         "expert_bytes_restored_per_token": e["bytes_restored_per_token"],
                         "prefetch_accuracy": e["prefetch_accuracy"], "tokens": run["tokens"][0]})
    finally:
        pebbled.close()
    return rows


def layer_bytes(path: Path) -> tuple[list[int], int]:
    """(each layer's expert tensor bytes, every other tensor's bytes but the token embedding, which llama.cpp
    keeps on the host), from the file's own tensor list."""
    gguf = GGUFFile(path)
    experts, other = {}, 0
    for t in gguf.tensors.values():
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in EXPERT_TENSORS:
            experts[int(parts[1])] = experts.get(int(parts[1]), 0) + t.nbytes
        elif not t.name.startswith("token_embd"):
            other += t.nbytes
    return [experts.get(i, 0) for i in range(max(experts, default=-1) + 1)], other


def first_layers_on_cpu(experts: list[int], other: int, kv_bytes: int, budget: int) -> int:
    """The fewest first layers whose experts on the CPU leave the rest within `budget` (an estimate)."""
    for n in range(len(experts) + 1):
        if other + sum(experts[n:]) + kv_bytes + COMPUTE_BYTES <= budget:
            return n
    return len(experts)


def experts_on_cpu(llama_cpp, first: int):
    """A NULL-terminated llama_model_tensor_buft_override array: the expert tensors of layers 0..first-1 in
    the CPU's buffer type (llama.cpp matches each tensor name against the pattern with std::regex_search).
    Kept alive by the caller while the model loads."""
    lib = ctypes.CDLL(str(next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*"))))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p

    class Override(ctypes.Structure):
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    entries = [Override(None, None)]
    if first > 0:
        layers = "|".join(str(i) for i in range(first))
        pattern = f"^blk\\.({layers})\\.ffn_(gate|up|down)_exps".encode()
        entries.insert(0, Override(pattern, lib.ggml_backend_cpu_buffer_type()))
    return (Override * len(entries))(*entries)


def llama_cpp_rows(path: Path, args, prompt: list[int], on_gpu: bool) -> dict:
    try:
        import llama_cpp
    except ImportError as exc:
        return {"present": False, "why": f"llama_cpp does not import: {exc}"}
    experts, other = layer_bytes(path)
    spec = SHAPES[args.shape]
    kv_bytes = 2 * len(experts) * args.num_ctx * spec["n_head_kv"] * spec.get("key_length", 128) * 2
    first = first_layers_on_cpu(experts, other, kv_bytes, args.budget)
    out = {"present": True, "version": getattr(llama_cpp, "__version__", "?"), "rows": [],
           "estimate": f"layers with experts on the CPU first estimated {first} (tensor bytes + KV + "
                       f"{COMPUTE_BYTES >> 20} MiB of compute buffers), then raised while the peak was over"}
    default_params = llama_cpp.llama_cpp.llama_model_default_params
    for _ in range(len(experts) + 1):
        overrides = experts_on_cpu(llama_cpp, first)

        def with_overrides():
            params = default_params()
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
            return params

        llama_cpp.llama_cpp.llama_model_default_params = with_overrides
        try:
            with PeakSampler(measured=on_gpu, what="llama.cpp") as sampler:
                t = time.perf_counter()
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.num_ctx, n_batch=args.prompt,
                                      n_ubatch=args.prompt, n_gpu_layers=-1 if on_gpu else 0, verbose=False)
                load_s = time.perf_counter() - t
                prefill_s, decode_s, tokens = llama_cpp_greedy(llm, prompt, args.tokens)
            llm.close()  # its device memory given back before the next try
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = default_params
        within = None if sampler.peak is None else sampler.peak <= args.budget  # None: nothing measured
        out["rows"].append({"label": f"--n-cpu-moe {first}", "experts_on_cpu_layers": first, "load_s": round(load_s, 2),
                            "prefill_tokens_per_s": round(len(prompt) / prefill_s, 2),
                            "decode_tokens_per_s": round(args.tokens / decode_s, 3),
                            "peak_bytes": sampler.peak, "peak_how": sampler.how, "within_budget": within,
                            "tokens": tokens})
        if within is not False or first >= len(experts):
            break
        over = sampler.peak - args.budget  # move the layers whose experts hold at least the overage
        while over > 0 and first < len(experts):
            over -= experts[first]
            first += 1
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host", "stub"))
    parser.add_argument("--shape", default=SHAPE, choices=sorted(k for k, v in SHAPES.items() if v.get("n_expert")))
    parser.add_argument("--type", default="Q4_K_M", choices=("Q4_K_M", "MXFP4_MOE"), help="the file's mix")
    parser.add_argument("--n-layer", type=int, help="fewer layers than the shape's (a check)")
    parser.add_argument("--budget", default="8GiB", help="device memory for each engine (bytes or e.g. 8GiB)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded")
    parser.add_argument("--num-ctx", type=int, default=1024)
    parser.add_argument("--peers", default="llama.cpp", help="or none")
    parser.add_argument("--dir", help="where the GGUF file is written and kept (default: a temporary folder)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.budget = parse_size(args.budget, "--budget")
    prompt = [int(x) for x in np.random.default_rng(5).integers(100, 30000, args.prompt)]
    with tempfile.TemporaryDirectory(prefix="pebbling-moe-") as tmp:
        directory = Path(args.dir) if args.dir else Path(tmp)
        t = time.perf_counter()
        path = write_files(directory, [args.type], args.shape, args.n_layer)[args.type]
        result = {"shape": args.shape, "type": args.type, "n_layer": args.n_layer or SHAPES[args.shape]["n_layer"],
                  "file_bytes": path.stat().st_size,
                  "write_s": round(time.perf_counter() - t, 1), "budget_bytes": args.budget, "backend": args.backend,
                  "prompt": args.prompt, "tokens": args.tokens, "num_ctx": args.num_ctx,
                  "pebbling": pebbling_rows(path, args, prompt)}
        result["llama.cpp"] = (llama_cpp_rows(path, args, prompt, args.backend == "cuda") if args.peers != "none"
                               else {"present": False, "why": "--peers none"})
    print(f"{args.shape} ({result['n_layer']} layers, {result['file_bytes'] / 2**30:.2f} GiB {args.type}), budget "
          f"{args.budget / 2**30:.2f} GiB, prompt {args.prompt}, {args.tokens} greedy tokens, backend {args.backend}")
    for r in result["pebbling"]:
        print(f"  pebbling {r['label']:32s} decode {r['decode_tokens_per_s']:8.2f} tok/s, prefill "
              f"{r['prefill_tokens_per_s']:8.1f}, peak {r['peak_bytes'] / 2**30:.2f} GiB ({r['peak_how']}), experts "
              f"cached {r['experts_cached_per_layer']} a layer, hit rate {r['hit_rate']}, "
              f"{r['expert_bytes_restored_per_token'] / 2**20:.1f} MiB a token, prefetch accuracy {r['prefetch_accuracy']}")
    peer = result["llama.cpp"]
    if not peer.get("present"):
        print(f"  llama.cpp: absent ({peer['why']})")
    for r in peer.get("rows", []):
        peak = "not measured" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"  llama.cpp {r['label']:31s} decode {r['decode_tokens_per_s']:8.2f} tok/s, prefill "
              f"{r['prefill_tokens_per_s']:8.1f}, peak {peak}"
              + ("" if r["within_budget"] is None else f", within the budget: {r['within_budget']}"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result

