"""gpt-oss beside Hugging Face transformers' float32 modelling code (GptOssForCausalLM), on the same weights.

    python benchmarks/agreement.py gpt-oss-transformers [--json FILE] [--n-layer 4]

A random-weight gpt-oss file (synth: 8 query heads of 64 over 2 KV heads on 256, 16 experts of 256 with 4
used, every other layer sliding over 8 positions, YaRN x32 of 16 positions on a base of 150000, sinks and
biases) is written in F32 and loaded by pebbling in its f16 form (float32 weights on the host). transformers'
GGUF reader does not map gpt-oss's sinks and experts, so the model is built from a GptOssConfig of the file's
hyperparameters and its state dict is filled by hand from the file's tensors: each layer's q/k/v/o weights
and biases, the sinks, the router's weight and bias, and the experts' gate and up interleaved back into
gate_up_proj (column 2j the gate's row j, 2j + 1 the up's; the converter split them) with their biases, down
transposed into down_proj. Eager attention, float32.

Compared: the logits of every position of a 28-token prompt (teacher-forced, so the sliding window's edge at
8 is crossed), and 16 greedy tokens from a 12-token prompt, tie-tolerantly (where transformers' top two logits
are within 1e-4 of each other either token is right: float32's own rounding over 4 layers).

YaRN: GGML rounds its correction range to whole dimensions (floor and ceil), which transformers does with
`truncate: true`; gpt-oss's own config says `truncate: false`. pebbling computes GGML's, so the match is judged
with truncate true, and the run with the model's own setting is shown beside it: that difference is
llama.cpp's and transformers', not pebbling's.

torch and transformers are not pebbling dependencies: install them beside it for this script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from lib.hf_compare import hf_greedy, hf_logits, pebbling_greedy, pebbling_logits, teacher_tokens, tie_tolerant
from pyplugin.model import load_model
from pyplugin.model.gguf_file import GGUFFile
from pyplugin.model.synth import write_gguf

SPEC = dict(arch="gpt-oss", vocab="harmony", n_layer=4, n_embd=256, n_head=8, n_head_kv=2, key_length=64,
            n_ff=256, n_ff_exp=256, n_expert=16, n_expert_used=4, sliding_window=8, rope_yarn=(32.0, 16),
            rope_theta=150000.0, n_ctx=256, weight_type="F32", seed=11)
N_PROMPT, N_TEACHER = 12, 28


def hf_model(path: Path, cfg, truncate: bool):
    """GptOssForCausalLM of the file's hyperparameters, its weights the file's (float32)."""
    import torch  # noqa: PLC0415 - optional
    from transformers import GptOssConfig, GptOssForCausalLM  # noqa: PLC0415

    factor, original = 1.0 / cfg.rope_freq_scale, cfg.rope_yarn[3]
    rope = {"rope_type": "yarn", "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": original, "rope_theta": cfg.rope_theta}
    config = GptOssConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff_exp, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
        num_local_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used, sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layer)],
        rope_theta=cfg.rope_theta, rope_scaling=rope, rope_parameters=rope, max_position_embeddings=cfg.n_ctx_train,
        rms_norm_eps=cfg.rms_eps, attention_bias=True, tie_word_embeddings=False, router_aux_loss_coef=0.0)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    with GGUFFile(path) as f:
        t = {name: np.asarray(f.dequantize(name), dtype=np.float32) for name in f.tensors}
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "lm_head.weight": t["output.weight"],
          "model.norm.weight": t["output_norm.weight"]}
    for i in range(cfg.n_layer):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = t[b + "post_attention_norm.weight"]
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            sd[h + f"self_attn.{theirs}.weight"] = t[b + ours + ".weight"]
            sd[h + f"self_attn.{theirs}.bias"] = t[b + ours + ".bias"]
        sd[h + "self_attn.sinks"] = t[b + "attn_sinks.weight"]
        sd[h + "mlp.router.weight"] = t[b + "ffn_gate_inp.weight"]
        sd[h + "mlp.router.bias"] = t[b + "ffn_gate_inp.bias"]
        gate, up = t[b + "ffn_gate_exps.weight"], t[b + "ffn_up_exps.weight"]     # [E, ff, hidden]
        gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)  # [E, hidden, 2 ff]
        gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        bias = np.empty((gate.shape[0], 2 * gate.shape[1]), np.float32)
        bias[:, 0::2], bias[:, 1::2] = t[b + "ffn_gate_exps.bias"], t[b + "ffn_up_exps.bias"]
        sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"] = gate_up, bias
        sd[h + "mlp.experts.down_proj"] = t[b + "ffn_down_exps.weight"].transpose(0, 2, 1)  # [E, ff, hidden]
        sd[h + "mlp.experts.down_proj_bias"] = t[b + "ffn_down_exps.bias"]
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                                strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"the state dict does not fit transformers' GptOssForCausalLM: missing {missing}, "
                         f"unexpected {unexpected}")
    return model, torch












def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=SPEC["n_layer"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "gpt-oss.gguf", **{**SPEC, "n_layer": args.n_layer})
        model = load_model(path, weights="f16", progress=False)
        cfg = model.config
        teacher = teacher_tokens(model, N_TEACHER)
        ours = pebbling_logits(model, teacher)
        greedy = pebbling_greedy(model, teacher[:N_PROMPT])
        for truncate in (True, False):
            hf, torch = hf_model(path, cfg, truncate)
            theirs = hf_logits(hf, torch, teacher)
            rel = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
            their_greedy, their_logits = hf_greedy(hf, torch, teacher[:N_PROMPT])
            ok, at, gap = tie_tolerant(greedy, their_greedy, their_logits)
            rows.append({"yarn_truncate": truncate, "positions": N_TEACHER, "worst_rel_err": float(rel.max()),
                         "max_abs_diff": float(np.abs(ours - theirs).max()),
                         "argmax_equal": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
                         "greedy_equal": greedy == their_greedy, "greedy_tie_tolerant": ok, "first_divergence": at,
                         "their_gap_there": gap})
    print(f"gpt-oss, {args.n_layer} layers of 256, 8 heads of 64 over 2, 16 experts of 4, window 8, YaRN x32 of 16; "
          f"F32 weights, float32 on both sides")
    print(f"{'YaRN truncate':14} {'worst rel err':>14} {'max |diff|':>11} {'argmax eq':>9}  greedy 16")
    for r in rows:
        greedy = "equal" if r["greedy_equal"] else (f"part at {r['first_divergence']} (gap {r['their_gap_there']:.1e}"
                                                    + (", a tie)" if r["greedy_tie_tolerant"] else ")"))
        print(f"{str(r['yarn_truncate']):14} {r['worst_rel_err']:14.2e} {r['max_abs_diff']:11.2e} "
              f"{r['argmax_equal']:9.2f}  {greedy}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    judged = rows[0]  # GGML's YaRN rounding, which pebbling computes
    good = judged["worst_rel_err"] <= 1e-4 and judged["greedy_tie_tolerant"]
    print("agree (truncate true: rel err <= 1e-4, greedy tokens tie-tolerantly equal)" if good else "DISAGREE")
    return 0 if good else 1
