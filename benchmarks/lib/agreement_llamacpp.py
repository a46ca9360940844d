"""Does pebbling's GGUF runtime compute what llama.cpp computes? A check against real llama.cpp.

    python benchmarks/agreement.py llamacpp [--only llama,qwen2] [--types F32,Q4_K] [--json FILE]

For each architecture (llama, qwen2, phi3, qwen3, gemma3, gemma2) and tensor type (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4), llama-quantize's
Q3_K_M, Q2_K and IQ4_XS mixes for llama, qwen2, qwen3 and gemma3 (and its MXFP4_MOE for the mixtures of
experts), plus a few layout variants (a Q4_K_M-like mix, tied
output, llama3 rope_freqs, linear RoPE scaling, partial RoPE, MHA, a head size apart from n_embd /
n_head as Mistral-Nemo's, gemma3's global layers every third with their own RoPE base and linear
scaling), it writes a small random-weight GGUF with pyplugin.model.synth, loads it in llama.cpp
(through the llama-cpp-python bindings, KV cache in F32) and in pebbling (pyplugin.model +
pyplugin.loop), feeds both the same token ids and compares:

  logits   the last prompt position's logits: max |diff|, relative error ||diff|| / ||llama.cpp||,
           argmax equal;
  greedy   16 greedy tokens (llama.cpp's own greedy sampler vs pebbling's Sampler at temperature 0),
           with the logits of every decode step compared too; where the sequences part, the top-2
           margin of llama.cpp's logits at that step says whether it is a near-tie;
  control  for every type but F32, llama.cpp is also run on an F32 copy of the file holding the
           weights as pebbling dequantizes them. llama.cpp(quantized) vs llama.cpp(F32 copy) is the
           "floor": llama.cpp's own rounding of activations (it quantizes them to Q8_0 / Q8_K, or
           rounds them to F16 / BF16, before its matmuls), which a dequantization unlike ggml's would
           inflate. pebbling vs llama.cpp(F32 copy) must agree to float32 precision (<= 1e-4).

Mixtures of experts (qwen3moe, qwen2moe with its shared expert, Mixtral-style llama files with experts)
run in every type and a Q4_K_M-like mix. Their top-k routing is discrete: llama.cpp's own activation
rounding (the floor) moves a token to another expert where two score alike, and the logits then part by
more than a rounding tolerance. Such a case is judged against llama.cpp on the F32 copy of the same
values instead, at every decode step (greedy tokens equal, logits within 1e-4), and says so.

The new architectures' own parts are all in play: qwen3's Q/K norms and head size of its own (128 on a
64-wide split), the Gemmas' scaled embedding, sandwich norms, GELU gate and sliding window (8 positions,
so the 28 positions compared cross its edge), gemma2's soft-capping (caps low enough to bend the scores).

and, for each vocabulary flavour synth writes (llama3, chatml and qwen3 byte-level BPE, spm, spm in a
file whose general.name says phi3, which turns on llama.cpp's Phi-3 token attributes, and Gemma's
SentencePiece without a leading space, with byte fallback), the token ids
of a few strings (ASCII, whitespace, multi-byte, special tokens) from llama.cpp's tokenizer
(special=True) and from pebbling's. llama.cpp adds a second BOS to a text that starts with one, and
pebbling by design does not: that is shown, not counted.

qwen2 with partial RoPE is left out: llama.cpp aborts on it (GGML_ASSERT n_rot).
llama.cpp runs in a forked child per file, so such an abort is reported rather than fatal.

Exit status: 0 when every case agrees, 1 when one does not (or llama.cpp refuses a file), 2 when
llama-cpp-python is missing. It is NOT a dependency of pebbling; install it in its own environment
(it compiles llama.cpp: about 20 minutes on 2 cores):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    /tmp/llamacpp-venv/bin/pip install -e .
    /tmp/llamacpp-venv/bin/python benchmarks/agreement.py llamacpp
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from pyplugin.kv_types import KV_TYPES
from pyplugin.model import synth, transformer
from pyplugin.runtime import Generation
from pyplugin.model import load_model
from pyplugin.model.gguf_file import dequantize_bytes
from pyplugin.runtime.options import Options
from pyplugin.xp import to_numpy
from pyplugin.model.synth import SynthSpec, write_gguf
from pyplugin.model.synth_mix import MIXES, quantize_mix

INSTALL_HELP = """\
`agreement.py llamacpp` needs the llama-cpp-python bindings (llama.cpp itself), which pebbling does not
depend on. Install them in a separate virtual environment, with pebbling beside them:

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    /tmp/llamacpp-venv/bin/pip install -e .
    /tmp/llamacpp-venv/bin/python benchmarks/agreement.py llamacpp
"""

ARCHS = ("llama", "qwen2", "phi3", "qwen3", "gemma3", "gemma2", "gemma4")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4")
# llama-quantize's mixes (pyplugin.model.synth_mix): written for these architectures where the types asked
# include the mix's main type (MXFP4_MOE: for the mixtures of experts, its experts MXFP4 and the rest Q8_0).
MIX_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB_OF = {"llama": "llama3", "qwen2": "chatml", "phi3": "spm", "qwen3": "qwen3", "gemma3": "gemma",
            "gemma2": "gemma", "qwen3moe": "qwen3", "qwen2moe": "chatml", "gpt-oss": "chatml",
            "gemma4": "gemma4"}  # each arch's usual tokenizer
MOE_ARCHS = ("qwen3moe", "qwen2moe", "mixtral", "gpt-oss", "gemma4moe")  # each with a Q4_K_M-like mix
FILE_ARCH = {"mixtral": "llama", "gemma4moe": "gemma4"}  # a llama file with experts; Gemma 4's 26B-A4B layout
# What every file of an architecture carries beyond SHAPE: its own parts, exercised.
ARCH_SPEC = {"qwen3": {"key_length": 128}, "gemma3": {"sliding_window": 8, "rope_theta": 1e6},
             "gemma2": {"sliding_window": 8, "attn_softcap": 3.0, "final_softcap": 4.0},
             # experts: 8 of 2 (Mixtral), 16 of 4 with a shared expert (Qwen2-MoE), 16 of 4 normalised with
             # Q/K norms (Qwen3-MoE); expert FFNs narrower than the model's, as theirs are
             "qwen3moe": {"key_length": 128, "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256},
             "qwen2moe": {"n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256, "n_ff_shexp": 512},
             "mixtral": {"n_expert": 8, "n_expert_used": 2},
             # gpt-oss: 8 query heads of 64 over 2 KV heads (q wider than the model, as gpt-oss-20b's 64 x 64 over
             # 2880), 16 experts of 4, every other layer sliding over 8 positions (the 28 compared cross it), YaRN
             # x32 of 16 positions on its base of 150000; sinks and biases written by synth
             "gpt-oss": {"n_head": 8, "key_length": 64, "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256,
                         "sliding_window": 8, "rope_yarn": (32.0, 16), "rope_theta": 150000.0},
             # Gemma 4 as E2B lays it out: 4 sliding layers (head 64, window 8) then a full one (head 128, RoPE
             # turning a quarter of it), one KV head, the last 5 of 10 layers reading layers 3's and 4's caches
             # with FFNs twice as wide, per-layer embeddings of 256 (E2B's own width)
             "gemma4": {"n_layer": 10, "n_head_kv": 1, "key_length": 128, "sliding_window": 8, "rope_theta": 1e6,
                        "swa_pattern": [i % 5 < 4 for i in range(10)],
                        "gemma4": {"head_dim_swa": 64, "shared_kv_layers": 5, "n_embd_per_layer": 256,
                                   "double_wide": True}},
             # ... as 26B-A4B: 5 sliding layers then a full one, 2 KV heads sliding and 1 full with V its keys'
             # projection, a dense FFN beside 16 experts of 4 (its 128 of 8)
             "gemma4moe": {"n_layer": 6, "key_length": 128, "sliding_window": 8, "rope_theta": 1e6,
                           "swa_pattern": [i % 6 < 5 for i in range(6)], "n_expert": 16, "n_expert_used": 4,
                           "n_ff_exp": 256, "gemma4": {"head_dim_swa": 64, "n_head_kv_full": 1, "k_eq_v": True}}}
SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_ctx=512)
N_PROMPT, N_GEN, N_CTX = 12, 16, 64

# Relative error ||pebbling - llama.cpp|| / ||llama.cpp|| of the logits that still counts as the same
# computation. llama.cpp rounds activations to the weight type's dot-product type (F16, BF16, Q8_0,
# Q8_K) before its matmuls; pebbling does not. A layout error gives ~0.5 or more.
# The low-bit types' products take x rounded as llama.cpp rounds it too (Q8_K for Q2_K, Q3_K and IQ4_XS,
# Q8_0 for IQ4_NL and MXFP4), so they are held to the same figure as the other quantized types.
TOLERANCE = {"F32": 1e-4, "F16": 1e-2, "BF16": 5e-2, "Q8_0": 5e-2, "Q4_0": 5e-2, "Q4_1": 5e-2, "Q5_0": 5e-2,
             "Q5_1": 5e-2, "Q2_K": 5e-2, "Q3_K": 5e-2, "Q4_K": 5e-2, "Q5_K": 5e-2, "Q6_K": 5e-2, "IQ4_NL": 5e-2,
             "IQ4_XS": 5e-2, "MXFP4": 5e-2}

# The KV cache type of both sides (--kv-type; llama.cpp's type_k and type_v, pebbling's kv_type): float32 by
# default, so that the forward passes are compared without a cache's rounding. llama.cpp keeps a quantized V
# cache only with flash attention, which it then uses (rounding q to Q8_0 for the scores); the tolerance
# grows by what the type's rounding of K and V can move the logits (fp16: 2^-11 of each value; a q8_0 step is
# 1/127 of its block's largest value, a q4_0 step 1/8 of it). Measured on these 4-layer random models: a
# q8_0 cache alone moves pebbling's logits 0.005-0.009 (relative) from f32, a q4_0 cache 0.08-0.15; the two
# programs part by up to about twice that (q8_0: 0.009-0.029; q4_0: 0.10-0.28), as a K value that earlier
# layers' rounding moves by 1e-2 lands across a rounding edge on one side and not the other, a whole step.
KV_TYPE = "f32"
KV_TOLERANCE = {"f32": 0.0, "f16": 2e-3, "q8_0": 3e-2, "q4_0": 3e-1}


@dataclass
class Case:
    name: str
    arch: str
    weight_type: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def tolerance(self) -> float:
        types = {self.weight_type, *self.overrides.get("tensor_types", {}).values()}
        return max(TOLERANCE[t] for t in types) + KV_TOLERANCE[KV_TYPE]


def cases(archs: tuple[str, ...], types: tuple[str, ...]) -> list[Case]:
    out = [Case(f"{a} {t}", a, t) for a in archs for t in types]
    extras = [
        Case("llama Q4_K_M-like mix", "llama", "Q4_K",
             {"tensor_types": {"output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K",
                               "token_embd": "Q4_K"}}),
        Case("llama F32 rope_freqs (llama3)", "llama", "F32", {"rope_freqs": True}),
        Case("llama F32 linear rope x4", "llama", "F32", {"rope_linear_factor": 4.0}),
        Case("llama F32 YaRN x8 of 32 positions", "llama", "F32", {"rope_yarn": (8.0, 32)}),
        Case("qwen2 F32 YaRN x4 of 32 positions", "qwen2", "F32", {"rope_yarn": (4.0, 32)}),
        Case("qwen3 Q8_0 YaRN x32 of 16 positions", "qwen3", "Q8_0", {"rope_yarn": (32.0, 16)}),
        Case("llama F32 theta 5e5 tied", "llama", "F32", {"rope_theta": 500000.0, "tied_output": True}),
        Case("qwen2 Q8_0 tied output", "qwen2", "Q8_0", {"tied_output": True}),
        Case("phi3 F32 partial rope 32/64", "phi3", "F32", {"rope_dims": 32}),
        Case("llama F32 MHA (n_head_kv 4)", "llama", "F32", {"n_head_kv": 4}),
        Case("llama F32 head 128 of 256/4 (Nemo)", "llama", "F32", {"key_length": 128}),
        Case("qwen3 Q8_0 tied, head 32", "qwen3", "Q8_0", {"tied_output": True, "key_length": 32}),
        Case("gemma3 F32 6 layers, global /3", "gemma3", "F32",
             {"n_layer": 6, "swa_pattern": 3, "rope_linear_factor": 8.0}),
        Case("gemma3 Q4_K head 256, MQA", "gemma3", "Q4_K", {"key_length": 256, "n_head_kv": 1}),
        Case("gemma2 F32 window 4, default caps", "gemma2", "F32",
             {"sliding_window": 4, "attn_softcap": None, "final_softcap": None}),
        Case("gemma4 F32 31B-like (V = K on full layers)", "gemma4", "F32",
             {"n_layer": 6, "swa_pattern": [i % 6 < 5 for i in range(6)], "n_head_kv": 2,
              "gemma4": {"head_dim_swa": 64, "n_head_kv_full": 1, "k_eq_v": True}}),
        Case("gemma4moe F32 experts split", "gemma4moe", "F32",
             {"gemma4": {"head_dim_swa": 64, "n_head_kv_full": 1, "k_eq_v": True, "merged_gate_up": False}}),
    ]
    out += [c for c in extras if c.arch in archs and c.weight_type in types]
    q4_k_m = {"tensor_types": {"output": "Q6_K", "attn_v": "Q6_K", "ffn_down_exps": "Q6_K", "ffn_down_shexp": "Q6_K",
                               "token_embd": "Q4_K"}}
    for arch in (a for a in MOE_ARCHS if a in archs):
        if "Q4_K" in types:
            out.append(Case(f"{arch} Q4_K_M-like mix", arch, "Q4_K", q4_k_m))
        if "MXFP4" in types and arch not in FILE_ARCH:
            out.append(mix_case(arch, "MXFP4_MOE"))
    for arch in (a for a in MIX_ARCHS if a in archs):
        out += [mix_case(arch, mix) for mix in ("Q3_K_M", "Q2_K", "IQ4_XS") if MIXES[mix] in types]
    return out


def mix_case(arch: str, mix: str) -> Case:
    """A file of `arch` in llama-quantize's `mix`, every matrix typed as synth_mix gives it."""
    spec = quantize_mix(SynthSpec(**{"arch": FILE_ARCH.get(arch, arch), **SHAPE, **ARCH_SPEC.get(arch, {})}), mix)
    return Case(f"{arch} {mix} mix", arch, spec.weight_type, {"tensor_types": spec.tensor_types})


# ---------------------------------------------------------------------------------------------------
# the two runtimes


def import_llama_cpp():
    try:
        import llama_cpp  # noqa: PLC0415 - optional, outside pebbling's dependencies
    except ImportError:
        sys.stderr.write(INSTALL_HELP)
        sys.exit(2)
    return llama_cpp


class LlamaFailed(Exception):
    """llama.cpp refused the file (an error) or aborted on it (a GGML_ASSERT kills its process)."""


def in_llama_process(job, path: Path, *args):
    """Run ``job(llama, *args)`` against the file in a forked child (in_fork)."""
    return in_fork(_child, path, job, *args)


def in_fork(child, path: Path, *args):
    """Run ``child(path, log, *args)``, which loads the file in llama.cpp, in a forked child: llama.cpp aborts
    the whole process on a configuration it does not support, which must not end this script. Its log goes
    to a file beside the model whose error lines become LlamaFailed's message."""
    log = path.with_suffix(".llama.log")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(child, path, log, *args).result()
        except BrokenProcessPool:
            raise LlamaFailed("aborted: " + _errors(log)) from None
        except Exception as exc:
            raise LlamaFailed(f"{type(exc).__name__}: {exc}: {_errors(log)}") from None


def _child(path: Path, log: Path, job, *args):
    llama_cpp = import_llama_cpp()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)                                 # llama.cpp's own log, for the error message
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                          n_threads=2, n_threads_batch=2, logits_all=True,
                          vocab_only=job is _tokenize_job, type_k=KV_TYPES[KV_TYPE].ggml_type,
                          type_v=KV_TYPES[KV_TYPE].ggml_type, flash_attn=KV_TYPES[KV_TYPE].quantized, seed=0,
                          verbose=True)
    return job(llm, *args)


def _errors(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    hits = [ln.strip() for ln in lines if any(w in ln for w in ("error", "GGML_ASSERT", "failed",
                                                                   "exception", "invalid"))]
    return " | ".join(dict.fromkeys(hits)) or (lines[-1] if lines else "(empty log)")


def _greedy_job(llm, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's greedy tokens and the logits each was chosen from (prompt's last first)."""
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(N_GEN):
        logits.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        token = int(llm.sample(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0))
        tokens.append(token)
        llm.eval([token])
    return tokens, logits


def _tokenize_job(llm, requests: list[tuple[str, bool]]) -> list[list[int]]:
    return [llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
            for text, add_bos in requests]


def run_pebbling(model, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """pebbling's greedy tokens (its Sampler at temperature 0) and their logits. End-of-generation
    tokens do not stop it, so that both sides produce N_GEN tokens."""
    options = Options(temperature=0.0, repeat_penalty=1.0, top_k=0, top_p=1.0, seed=0,
                      num_ctx=N_CTX, num_predict=N_GEN, kv_type=KV_TYPE)
    gen = Generation(model, options)
    history = list(prompt)
    logits = gen.prefill(prompt)
    tokens, all_logits = [], []
    for _ in range(N_GEN):
        all_logits.append(np.array(logits, dtype=np.float32))
        token = gen.sample(logits, history)
        tokens.append(token)
        history.append(token)
        logits = gen.decode_one(token)
    return tokens, all_logits


# ---------------------------------------------------------------------------------------------------
# one model case


def compare_case(case: Case, workdir: Path) -> dict[str, Any]:
    arch = FILE_ARCH.get(case.arch, case.arch)
    spec = dict(SHAPE, arch=arch, vocab=VOCAB_OF[arch], weight_type=case.weight_type, seed=7)
    spec.update(ARCH_SPEC.get(case.arch, {}))
    spec.update(case.overrides)
    path = workdir / (case.name.replace(" ", "_").replace("/", "-") + ".gguf")
    write_gguf(path, **spec)
    row: dict[str, Any] = {"case": case.name, "tolerance": case.tolerance}
    model = load_model(path, weights="f16", progress=False)
    n_normal = sum(1 for t in model.tokenizer.types if t == 1)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    prompt = [int(t) for t in rng.integers(0, n_normal, N_PROMPT)]
    try:
        l_tokens, l_logits = in_llama_process(_greedy_job, path, prompt)
    except LlamaFailed as exc:  # llama.cpp cannot run the file: reported, pebbling not judged
        row.update(status="llama.cpp refused", detail=str(exc))
        return row
    p_tokens, p_logits = run_pebbling(model, prompt)
    judged = p_logits
    if model.config.activation == "gelu":
        # ggml's CPU GELU reads a table indexed by the input rounded to fp16 and returns fp16: llama.cpp's
        # own rounding, like its activation quantization. pebbling computes GELU in float32; run with a
        # GELU rounded as ggml's, it must agree as closely as any F32 case, and the difference between
        # the two pebbling runs is this floor, shown.
        with gelu_as_ggml():
            _, judged = run_pebbling(model, prompt)
        row["gelu_floor"] = max(rel_err(a, b) for a, b in zip(p_logits, judged))
    if case.weight_type != "F32" or case.overrides.get("tensor_types"):
        # Control: llama.cpp on an F32 file holding the weights as pebbling dequantizes them. Against
        # llama.cpp on the quantized file it measures llama.cpp's own activation rounding (and would
        # expose a dequantization that differs from ggml's); against pebbling, the forward pass alone.
        f32_path = path.with_name(path.stem + ".dequantized.gguf")
        with weights_as_dequantized_f32():
            write_gguf(f32_path, **spec)
        try:
            d_tokens, d_logits = in_llama_process(_greedy_job, f32_path, prompt)
        except LlamaFailed as exc:
            row.update(status="llama.cpp refused", detail=f"dequantized F32 copy: {exc}")
            return row
        row.update(llama_floor=rel_err(d_logits[0], l_logits[0]),
                   vs_dequantized=rel_err(judged[0], d_logits[0]))
        # every decode step against llama.cpp on the same (dequantized) values
        same = next((i for i, (a, b) in enumerate(zip(d_tokens, p_tokens)) if a != b), N_GEN - 1)
        row.update(dequantized_greedy_equal=d_tokens == p_tokens, dequantized_tokens=d_tokens,
                   vs_dequantized_max_abs=float(np.abs(judged[0] - d_logits[0]).max()),
                   vs_dequantized_decode=max(rel_err(judged[i], d_logits[i]) for i in range(same + 1)))
        if d_tokens != p_tokens:  # parting from the copy where the two score alike within their distance there
            L, P, a, b = d_logits[same], p_logits[same], d_tokens[same], p_tokens[same]
            row["dequantized_near_tie"] = bool(L[a] - L[b] + P[b] - P[a] <= 2 * np.abs(P - L).max())

    ref, got = l_logits[0], p_logits[0]
    row["judged_rel_err"] = rel_err(judged[0], ref)
    diff = np.abs(got - ref)
    row.update(
        max_abs=float(diff.max()), rel_err=rel_err(got, ref), logit_scale=float(np.abs(ref).max()),
        argmax_equal=bool(np.argmax(got) == np.argmax(ref)),
        llama_tokens=l_tokens, pebbling_tokens=p_tokens, greedy_equal=l_tokens == p_tokens)
    # Decode steps: comparable while both sides saw the same tokens (up to the first divergence).
    first = next((i for i, (a, b) in enumerate(zip(l_tokens, p_tokens)) if a != b), None)
    steps = range(N_GEN if first is None else first + 1)
    row["decode_rel_err"] = max(rel_err(p_logits[i], l_logits[i]) for i in steps)
    row["judged_decode_rel_err"] = max(rel_err(judged[i], l_logits[i]) for i in steps)
    if first is not None:
        L, P = l_logits[first], p_logits[first]
        a, b = l_tokens[first], p_tokens[first]
        row.update(diverge_at=first, llama_margin=float(L[a] - L[b]), pebbling_margin=float(P[b] - P[a]),
                   step_max_abs=float(np.abs(P - L).max()))
    # Where ggml rounds GELU to fp16, two float32 runs that differ in the last bits round some elements
    # to neighbouring fp16 values: the run with ggml's rounding agrees with llama.cpp to within that
    # rounding (twice the measured floor, as both sides round), not to float32 precision.
    tol = max(case.tolerance, 2 * row.get("gelu_floor", 0.0))
    # Against llama.cpp on the same values in F32, only the KV cache's rounding is left (the F32 cases' own).
    tol_f32 = max(TOLERANCE["F32"] + KV_TOLERANCE[KV_TYPE], 2 * row.get("gelu_floor", 0.0))
    row["judged_tolerance"] = tol
    ok_logits = (row["judged_rel_err"] <= tol and row["judged_decode_rel_err"] <= tol
                 and row.get("vs_dequantized", 0.0) <= tol_f32
                 and row.get("llama_floor", 0.0) <= case.tolerance)
    # A greedy divergence is a near-tie when the logits still agree within tolerance at that step:
    # then llama_margin + pebbling_margin <= 2 * step_max_abs by construction.
    # A mixture of experts routes by a discrete top-k: llama.cpp's own activation rounding (its floor) moves
    # a token to another expert where two score alike, and the logits part by more than any tolerance of
    # rounding. pebbling is then judged against llama.cpp on the F32 copy of the same values, every step.
    # Gemma 4's dense files too: over ten layers and their per-layer embeddings llama.cpp's own rounding of the
    # activations moves it past the type's tolerance from its F32 copy (its floor, 5e-2 to 8e-2 here); pebbling is
    # then judged against that copy at every step, as the experts are, tie-tolerantly where the two part.
    same_values = row.get("vs_dequantized_decode", 1.0) <= tol_f32 and row.get("vs_dequantized", 1.0) <= tol_f32
    if not ok_logits and same_values and row.get("dequantized_greedy_equal") and case.arch in MOE_ARCHS:
        row["status"] = "ok (experts moved by llama.cpp's rounding; equal to it on the dequantized weights)"
    elif not ok_logits and same_values and case.arch == "gemma4" and (row.get("dequantized_greedy_equal")
                                                                       or row.get("dequantized_near_tie")):
        row["status"] = (f"ok (llama.cpp's own rounding {row['llama_floor']:.1e} from its F32 copy; equal to it on the "
                         "dequantized weights" + (")" if row["dequantized_greedy_equal"] else ", to a near-tie)"))
    elif not ok_logits:
        row["status"] = "DISAGREE"
    elif first is None:
        row["status"] = "ok"
    else:
        row["status"] = "ok (near-tie)"
    return row


@contextmanager
def weights_as_dequantized_f32():
    """Make write_gguf store every tensor as F32, holding the values its type would dequantize to
    (quantized by synth, dequantized by pebbling's own reader). A file of random blocks (random_blocks=True):
    each matrix is written as F32 when it is made, its blocks made as the quantized file's are, then dequantized."""
    original, blocks = synth._tensors, synth.random_blocks

    def tensors(spec, n_vocab, lazy=False):
        for name, array, qtype in original(spec, n_vocab, lazy):
            if lazy:  # random blocks: arrays are written as F32 as they are; (shape, scale) made below
                array = array if isinstance(array, np.ndarray) else (array[0], (array[1], qtype))
            elif qtype != GGMLQuantizationType.F32:
                rows = array.reshape(-1, array.shape[-1])  # merged experts: a stack of matrices
                raw = np.ascontiguousarray(synth.quantize(rows, qtype)).view(np.uint8).reshape(-1)
                array = dequantize_bytes(raw, qtype, array.shape)
            yield name, array, GGMLQuantizationType.F32

    def dequantized_blocks(qtype, rows, cols, rng, scale_and_type):
        scale, qtype = scale_and_type
        return dequantize_bytes(blocks(qtype, rows, cols, rng, scale).reshape(-1), qtype, (rows, cols))

    synth._tensors, synth.random_blocks = tensors, dequantized_blocks
    try:
        yield
    finally:
        synth._tensors, synth.random_blocks = original, blocks


@contextmanager
def gelu_as_ggml():
    """pebbling's GELU with its input and output rounded to fp16, as ggml's table-driven CPU GELU has them. The
    native decode step computes its own GELU, so meanwhile a decode step runs through the forward pass (the same
    math, tested so: tests/test_decode_step.py), where the rounded GELU is the one computed."""
    original, decode_one = transformer.gelu_tanh, Generation.decode_one

    def gelu(x):
        y = original(x.astype(np.float16).astype(np.float32))   # numpy or CuPy, as the backend has it
        return y.astype(np.float16).astype(x.dtype)

    def through_layers(gen, token):
        return to_numpy(transformer.output_logits(gen.cfg, gen.outer, gen._through_layers([token])[-1]))

    transformer.gelu_tanh, Generation.decode_one = gelu, through_layers
    try:
        yield
    finally:
        transformer.gelu_tanh, Generation.decode_one = original, decode_one


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------------------------------------------
# tokenizers

TEXTS = {
    "ascii": "Hello world! How are you today? The quick brown fox jumps over the lazy dog.",
    "spaces": "  two leading spaces,\ttabs\tand\n\nnewlines  \n",
    "numbers": "Prices like $42.50, 12345678 and dates like 2024-05-17.",
    "contractions": "It's a game: we don't, they'll, I'M, YOU'RE.",
    "multibyte": "héllo wörld 日本語 🙂",
    "cyrillic+cjk": "Привет, мир! 日本語のテキスト。Café naïve façade",
    "empty": "",
}
SPECIAL_TEXTS = {
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>"
              "assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
              "<|im_start|>assistant\n",
    "spm": "<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "qwen3": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello",
    "gemma": "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "harmony": "<|start|>user<|message|>Hi there<|end|><|start|>assistant<|channel|>analysis<|message|>Hmm. "
               "CamelCase and ALLCAPS words, ÉCOLE école<|end|>",
    "gemma4": "<|turn>user\nHi  there\n\n\nyou<turn|>\n<|turn>model\n<|channel>thought\nHmm<channel|>Hello 🙂",
}


# flavour -> (arch, vocab): the arch only sets general.name, which llama.cpp reads for phi-3 quirks.
TOKENIZER_FLAVOURS = {"llama3": ("llama", "llama3"), "chatml": ("qwen2", "chatml"),
                      "spm": ("llama", "spm"), "spm phi3": ("phi3", "spm"), "qwen3": ("qwen3", "qwen3"),
                      "gemma": ("gemma3", "gemma"), "harmony": ("gpt-oss", "harmony"), "gemma4": ("gemma4", "gemma4")}


def compare_tokenizers(workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for flavour, (arch, vocab) in TOKENIZER_FLAVOURS.items():
        path = workdir / f"vocab_{flavour.replace(' ', '_')}.gguf"
        write_gguf(path, **{"arch": arch, "vocab": vocab, "n_layer": 1, "n_embd": 64, "n_head": 2, "n_head_kv": 2,
                            "n_ff": 64, **ARCH_SPEC.get(arch, {})})
        tok = load_model(path, progress=False).tokenizer
        texts = dict(TEXTS, special=SPECIAL_TEXTS[vocab])
        texts["bos-prefixed"] = tok.bos_token + "Hi there"   # a rendered chat template often starts so
        if vocab == "gemma":  # no leading space; characters outside the pieces fall back to bytes
            texts["gemma no prefix"] = "Hello world"
            texts["byte fallback"] = "Zebra ¿qué? ∑ 𝔘 ☃"
        if vocab == "spm":
            texts["spm specials"] = "<s> a <unk> b </s> c"
            # Phi-3's whitespace stripping after special tokens: C whitespace only (not U+00A0 or
            # U+3000), however much; none after <s>, <unk>, <|endoftext|>; whitespace-only gaps.
            texts["strip edges"] = ("<|user|> \t\n\v\f\r Hi<|end|>\u00a0x<|assistant|>\u3000y</s>  z"
                                    "<s>\n w<|endoftext|>\n v<unk> \n u<|end|>\n\n<|end|> <|system|>\n")
        requests = [(text, add_bos) for text in texts.values() for add_bos in (False, True)]
        try:
            refs = in_llama_process(_tokenize_job, path, requests)
        except LlamaFailed as exc:
            rows.append({"flavour": flavour, "text": "(all)", "add_bos": None, "equal": False,
                         "llama": str(exc), "pebbling": None})
            continue
        labels = [label for label in texts for _ in (False, True)]
        for label, (text, add_bos), ref in zip(labels, requests, refs):
            # llama.cpp's add_bos is "add the model's special tokens": a BOS only when the vocab asks
            # for one (tokenizer.ggml.add_bos_token), which is pebbling's add_bos=None.
            got = tok.encode(text, add_bos=None if add_bos else False)
            row = {"flavour": flavour, "text": label, "add_bos": add_bos, "equal": ref == got,
                   "llama": ref, "pebbling": got,
                   "llama_pieces": [tok.token_text(i) for i in ref],
                   "pebbling_pieces": [tok.token_text(i) for i in got]}
            # llama.cpp adds the BOS even when the text already starts with one (and warns);
            # pebbling's Tokenizer.encode does not, by design. Reported, not counted.
            if not row["equal"] and add_bos and ref[:2] == [tok.bos_id] * 2 and ref[1:] == got:
                row["note"] = "double BOS: llama.cpp adds one more, pebbling does not (by design)"
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# report


def print_model_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'case':32} {'max|diff|':>10} {'rel err':>9} {'dec rel':>9} {'floor':>9} {'vs deq':>9} {'gelu fl':>9} "
            f"{'judged':>9} "
            f"{'tol':>7} {'argmax':>6} {'greedy16':>8} {'div@':>4} {'margin':>8}  status")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "max_abs" not in r:
            print(f"{r['case']:32} {r['status']}: {r['detail']}")
            continue
        div = "" if r.get("diverge_at") is None else str(r["diverge_at"])
        margin = "" if r.get("diverge_at") is None else f"{r['llama_margin']:.2e}"
        floor = f"{r['llama_floor']:9.2e}" if "llama_floor" in r else f"{'-':>9}"
        deq = f"{r['vs_dequantized']:9.2e}" if "vs_dequantized" in r else f"{'-':>9}"
        gelu = f"{r['gelu_floor']:9.2e}" if "gelu_floor" in r else f"{'-':>9}"
        judged = max(r["judged_rel_err"], r["judged_decode_rel_err"])
        print(f"{r['case']:32} {r['max_abs']:10.2e} {r['rel_err']:9.2e} {r['decode_rel_err']:9.2e} "
              f"{floor} {deq} {gelu} {judged:9.2e} {r.get('judged_tolerance', r['tolerance']):7.0e} "
              f"{'yes' if r['argmax_equal'] else 'NO':>6} "
              f"{'yes' if r['greedy_equal'] else 'no':>8} {div:>4} {margin:>8}  {r['status']}")
    print("\nmax|diff|, rel err: last prompt position's logits (rel err = ||pebbling - llama.cpp|| / "
          "||llama.cpp||);\ndec rel: worst rel err over the decode steps both sides saw the same "
          "tokens; div@: first greedy step\nthat differs; margin: llama.cpp's logit gap between its "
          "token and pebbling's there.\nfloor: llama.cpp on the quantized file vs llama.cpp on an F32 "
          "copy of the same dequantized weights\n(its own activation rounding); vs deq: pebbling vs "
          "llama.cpp on that F32 copy (must be <= 1e-4).\ngelu fl: the Gemmas' GELU floor, pebbling's float32 GELU "
          "vs the same with ggml's fp16 rounding of it;\njudged: the worst rel err of the run the tolerance "
          "judges (with ggml's GELU rounding where there is a GELU);\ntol: the type's tolerance, or twice the "
          "GELU floor where that is larger.")


def print_tokenizer_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'flavour':8} {'text':14} {'bos':>5} {'equal':>6}  detail")
    for r in rows:
        detail = ""
        if not r["equal"]:
            detail = r.get("note") or (f"llama.cpp {r.get('llama_pieces', r['llama'])}\n{'':38}"
                                       f"pebbling  {r.get('pebbling_pieces', r['pebbling'])}")
        print(f"{r['flavour']:8} {r['text']:14} {str(r['add_bos']):>5} "
              f"{'yes' if r['equal'] else 'NO':>6}  {detail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(ARCHS + MOE_ARCHS), help="architectures, comma-separated "
                    "(mixtral: a llama file with experts)")
    ap.add_argument("--types", default=",".join(TYPES), help="tensor types, comma-separated")
    ap.add_argument("--no-tokenizers", action="store_true", help="skip the tokenizer comparison")
    ap.add_argument("--kv-type", default="f32", choices=list(KV_TYPES),
                    help="KV cache type of both sides (default f32: the forward passes alone)")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    global KV_TYPE
    KV_TYPE = args.kv_type
    llama_cpp = import_llama_cpp()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort in a child: one line, not a gdb dump
    version = getattr(llama_cpp, "__version__", "?")
    print(f"llama-cpp-python {version}; {N_PROMPT}-token prompt, {N_GEN} greedy tokens, "
          f"{SHAPE['n_layer']} layers of {SHAPE['n_embd']}, {SHAPE['n_head']} heads / "
          f"{SHAPE['n_head_kv']} KV heads, n_ff {SHAPE['n_ff']}, KV cache {KV_TYPE}\n")
    archs, types = tuple(args.only.split(",")), tuple(args.types.split(","))
    with tempfile.TemporaryDirectory(prefix="pebbling-vs-llamacpp-") as tmp:
        workdir = Path(tmp)
        model_rows = []
        for case in cases(archs, types):
            model_rows.append(compare_case(case, workdir))
            print(f"  {case.name}: {model_rows[-1]['status']}", file=sys.stderr, flush=True)
        print_model_table(model_rows)
        tok_rows = [] if args.no_tokenizers else compare_tokenizers(workdir)
        if tok_rows:
            print_tokenizer_table(tok_rows)
    bad_models = [r["case"] for r in model_rows if r["status"] == "DISAGREE"]
    refused = [r["case"] for r in model_rows if r["status"] == "llama.cpp refused"]
    bad_tokens = [f"{r['flavour']}/{r['text']}/bos={r['add_bos']}" for r in tok_rows
                  if not r["equal"] and "note" not in r]
    if args.json:
        Path(args.json).write_text(json.dumps({"llama_cpp_python": version, "models": model_rows,
                                               "tokenizers": tok_rows}, indent=1))
    print(f"\nmodels: {len(model_rows) - len(bad_models) - len(refused)} agree, "
          f"{len(bad_models)} disagree, {len(refused)} refused by llama.cpp; tokenizer cases: "
          f"{len(tok_rows) - len(bad_tokens)} agree, {len(bad_tokens)} disagree")
    for name in bad_models + bad_tokens:
        print(f"  DISAGREE: {name}")
    return 1 if bad_models or bad_tokens or refused else 0
