"""pebbling beside Hugging Face transformers on one random-weight Llama, same weights, same run:
peak device memory, decode and prefill speed, and how close streaming comes to the transfer bound.

    python benchmarks/agreement.py transformers [--json FILE] [--device cuda|cpu] [--decode-tokens 16]
        [--prompt-tokens 512] [--num-ctx 4096] [--fractions 1,0.5,0.25] [--dir /dev/shm]
        [--n-layer 32] [--n-embd 4096] [--n-ff 14336] [--n-head 32] [--n-head-kv 8]

The model has Llama-3-8B's layer shapes by default (32 layers of 4096, 32 heads, 8 KV heads, a 14336
feed-forward: 7.0B layer parameters) with random fp16 weights and synth's small vocabulary. It is
built through pebbling's own loader: pyplugin.model.synth writes the GGUF into a RAM-backed directory
(/dev/shm where it exists and has room), pyplugin.model.load_model reads it, the file is deleted.

pebbling rows (greedy, batch 1, --prompt-tokens of prefill in one chunk, then --decode-tokens):
  none      every layer resident (run when it fits the device)
  F%        adaptive with pebbling_memory_limit = budget(F), see `fraction_budget`:
            F x the layers' weight bytes + every other byte `none` needs (the KV cache of every
            layer at num_ctx, output matrix, workspace, measured CUDA overhead); so 100% is `none`'s
            footprint and a smaller F takes room from the weights alone
  minimal   two working slots, everything streams
Each: measured peak device memory (the report's: NVML on the GPU, byte accounting on host/stub)
beside the estimate, decode and prefill tokens/s, bytes restored per decoded token, and efficiency =
(bytes restored per token / bandwidth) / measured time per token, with the pinned host-to-device
bandwidth measured in this run through pebble_restore (`memory.py store`).

transformers rows (LlamaForCausalLM from the same weights, fp16 on the GPU, fp32 on the CPU):
  gpu       fully on the device (model.to)
  F%        accelerate offload with max_memory={0: budget(F), "cpu": free host memory}, the
            device map and dispatch that from_pretrained(device_map="auto", max_memory=...) makes
Each: decode and prefill tokens/s timed the same way (same prompt ids, greedy, use_cache=True, warm-up
first, torch.cuda.synchronize around timed regions), the torch allocator peak, and agreement of its
greedy tokens with pebbling's (fp16 near-ties may part them: the first divergence and the logit
margin there are printed).

Then the acceptance checks of issue 6, each PASS or FAIL (never asserted). torch, transformers and
accelerate are not pebbling dependencies: install them beside it for this script only. With
--device cpu (the default where CUDA is not available) pebbling runs on the host backend and
transformers on the CPU, for checking the logic at a tiny size, e.g.

    python benchmarks/agreement.py transformers --device cpu --n-layer 4 --n-embd 256 --n-ff 512 \\
        --n-head 4 --n-head-kv 2 --num-ctx 256 --prompt-tokens 32 --decode-tokens 8
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lib import ram_dir
from lib.memory_store import measure as measure_bandwidth
from pyplugin.store.backend import probe
from pyplugin.runtime import PebbledModel
from pyplugin.model import load_model
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions, full_residency_peak, smallest_footprint
from pyplugin.model.synth import write_gguf

BUDGET_DEFINITION = ("budget(F) = F x the layers' weight bytes + every other byte `none` needs (KV cache of "
                     "every layer at num_ctx, output matrix and norm, workspace, backend overhead); "
                     "100% is `none`'s footprint; raised to the minimal footprint where below it")
GOAL_EFFICIENCY = 0.85        # streaming efficiency at the 25% budget and at minimal
GOAL_VS_ACCELERATE = 3.0      # decode tokens/s at 25%, over transformers + accelerate at 25%
GOAL_NONE_VS_GPU = 1.0        # decode tokens/s of none, over transformers fully on the GPU
GOAL_PEAK_VS_ESTIMATE = 0.05  # measured peak within 5% of the estimate


def import_hf():
    """torch, transformers and accelerate, or exit with what to install (they are not pebbling's)."""
    try:
        import accelerate
        import torch
        import transformers
    except ImportError as exc:
        sys.exit(f"`agreement.py transformers` needs torch, transformers and accelerate ({exc}); they are not "
                 "pebbling dependencies: pip install torch transformers accelerate beside pebbling")
    return torch, transformers, accelerate


# ---------------------------------------------------------------------------------------------------
# the model, through pebbling's loader


def build_model(args: argparse.Namespace):
    """Random fp16 weights written by synth, read back by load_model; the file is deleted."""
    e, f, head_dim = args.n_embd, args.n_ff, args.n_embd // args.n_head
    kv = args.n_head_kv * head_dim
    file_bytes = args.n_layer * (2 * e * e + 2 * e * kv + 3 * e * f) * 2  # F16 layer matrices
    directory = ram_dir(args.dir, int(file_bytes * 1.1))
    print(f"writing a {file_bytes / 2**30:.1f} GiB random-weight GGUF into {directory} ...", flush=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix="pebbling-bench-") as tmp:
        path = write_gguf(Path(tmp) / "bench.gguf", arch="llama", n_layer=args.n_layer, n_embd=e,
                          n_head=args.n_head, n_head_kv=args.n_head_kv, n_ff=f, n_ctx=args.num_ctx,
                          weight_type="F16", seed=args.seed)
        model = load_model(path, weights="f16", progress=False)
    # A fixed-length decode, as llama-bench does: a random model may hit an end-of-generation id.
    model.tokenizer.eog_ids = frozenset()
    return model


def parameter_count(model) -> tuple[int, int]:
    layers = sum(a.size for lw in model.layers for _, a in lw.arrays())
    outer = sum(a.size for a in {id(a): a for a in vars(model.outer).values()}.values())
    return int(layers), int(outer)


# ---------------------------------------------------------------------------------------------------
# pebbling


def fraction_budget(memory, fraction: float) -> tuple[int, str]:
    """pebbling_memory_limit for a budget of `fraction` of the model's weights:

        fraction x (the layers' weight bytes) + (`none`'s estimated footprint - the layers' weight bytes)

    The second term is every byte that full residency needs besides the layers' weights: the KV
    cache of every layer at num_ctx, the output matrix and norm, the workspace and the backend's
    measured overhead. So 100% is exactly `none`'s footprint, and a smaller fraction takes its room
    from the weights alone. (Counting only the minimal footprint's non-weight part, i.e. the KV of
    two slots, would leave "100%" short of the other layers' KV, and it would stream.) A budget below
    the minimal footprint is raised to it, and the note says so."""
    weights = sum(memory.layer_weight_bytes)
    budget = int(fraction * weights) + full_residency_peak(memory) - weights
    floor = smallest_footprint(memory)
    if budget < floor:
        return floor, f"{fraction:.0%} is below the minimal footprint: raised to it"
    return budget, ""


def run_pebbling(pebbled: PebbledModel, options: Options, prompt: list[int], strategy: str,
                 budget: int | None = None) -> dict:
    """One greedy request through the store; the report and the loop's own timings."""
    pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy, "pebbling_memory_limit": budget})
    gen = pebbled.generation(options, pebbling, len(prompt))
    tokens = list(gen.tokens(prompt))
    s = gen.stats
    return {"tokens": tokens, "report": gen.report(),
            "decode_s_per_token": s.generate_ns / 1e9 / max(s.generated_tokens, 1),
            "prefill_tokens_per_s": s.prompt_tokens / (s.prompt_ns / 1e9)}


def pebbling_cases(pebbled: PebbledModel, memory, fractions: list[float]) -> list[dict]:
    """(label, strategy, budget, note) of each row: none when it fits the device, each fraction, minimal."""
    cases = []
    free = pebbled.backend.free_memory()
    none_peak = full_residency_peak(memory)
    if free is None or none_peak <= free:
        cases.append({"label": "none", "strategy": "none", "budget": None, "note": ""})
    else:
        print(f"none skipped: it needs {none_peak / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free")
    for fraction in fractions:
        budget, note = fraction_budget(memory, fraction)
        cases.append({"label": f"{fraction:.0%}", "fraction": fraction, "strategy": "adaptive",
                      "budget": budget, "note": note})
    cases.append({"label": "minimal", "strategy": "minimal", "budget": None, "note": ""})
    return cases


def pebbling_row(case: dict, result: dict, reference: list[int] | None, h2d_bytes_per_s: float) -> dict:
    report = result["report"]
    per_token = report["bytes_restored_per_token"] or 0
    bound_s = per_token / h2d_bytes_per_s
    decode_s = result["decode_s_per_token"]
    budget = case["budget"]
    return {
        "label": case["label"], "strategy": report["strategy"], "budget_bytes": budget, "note": case["note"],
        "resident_layers": report["resident_layers"], "n_layers": report["n_layers"],
        "tokens": result["tokens"],
        "tokens_equal_none": None if reference is None else result["tokens"] == reference,
        "estimated_peak_bytes": report["estimated_peak_bytes"],
        "measured_peak_bytes": report["measured_peak_bytes"], "measured_how": report["measured_peak_how"],
        "peak_over_estimate": report["measured_peak_bytes"] / report["estimated_peak_bytes"],
        "within_budget": None if budget is None else report["measured_peak_bytes"] <= budget,
        "decode_tokens_per_s": 1.0 / decode_s, "decode_ms_per_token": decode_s * 1e3,
        "prefill_tokens_per_s": result["prefill_tokens_per_s"],
        "bytes_restored_per_token": per_token, "transfer_bound_ms": bound_s * 1e3,
        "efficiency": bound_s / decode_s if per_token else None,
    }


def pebbling_rows(pebbled: PebbledModel, options: Options, prompt: list[int], cases: list[dict],
                  h2d_bytes_per_s: float, on_row) -> list[dict]:
    rows, reference = [], None
    for case in cases:
        result = run_pebbling(pebbled, options, prompt, case["strategy"], case["budget"])
        if case["strategy"] == "none":
            reference = result["tokens"]
        rows.append(pebbling_row(case, result, reference, h2d_bytes_per_s))
        on_row(rows)
        print(f"  pebbling {case['label']:<8} {rows[-1]['decode_tokens_per_s']:8.2f} tok/s decode", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------
# transformers


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's llama Q/K row permutation (synth.permute_qk): within each head, the
    adjacent rows (2i, 2i + 1) GGML's normal RoPE rotates go back to Hugging Face's (i, i + d/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(model, num_ctx: int, transformers):
    cfg = model.config
    plain_rope = (cfg.rope_mode == "normal" and cfg.rope_dims == cfg.head_dim and cfg.rope_freq_scale == 1.0
                  and cfg.rope_freq_factors is None)
    if cfg.arch != "llama" or not plain_rope or model.layers[0].bq is not None:
        raise SystemExit(f"this benchmark mirrors plain llama models only (got {cfg.arch}, rope "
                         f"{cfg.rope_mode}/{cfg.rope_dims} dims, scale {cfg.rope_freq_scale})")
    # transformers 5 keeps the RoPE base in rope_parameters; 4.x takes rope_theta.
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
            if "rope_parameters" in inspect.signature(transformers.LlamaConfig).parameters
            else {"rope_theta": cfg.rope_theta})
    return transformers.LlamaConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim, max_position_embeddings=max(num_ctx, cfg.n_ctx_train),
        rms_norm_eps=cfg.rms_eps, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=model.outer.output is model.outer.token_embd, **rope)


def hf_state_dict(model, torch, dtype) -> dict:
    """pebbling's weights under LlamaForCausalLM's names, on the host, in `dtype`. Both lay a matrix
    out [out, in]; only Q and K rows need their Hugging Face order back."""
    cfg = model.config

    def t(a: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    sd = {"model.embed_tokens.weight": t(model.outer.token_embd), "model.norm.weight": t(model.outer.output_norm)}
    if model.outer.output is not model.outer.token_embd:
        sd["lm_head.weight"] = t(model.outer.output)
    for i, lw in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": t(lw.attn_norm),
            p + "self_attn.q_proj.weight": t(unpermute_qk(lw.wq, cfg.n_head)),
            p + "self_attn.k_proj.weight": t(unpermute_qk(lw.wk, cfg.n_head_kv)),
            p + "self_attn.v_proj.weight": t(lw.wv),
            p + "self_attn.o_proj.weight": t(lw.wo),
            p + "post_attention_layernorm.weight": t(lw.ffn_norm),
            p + "mlp.gate_proj.weight": t(lw.w_gate),
            p + "mlp.up_proj.weight": t(lw.w_up),
            p + "mlp.down_proj.weight": t(lw.w_down),
        })
    return sd


def hf_model_from(config, state_dict, transformers, accelerate):
    """A LlamaForCausalLM whose parameters are the host tensors of state_dict (no copy, no random
    init): each row moves or dispatches its own, and the tensors stay for the next row."""
    with accelerate.init_empty_weights():  # parameters on meta; buffers (RoPE inv_freq) on the host
        hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(state_dict, assign=True, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def hf_offload(hf, budget: int, accelerate):
    """What from_pretrained(device_map="auto", max_memory={0: budget, "cpu": ...}) does once the
    weights are loaded (transformers.integrations.accelerate: infer_auto_device_map over the
    model's no-split blocks, then dispatch_model): the layers that fit stay on GPU 0, the rest are
    copied there from host memory by accelerate's hooks at every forward."""
    import psutil  # an accelerate dependency

    max_memory = {0: int(budget), "cpu": int(psutil.virtual_memory().available * 0.9)}
    device_map = accelerate.infer_auto_device_map(hf, max_memory=max_memory,
                                                  no_split_module_classes=list(hf._no_split_modules))
    skip = getattr(hf, "_skip_keys_device_placement", None)
    accelerate.dispatch_model(hf, device_map=device_map, skip_keys=skip)
    on_gpu = sum(device_of(device_map, f"model.layers.{i}") not in ("cpu", "disk")
                 for i in range(hf.config.num_hidden_layers))
    return device_map, on_gpu


def device_of(device_map: dict, name: str):
    """The device a module is mapped to: its own entry, else its nearest mapped parent's."""
    while name not in device_map and name:
        name = name.rpartition(".")[0]
    return device_map.get(name)


def hf_greedy(hf, prompt: list[int], n_decode: int, device: str, torch) -> dict:
    """Greedy decode mirroring pebbling's loop: prefill the prompt in one forward, then n_decode
    times pick the argmax and run it through. Timed with the device synchronised."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        sync()
        start = time.perf_counter()
        out = hf(input_ids=ids, use_cache=True)
        logits = out.logits[0, -1].float()
        sync()
        prefill_s = time.perf_counter() - start
        cache, tokens, margins = out.past_key_values, [], []
        start = time.perf_counter()
        for _ in range(n_decode):
            token = int(torch.argmax(logits))
            top = torch.topk(logits, 2).values
            tokens.append(token)
            margins.append(float(top[0] - top[1]))
            out = hf(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1].float()
        sync()
        decode_s = time.perf_counter() - start
    return {"tokens": tokens, "margins": margins, "prefill_tokens_per_s": len(prompt) / prefill_s,
            "decode_tokens_per_s": n_decode / decode_s, "decode_ms_per_token": decode_s / n_decode * 1e3}


def hf_row(label: str, how: str, hf, prompt: list[int], args, reference: list[int] | None, torch) -> dict:
    # Warm-up with the timed run's own shapes: kernels are picked and loaded per shape on first use.
    hf_greedy(hf, prompt, min(4, args.decode_tokens), args.device, torch)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = hf_greedy(hf, prompt, args.decode_tokens, args.device, torch)
    step = first_divergence(result["tokens"], reference)
    row = {"label": label, "how": how, **result,
           "tokens_equal_pebbling": None if reference is None else step is None,
           "first_divergence_step": step,
           "margin_at_divergence": None if step is None or step >= len(result["margins"]) else result["margins"][step]}
    if args.device == "cuda":
        row["torch_allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return row


def hf_rows(model, prompt: list[int], args, cases: list[dict], reference: list[int] | None, on_row) -> list[dict]:
    torch, transformers, accelerate = import_hf()
    dtype = torch.float16 if args.device == "cuda" else torch.float32  # pebbling's compute type there
    config = hf_config(model, args.num_ctx, transformers)
    state_dict = hf_state_dict(model, torch, dtype)
    rows = []

    hf = hf_model_from(config, state_dict, transformers, accelerate).to(args.device)
    rows.append(hf_row(args.device, f"fully on the {args.device} ({str(dtype).split('.')[-1]})", hf, prompt,
                       args, reference, torch))
    on_row(rows)
    print(f"  transformers {args.device:<8} {rows[-1]['decode_tokens_per_s']:8.2f} tok/s decode", flush=True)
    del hf
    release(torch)

    if args.device != "cuda":
        print("  transformers + accelerate offload: skipped, it offloads from a GPU (none here)")
        return rows
    for case in cases:
        if "fraction" not in case:
            continue
        hf = hf_model_from(config, state_dict, transformers, accelerate)
        device_map, on_gpu = hf_offload(hf, case["budget"], accelerate)
        row = hf_row(case["label"], f"accelerate, max_memory[0] = {case['budget']} B", hf, prompt, args,
                     reference, torch)
        row.update(max_memory_gpu_bytes=case["budget"], layers_on_gpu=on_gpu,
                   device_map={k: str(v) for k, v in device_map.items()})
        rows.append(row)
        on_row(rows)
        print(f"  transformers+accelerate {case['label']:<6} {row['decode_tokens_per_s']:8.2f} tok/s decode "
              f"({on_gpu}/{config.num_hidden_layers} layers on the GPU)", flush=True)
        del hf
        release(torch)
    return rows


def release(torch) -> None:
    """Give back what the last row's model held, so the next row's peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# acceptance and output


def first_divergence(a: list[int], b: list[int] | None) -> int | None:
    """The first step where two token sequences differ (None: they agree)."""
    if b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def acceptance(pebbling: list[dict], hf: list[dict], device: str) -> list[dict]:
    """Issue 6's acceptance, each as (check, value, goal, PASS/FAIL or n/a)."""
    by_label = {r["label"]: r for r in pebbling}
    hf_by_label = {r["label"]: r for r in hf}
    checks = []

    def check(name: str, value, ok: bool | None, goal: str, why: str = "") -> None:
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        checks.append({"check": name, "value": value, "goal": goal, "verdict": verdict, "note": why})

    equal = [r["tokens_equal_none"] for r in pebbling if r["label"] != "none"]
    check("every strategy: tokens identical to none", f"{sum(bool(e) for e in equal)}/{len(equal)}",
          None if "none" not in by_label else all(equal), "all", "" if "none" in by_label else "none not run")
    within = [r for r in pebbling if r["within_budget"] is not None]
    check("measured peak never above the budget", f"{sum(r['within_budget'] for r in within)}/{len(within)}",
          all(r["within_budget"] for r in within), "all", pebbling[0]["measured_how"])
    worst = max(abs(r["peak_over_estimate"] - 1) for r in pebbling)
    check("measured peak within 5% of the estimate", f"worst {worst:.1%}", worst <= GOAL_PEAK_VS_ESTIMATE,
          "<= 5%", pebbling[0]["measured_how"])
    for label in ("25%", "minimal"):
        eff = by_label.get(label, {}).get("efficiency")
        check(f"streaming efficiency at {label}", None if eff is None else round(eff, 3),
              None if eff is None else eff >= GOAL_EFFICIENCY, f">= {GOAL_EFFICIENCY}",
              "" if eff is not None else "no such row, or nothing streamed")
    ours, theirs = by_label.get("25%"), hf_by_label.get("25%")
    ratio = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"] if ours and theirs else None
    check("decode tok/s at 25%: pebbling / transformers+accelerate", None if ratio is None else round(ratio, 2),
          None if ratio is None else ratio >= GOAL_VS_ACCELERATE, f">= {GOAL_VS_ACCELERATE:g}x",
          "" if ratio is not None else "accelerate offload runs on a GPU only")
    ours, theirs = by_label.get("none"), hf_by_label.get(device)
    ratio = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"] if ours and theirs else None
    check(f"decode tok/s: none / transformers fully on the {device}",
          None if ratio is None else round(ratio, 2), None if ratio is None else ratio >= GOAL_NONE_VS_GPU,
          f">= {GOAL_NONE_VS_GPU:g}x", "" if device == "cuda" else "CPU run: not the GPU goal")
    return checks


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def print_tables(result: dict) -> None:
    c = result["config"]
    print()
    print(f"model: random-weight llama, {c['n_layer']} layers x {c['n_embd']} (ff {c['n_ff']}, {c['n_head']} "
          f"heads, {c['n_head_kv']} KV heads), {c['layer_parameters'] / 1e9:.2f}B layer + "
          f"{c['outer_parameters'] / 1e6:.1f}M outer parameters; num_ctx {c['num_ctx']}, prompt "
          f"{c['prompt_tokens']}, decode {c['decode_tokens']} tokens, batch 1")
    bw = result["bandwidth"]
    print(f"pebbling backend {c['backend']}; restore bandwidth {bw['h2d_restore_GBps']} GB/s measured "
          f"({bw['path']}, {bw['entry_bytes'] >> 20} MiB entries)")
    print(result["budget_definition"])
    print(f"\n{'pebbling':<20}{'resident':>9}{'same':>6}{'budget':>9}{'peak':>9}{'est.':>9}{'ratio':>7}"
          f"{'dec tok/s':>10}{'pre tok/s':>10}{'MiB/tok':>9}{'bound ms':>9}{'effic.':>7}")
    for r in result["pebbling"]:
        same = "-" if r["tokens_equal_none"] is None else ("yes" if r["tokens_equal_none"] else "NO")
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        print(f"{r['label']:<8}{r['strategy']:<12}{r['resident_layers']:>5}/{r['n_layers']:<3}{same:>6}"
              f"{mib(r['budget_bytes']):>9}{mib(r['measured_peak_bytes']):>9}{mib(r['estimated_peak_bytes']):>9}"
              f"{r['peak_over_estimate']:>7.3f}{r['decode_tokens_per_s']:>10.2f}{r['prefill_tokens_per_s']:>10.1f}"
              f"{mib(r['bytes_restored_per_token']):>9}{r['transfer_bound_ms']:>9.1f}{eff:>7}"
              + (f"  ({r['note']})" if r["note"] else ""))
    print(f"(MiB; peak: {result['pebbling'][0]['measured_how']})")
    print(f"\ntransformers {result['versions']}")
    print(f"{'row':<10}{'on GPU':>8}{'torch peak':>11}{'dec tok/s':>10}{'pre tok/s':>10}  agreement with "
          f"pebbling's {result['transformers_compared_with']}")
    for r in result["transformers"]:
        on_gpu = "-" if "layers_on_gpu" not in r else f"{r['layers_on_gpu']}/{c['n_layer']}"
        if r["tokens_equal_pebbling"] is None:
            agree = "-"
        elif r["tokens_equal_pebbling"]:
            agree = f"all {len(r['tokens'])} tokens equal"
        else:
            margin = r["margin_at_divergence"]
            agree = f"first differs at step {r['first_divergence_step']}" + (
                "" if margin is None else f" (its top-2 logit margin there: {margin:.4f})")
        print(f"{r['label']:<10}{on_gpu:>8}{mib(r.get('torch_allocator_peak_bytes')):>11}"
              f"{r['decode_tokens_per_s']:>10.2f}{r['prefill_tokens_per_s']:>10.1f}  {agree}")
    print("(torch peak: torch.cuda.max_memory_allocated, the torch allocator peak, MiB; on GPU: decoder "
          "layers accelerate kept on the device)")
    print("\nacceptance (issue 6)")
    for a in result["acceptance"]:
        print(f"  {a['verdict']:<5} {a['check']}: {a['value']} (goal {a['goal']})"
              + (f"  [{a['note']}]" if a["note"] else ""))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees one")
    parser.add_argument("--backend", choices=("cuda", "host", "stub"),
                        help="pebbling's store; default cuda on the GPU, host (else stub) on the CPU")
    parser.add_argument("--n-layer", type=int, default=32)
    parser.add_argument("--n-embd", type=int, default=4096)
    parser.add_argument("--n-ff", type=int, default=14336)
    parser.add_argument("--n-head", type=int, default=32)
    parser.add_argument("--n-head-kv", type=int, default=8)
    parser.add_argument("--num-ctx", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="greedy steps timed (16 keeps the 8B run inside a 10-minute GPU job)")
    parser.add_argument("--fractions", default="1,0.5,0.25", help="budgets, as fractions of the weights")
    parser.add_argument("--dir", help="where the GGUF is written and deleted (default /dev/shm when it has room)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", help="write every figure here (also after each row, so a cut run leaves some)")
    args = parser.parse_args(argv)
    if args.prompt_tokens + args.decode_tokens > args.num_ctx:
        parser.error(f"--prompt-tokens + --decode-tokens ({args.prompt_tokens + args.decode_tokens}) "
                     f"exceed --num-ctx ({args.num_ctx})")
    torch, transformers, accelerate = import_hf()  # fail early, before minutes of model building
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.backend or ("cuda" if args.device == "cuda" else ("host" if probe("host").usable else "stub"))
    fractions = [float(f) for f in args.fractions.split(",")]

    started = time.perf_counter()
    model = build_model(args)
    layer_params, outer_params = parameter_count(model)
    pebbled = PebbledModel(model, backend=backend)
    setup_s = time.perf_counter() - started
    print(f"model built and saved to the host tier in {setup_s:.0f} s", flush=True)

    options = Options(temperature=0, repeat_penalty=1.0, num_predict=args.decode_tokens, num_ctx=args.num_ctx,
                      num_batch=args.prompt_tokens)  # the prompt in one chunk, as transformers prefills it
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.n_vocab, args.prompt_tokens)]
    # Warm-up before the budgets are set: the kernels and library handles a request loads count in the
    # backend's measured overhead, so budgets taken earlier would fall short of `none` at "100%".
    run_pebbling(pebbled, dataclasses.replace(options, num_predict=2), prompt, "minimal")
    memory = pebbled.memory_model(options, len(prompt))
    entry_mib = max(1, max(memory.layer_weight_bytes) >> 20)
    bandwidth = measure_bandwidth(pebbled.backend, entry_mib, repeats=10)
    cases = pebbling_cases(pebbled, memory, fractions)

    result = {
        "config": {**{k: getattr(args, k) for k in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv",
                                                    "num_ctx", "prompt_tokens", "decode_tokens", "device", "seed")},
                   "backend": pebbled.backend.name, "n_vocab": model.config.n_vocab, "weight_type": "F16",
                   "layer_parameters": layer_params, "outer_parameters": outer_params,
                   "layer_weight_bytes_on_device": sum(memory.layer_weight_bytes), "setup_s": round(setup_s, 1)},
        "versions": f"{transformers.__version__}, accelerate {accelerate.__version__}, torch {torch.__version__}",
        "budget_definition": BUDGET_DEFINITION,
        "bandwidth": bandwidth, "pebbling": [], "transformers": [], "acceptance": [],
    }

    def save(key: str):
        def on_row(rows: list[dict]) -> None:
            result[key] = rows
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
        return on_row

    h2d = bandwidth["h2d_restore_GBps"] * 1e9
    result["pebbling"] = pebbling_rows(pebbled, options, prompt, cases, h2d, save("pebbling"))
    # transformers' tokens are compared with none's, else (none did not fit) with the first row's.
    compared = next((r for r in result["pebbling"] if r["label"] == "none"), result["pebbling"][0])
    result["transformers_compared_with"], reference = compared["label"], compared["tokens"]
    # Give the device back to transformers: pebbling's store, its working slots and CuPy's pools.
    pebbled.close()
    model._converted.clear()
    pebbled.backend.free_pool()
    if pebbled.backend.measures_memory:  # CuPy's pinned pool too
        pebbled.xp.get_default_pinned_memory_pool().free_all_blocks()
    del pebbled
    gc.collect()

    result["transformers"] = hf_rows(model, prompt, args, cases, reference, save("transformers"))
    result["acceptance"] = acceptance(result["pebbling"], result["transformers"], args.device)
    result["config"]["total_s"] = round(time.perf_counter() - started, 1)
    save("acceptance")(result["acceptance"])
    print_tables(result)
    return result
