"""`speed.py gpu`'s peers, each measured in the same run at the same budgets, or recorded as absent:

- transformers + accelerate: a LlamaForCausalLM of the same shape with random F16 weights (on the CPU,
  float32), fully on the GPU when it fits and with accelerate's offload at max_memory[0] = each budget
  (the device map from_pretrained(device_map="auto", max_memory=...) makes: agreement_transformers.hf_offload);
- llama.cpp (llama-cpp-python, where it imports): the Q4_K_M file fully offloaded and with n_gpu_layers
  set to the layers pebbling keeps resident at each budget (an estimate of what fits; labelled so).
Neither is a pebbling dependency. Device memory is NVML's, sampled every 2 ms (PeakSampler).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from lib.agreement_transformers import hf_greedy, hf_model_from, hf_offload, release
from pyplugin.store import gpu


class PeakSampler:
    """The most device memory `read()` (a DeviceUse, or None where nothing is measured) gave, sampled every
    2 ms on a thread while the block runs."""

    def __init__(self, read=gpu.used_device_memory, measured: bool = True, what: str = "this process") -> None:
        self.read, self.measured, self.what = read, measured, what
        self.peak, self.how, self._stop = None, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakSampler":
        if self.measured:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            use = self.read()
            if use is not None:
                self.peak, self.how = max(self.peak or 0, use.bytes), f"sampled every 2 ms: {use.how}"
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.how is None:
            self.how = f"not measured: no device memory NVML sees for {self.what}"


def _prompt(args) -> list[int]:
    return [int(x) for x in np.random.default_rng(args.seed).integers(0, 600, args.prompt)]


def random_llama(spec, args, torch, transformers, accelerate, dtype):
    """LlamaConfig of the shape and a state dict of random host tensors for it (a pool of random values
    copied into each, so 8B parameters take seconds: what is timed is the arithmetic, not the values)."""
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.n_embd, intermediate_size=spec.n_ff,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.n_head_kv,
        head_dim=spec.head_dim, max_position_embeddings=args.num_ctx, rms_norm_eps=spec.rms_eps,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    with accelerate.init_empty_weights():
        shapes = {name: p.shape for name, p in transformers.LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(args.seed)
    pool = (torch.randn(1 << 24, generator=gen) * spec.n_embd ** -0.5).to(dtype)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype)
            continue
        flat = torch.empty(int(np.prod(shape)), dtype=dtype)
        for i in range(0, flat.numel(), pool.numel()):
            n = min(pool.numel(), flat.numel() - i)
            flat[i:i + n] = pool[:n]
        state[name] = flat.view(shape)
    return config, state


def transformers_rows(spec, cases: list[dict], args, on_gpu: bool) -> dict:
    try:
        import accelerate
        import torch
        import transformers
    except ImportError as exc:
        return {"present": False, "why": f"torch, transformers or accelerate does not import: {exc}"}
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    config, state = random_llama(spec, args, torch, transformers, accelerate, dtype)
    out = {"present": True, "versions": f"transformers {transformers.__version__}, accelerate "
           f"{accelerate.__version__}, torch {torch.__version__}", "device": device, "dtype": str(dtype),
           "weights": "random (a pool of normal values, copied)", "build_s": round(time.perf_counter() - started, 1),
           "rows": []}
    prompt, n_decode = _prompt(args), args.peer_tokens
    targets = [("full", None)] + [(c["label"], c["budget"]) for c in cases if c["label"].endswith("%")]
    for label, budget in targets:
        if budget is not None and device != "cuda":
            continue  # accelerate offloads from a GPU
        hf = hf_model_from(config, state, transformers, accelerate)
        try:
            if budget is None:
                hf, how, on = hf.to(device), f"fully on the {device}", spec.n_layer
            else:
                _, on = hf_offload(hf, budget, accelerate)
                how = f"accelerate offload, max_memory[0] = {budget} B"
            hf_greedy(hf, prompt, min(2, n_decode), device, torch)   # warm-up, the timed run's shapes
            with PeakSampler(measured=device == "cuda", what="transformers") as sampler:
                got = hf_greedy(hf, prompt, n_decode, device, torch)
            out["rows"].append({"label": label, "how": how, "budget_bytes": budget, "layers_on_gpu": on,
                                "decode_tokens_per_s": round(got["decode_tokens_per_s"], 3),
                                "prefill_tokens_per_s": round(got["prefill_tokens_per_s"], 2),
                                "decode_tokens": n_decode, "nvml_peak_bytes": sampler.peak,
                                "nvml_peak_how": sampler.how})
        except Exception as exc:  # noqa: BLE001 - out of memory at a budget, say: a finding, recorded
            out["rows"].append({"label": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                                "decode_tokens_per_s": None, "prefill_tokens_per_s": None})
        del hf
        release(torch)
    return out


def llama_cpp_greedy(llm, prompt: list[int], n_decode: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, the tokens) of `prompt` then n_decode greedy tokens on a llama_cpp.Llama."""
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    t = time.perf_counter()
    llm.eval(prompt)
    token, tokens = argmax(), []
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_decode):
        tokens.append(token)
        llm.eval([token])
        token = argmax()
    return prefill_s, time.perf_counter() - t, tokens


def llama_cpp_rows(q4: dict, args, on_gpu: bool) -> dict:
    try:
        import llama_cpp
    except ImportError as exc:
        return {"present": False, "why": f"llama_cpp does not import: {exc}"}
    prompt, n_decode = _prompt(args), args.peer_tokens
    resident = {r["label"]: r["resident_layers"] for r in q4["rows"] if r["batch"] == 1}
    targets = [("full", -1 if on_gpu else 0, "all layers offloaded" if on_gpu else "no GPU: on the CPU")]
    if on_gpu:
        targets += [(label, n, f"n_gpu_layers = {n}: pebbling's resident layers at {label} (est. fit)")
                    for label, n in resident.items() if label.endswith("%")]
    out = {"present": True, "version": getattr(llama_cpp, "__version__", "?"), "rows": []}
    for label, layers, how in targets:
        with PeakSampler(measured=on_gpu, what="llama.cpp") as sampler:
            t = time.perf_counter()
            llm = llama_cpp.Llama(model_path=str(q4["path"]), n_ctx=args.num_ctx, n_batch=args.prompt,
                                  n_ubatch=args.prompt, n_gpu_layers=layers, verbose=False)
            load_s = time.perf_counter() - t
            prefill_s, decode_s, _ = llama_cpp_greedy(llm, prompt, n_decode)
        out["rows"].append({"label": label, "how": how, "n_gpu_layers": layers, "load_s": round(load_s, 2),
                            "prefill_tokens_per_s": round(len(prompt) / prefill_s, 2),
                            "decode_tokens_per_s": round(n_decode / decode_s, 3),
                            "nvml_peak_bytes": sampler.peak, "nvml_peak_how": sampler.how})
        del llm
    return out
