"""Gemma 4 beside Hugging Face transformers' float32 modelling code (Gemma4ForCausalLM), on the same weights.

    python benchmarks/agreement.py gemma4-transformers [--json FILE] [--only e2b,26b-a4b,26b-a4b-split,31b]

Four random-weight gemma4 files (synth, F32, Gemma 4's vocabulary), each loaded by pebbling in its f16 form
(float32 weights on the host), beside a Gemma4ForCausalLM built from a Gemma4TextConfig of the file's
hyperparameters:

- e2b: as E2B, 10 layers of 256 (4 sliding over 8 positions, then a full one, twice), 4 query heads over 1 KV
  head, sliding heads of 64 and full ones of 128, per-layer embeddings of 256, the last 5 layers reading the
  caches of layers 3 (sliding) and 4 (full) with an FFN twice as wide (num_kv_shared_layers,
  use_double_wide_mlp)
- 26b-a4b: as 26B-A4B, 6 layers (5 sliding, 1 full), 2 KV heads sliding and 1 full with V its keys'
  projection (attention_k_eq_v, num_global_key_value_heads), a dense FFN beside 16 experts of 128 with 4
  used (enable_moe_block), gate and up merged (ffn_gate_up_exps); 26b-a4b-split: the same, gate and up as two
  tensors (ffn_gate_exps, ffn_up_exps)
- 31b: as 31B, dense, 6 layers (5 sliding, 1 full), 2 KV heads sliding and 1 full with V = K

The state dict is filled by hand from the file's tensors, llama.cpp's names mapped back: token_embd ->
embed_tokens (the output tied to it; Gemma 4's embedding module multiplies by sqrt(hidden) itself, as pebbling
does), attn_norm / post_attention_norm / ffn_norm / post_ffw_norm -> input_layernorm / post_attention_layernorm /
pre_feedforward_layernorm / post_feedforward_layernorm, attn_q/k/v/output and attn_q_norm/k_norm -> q/k/v/o_proj
and q_norm/k_norm (a layer reading another's caches has no K, V or K norm in either), layer_output_scale ->
layer_scalar, inp_gate / proj / post_norm -> per_layer_input_gate / per_layer_projection /
post_per_layer_input_norm, per_layer_token_embd / per_layer_model_proj / per_layer_proj_norm ->
embed_tokens_per_layer / per_layer_model_projection / per_layer_projection_norm; in a layer of experts
ffn_gate_inp / ffn_gate_inp.scale / ffn_down_exps.scale -> router.proj / router.scale / router.per_expert_scale,
ffn_gate_up_exps -> experts.gate_up_proj as it is (each expert's gate rows then its up rows; split files'
gate and up concatenated per expert), ffn_down_exps -> experts.down_proj ([expert, hidden, ff] on both sides),
pre_ffw_norm_2 / post_ffw_norm_1 / post_ffw_norm_2 -> pre_feedforward_layernorm_2 /
post_feedforward_layernorm_1 / post_feedforward_layernorm_2. Gemma 4's norms multiply by the weight itself
(no 1 + w), as llama.cpp's converter writes them, so every norm goes across unchanged. The load is strict:
every tensor of the file used, and nothing of the model left out but the buffers transformers computes itself
(RoPE's inverse frequencies, the embeddings' scales). The file's rope_freqs is not a weight transformers has:
it is the converter's encoding of the full layers' "proportional" RoPE (1 on the turned pairs, 1e30 on the
rest), read back here as partial_rotary_factor = turned pairs * 2 / head size (0.25).

transformers' own GGUF reader (from_pretrained(gguf_file=...)) could not have loaded these files: of the
hyperparameters its gemma4 mapping reads one head size (key_length, as global_head_dim; the sliding layers'
left at its default 256) and none of key_length_swa, the per-layer KV heads and FFN widths, shared_kv_layers,
the per-layer embeddings' width, the proportional RoPE or the experts' counts; and of the weights its name map
(get_gguf_hf_weights_map, run here and printed) reaches no parameter for each layer's layer_output_scale
(transformers' layer_scalar is a buffer without ".weight", so the map asks for a name the file does not have)
nor, in a layer of experts, for ffn_gate_inp.scale, ffn_down_exps.scale (the router's scale and per-expert
scale), ffn_gate_up_exps (or ffn_gate_exps and ffn_up_exps) and ffn_down_exps. The router's projection, the
three extra norms and everything else it names as this script does.

Configured as the files say, with Gemma 4's own semantics: attention scaling 1.0 (q's norm does it), V normed
without a weight, use_bidirectional_attention None (causal), the final logits capped at 30 (llama.cpp's default
where a file gives none; Gemma 4's own config says 30), the sliding layers' RoPE base 10000 (likewise), eager
attention, float32. transformers hands a layer that reuses caches the whole K and V of the last earlier layer
of its kind (shared_kv_states) and masks them with the reader's own window; pebbling reads that layer's
caches, a ring of 8 rows on a sliding layer.

Compared: the logits of every position of a 28-token prompt (teacher-forced, so the window's edge at 8 is
crossed, and by the shared layers too), and 16 greedy tokens from a 12-token prompt (pebbling decoding one
token at a time through its caches, transformers recomputing the whole sequence), tie-tolerantly: where
transformers' top two logits are within 1e-4 of each other either token is right: four times the largest
difference float32 leaves between the two here (2.6e-5 on logits of norm ~26), far below the gaps a real
difference leaves. Judged: the worst position within 1e-4 relative of transformers' float32 logits. As a
yardstick, transformers is run once more in float64 on the prompt, and both sides' distance from it is shown:
pebbling's float32 is as far from it as transformers' own float32 is (2e-6 to 8e-6). This holds with synth's
q-norm weights of about 1/sqrt(head size) (Gemma 4 scales q by nothing else); with weights of about 1 the
scores spread sqrt(head size) times wider, and float32 itself, transformers' as much as pebbling's, lands
~1e-4 from float64 (measured: 7.7e-5 and 2.6e-4 on 31b and e2b), which this tolerance would not allow.
A change of any one thing on transformers' side moves the logits by far more than the tolerance (measured on
e2b and 26b-a4b):
partial_rotary_factor 0.5 5e-2, the sliding layers on the full layers' RoPE base 0.55, no final cap 1.9e-3, a
window of 9 0.89, layer_scalar 1 1.2, the per-layer table zeroed 1.1, per_expert_scale 1 0.47.

torch and transformers are not pebbling dependencies: install them beside it for this script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from lib.hf_compare import N_GEN, hf_greedy, hf_logits, pebbling_greedy, pebbling_logits, teacher_tokens, tie_tolerant
from pyplugin.model import load_model
from pyplugin.model.gguf_file import GGUFFile
from pyplugin.model.synth import SynthSpec, write_gguf

BASE = dict(arch="gemma4", vocab="gemma4", n_embd=256, n_head=4, n_ff=512, n_ctx=256, key_length=128,
            sliding_window=8, rope_theta=1e6, weight_type="F32", seed=13)
VARIANTS = {
    "e2b": ("E2B-like: per-layer embeddings, last 5 layers share caches, double-wide FFN there, 1 KV head",
            dict(n_layer=10, n_head_kv=1, swa_pattern=[i % 5 < 4 for i in range(10)],
                 gemma4={"head_dim_swa": 64, "shared_kv_layers": 5, "n_embd_per_layer": 256, "double_wide": True})),
    "26b-a4b": ("26B-A4B-like: dense FFN beside 16 experts of 4, V = K on full layers, 2 KV heads sliding / 1 full",
                dict(n_layer=6, n_head_kv=2, swa_pattern=[i % 6 < 5 for i in range(6)], n_expert=16, n_expert_used=4,
                     n_ff_exp=128, gemma4={"head_dim_swa": 64, "n_head_kv_full": 1, "k_eq_v": True})),
    "26b-a4b-split": ("the same with each expert's gate and up as two tensors (ffn_gate_exps, ffn_up_exps)",
                      dict(n_layer=6, n_head_kv=2, swa_pattern=[i % 6 < 5 for i in range(6)], n_expert=16,
                           n_expert_used=4, n_ff_exp=128, gemma4={"head_dim_swa": 64, "n_head_kv_full": 1,
                                                                  "k_eq_v": True, "merged_gate_up": False})),
    "31b": ("31B-like: dense, V = K on full layers, 2 KV heads sliding / 1 full",
            dict(n_layer=6, n_head_kv=2, swa_pattern=[i % 6 < 5 for i in range(6)],
                 gemma4={"head_dim_swa": 64, "n_head_kv_full": 1, "k_eq_v": True})),
}
N_PROMPT, N_TEACHER, TOLERANCE = 12, 28, 1e-4
COMPUTED_BUFFERS = ("rotary_emb.", "embed_scale")  # what transformers computes itself, never loaded


def _partial_rotary(freqs: np.ndarray, path: Path) -> float:
    """The full layers' partial_rotary_factor from the file's rope_freqs (1 turned, 1e30 not)."""
    turned = freqs == 1.0
    if not (turned | (freqs >= 1e30)).all() or turned[int(turned.sum()):].any():
        raise SystemExit(f"{path}: rope_freqs {freqs} is not proportional RoPE (leading 1s, then 1e30)")
    return 2.0 * int(turned.sum()) / (2 * len(freqs))


def hf_config(cfg, t: dict[str, np.ndarray], path: Path):
    """A Gemma4TextConfig of the file's hyperparameters (pebbling's ModelConfig of it)."""
    from transformers import Gemma4TextConfig  # noqa: PLC0415 - optional

    layers = [cfg.for_layer(i) for i in range(cfg.n_layer)]
    sliding = [i for i in range(cfg.n_layer) if cfg.is_sliding(i)]
    full = [i for i in range(cfg.n_layer) if not cfg.is_sliding(i)]
    k_eq_v = any(f"blk.{i}.attn_k.weight" in t and f"blk.{i}.attn_v.weight" not in t for i in full)
    kv_sliding, kv_full = layers[sliding[0]].n_head_kv, layers[full[0]].n_head_kv
    shared = cfg.n_layer - cfg.n_layer_kv if cfg.n_layer_kv else 0
    widths, readers = {c.n_ff for c in layers[:cfg.n_layer - shared]}, {c.n_ff for c in layers[cfg.n_layer - shared:]}
    wide = bool(shared) and readers == {2 * layers[0].n_ff}  # use_double_wide_mlp: the readers' FFNs twice as wide
    if len(widths) > 1 or not readers <= widths | {2 * layers[0].n_ff} or len(readers) > 1 or \
            (kv_full != kv_sliding and not k_eq_v) or \
            any(c.n_head_kv != (kv_sliding if cfg.is_sliding(i) else kv_full) for i, c in enumerate(layers)):
        raise SystemExit(f"{path}: per-layer KV heads or FFN widths that a Gemma4TextConfig cannot express")
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": layers[sliding[0]].rope_theta},
            "full_attention": {"rope_type": "proportional", "rope_theta": cfg.rope_theta,
                               "partial_rotary_factor": _partial_rotary(t["rope_freqs.weight"], path)}}
    experts = dict(enable_moe_block=True, num_experts=cfg.n_expert, top_k_experts=cfg.n_expert_used,
                   moe_intermediate_size=cfg.n_ff_exp) if cfg.n_expert else {}
    config = Gemma4TextConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=layers[0].n_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=kv_sliding, head_dim=layers[sliding[0]].head_dim,
        global_head_dim=cfg.head_dim, num_global_key_value_heads=kv_full, attention_k_eq_v=k_eq_v,
        layer_types=["sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layer)],
        sliding_window=cfg.sliding_window, rope_parameters=rope, max_position_embeddings=cfg.n_ctx_train,
        rms_norm_eps=cfg.rms_eps, final_logit_softcapping=cfg.final_softcap or None, use_bidirectional_attention=None,
        hidden_size_per_layer_input=cfg.n_embd_per_layer, vocab_size_per_layer_input=cfg.n_vocab,
        num_kv_shared_layers=shared, use_double_wide_mlp=bool(wide), tie_word_embeddings="output.weight" not in t,
        attention_bias=False, pad_token_id=0, **experts)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the class's own loop over experts (float64 too)
    return config


def state_dict(cfg, t: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], set[str]]:
    """transformers' names for the file's tensors, and the file's tensors used."""
    used = {"rope_freqs.weight"}  # read into the config (partial_rotary_factor)

    def take(name: str) -> np.ndarray:
        used.add(name)
        return t[name]

    sd = {"model.embed_tokens.weight": take("token_embd.weight"), "model.norm.weight": take("output_norm.weight")}
    sd["lm_head.weight"] = take("output.weight") if "output.weight" in t else t["token_embd.weight"]
    if cfg.n_embd_per_layer:
        sd["model.embed_tokens_per_layer.weight"] = take("per_layer_token_embd.weight")
        sd["model.per_layer_model_projection.weight"] = take("per_layer_model_proj.weight")
        sd["model.per_layer_projection_norm.weight"] = take("per_layer_proj_norm.weight")
    for i in range(cfg.n_layer):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        names = {"attn_norm.weight": "input_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                 "attn_q.weight": "self_attn.q_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                 "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight", "layer_output_scale.weight": "layer_scalar",
                 "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
                 "post_norm.weight": "post_per_layer_input_norm.weight",
                 "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
                 "ffn_down_exps.scale": "router.per_expert_scale", "ffn_down_exps.weight": "experts.down_proj",
                 "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
                 "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
                 "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"}
        for ours, theirs in names.items():
            if b + ours in t:  # absent ones (K on a reader, V where V = K) are absent from the model too
                sd[h + theirs] = take(b + ours)
        if b + "ffn_gate_up_exps.weight" in t:             # [E, 2 ff, hidden]: gate rows then up rows, as theirs
            sd[h + "experts.gate_up_proj"] = take(b + "ffn_gate_up_exps.weight")
        elif b + "ffn_gate_exps.weight" in t:
            sd[h + "experts.gate_up_proj"] = np.concatenate([take(b + "ffn_gate_exps.weight"),
                                                             take(b + "ffn_up_exps.weight")], axis=1)
    return sd, used


def hf_model(path: Path, cfg):
    """Gemma4ForCausalLM of the file's hyperparameters, its weights the file's (float32); and what transformers'
    own GGUF name map would have left out."""
    import torch  # noqa: PLC0415 - optional
    from transformers import Gemma4ForCausalLM  # noqa: PLC0415

    with GGUFFile(path) as f:
        t = {name: np.asarray(f.dequantize(name), dtype=np.float32) for name in f.tensors}
    config = hf_config(cfg, t, path)
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()
    sd, used = state_dict(cfg, t)
    unused = sorted(set(t) - used)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    tensors = {k: v.reshape(shapes[k]) if k in shapes and v.numel() == shapes[k].numel() else v  # layer_scalar [1]
               for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)  # shapes still checked
    missing = [k for k in missing if not any(s in k for s in COMPUTED_BUFFERS)]
    if missing or unexpected or unused:
        raise SystemExit(f"{path}: the state dict does not fit transformers' Gemma4ForCausalLM: missing {missing}, "
                         f"unexpected {unexpected}, file tensors unused {unused}")
    return model, torch, gguf_reader_misses(model, cfg, t)


def gguf_reader_misses(model, cfg, t: dict[str, np.ndarray]) -> list[str]:
    """The file's tensors (layer 0's and the model's, by kind) that transformers' own GGUF name map
    (get_gguf_hf_weights_map, as from_pretrained(gguf_file=...) runs it) maps to no parameter."""
    try:
        from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map  # noqa: PLC0415
        reached = get_gguf_hf_weights_map(model, TensorProcessor(), "gemma4_text", cfg.n_layer)
    except Exception as exc:  # noqa: BLE001 - informative only
        return [f"(its map could not be built: {exc})"]
    kinds = sorted({n.replace("blk.", "").split(".", 1)[1] if n.startswith("blk.") else n
                    for n in t if n not in reached and n != "rope_freqs.weight"})
    return kinds




def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """The worst position's ||a - b|| / ||b||."""
    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())










def run_variant(name: str, tmp: Path) -> dict:
    what, spec = VARIANTS[name]
    path = write_gguf(tmp / f"gemma4-{name}.gguf", SynthSpec(**{**BASE, **spec}))
    model = load_model(path, weights="f16", progress=False)
    cfg = model.config
    teacher = teacher_tokens(model, N_TEACHER)
    ours = pebbling_logits(model, teacher)
    greedy = pebbling_greedy(model, teacher[:N_PROMPT])
    hf, torch, misses = hf_model(path, cfg)
    theirs = hf_logits(hf, torch, teacher)
    their_greedy, their_logits = hf_greedy(hf, torch, teacher[:N_PROMPT])
    ok, at, gap = tie_tolerant(greedy, their_greedy, their_logits)
    exact = hf_logits(hf.to(torch.float64), torch, teacher)  # the yardstick: float32's own distance from it
    return {"variant": name, "what": what, "n_layer": cfg.n_layer, "positions": N_TEACHER,
            "worst_rel_err": rel_err(ours, theirs), "max_abs_diff": float(np.abs(ours - theirs).max()),
            "pebbling_from_float64": rel_err(ours, exact), "transformers_float32_from_float64": rel_err(theirs, exact),
            "argmax_equal": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
            "greedy_equal": greedy == their_greedy,
            "greedy_tie_tolerant": ok, "first_divergence": at, "their_gap_there": gap, "greedy": greedy,
            "gguf_reader_would_miss": misses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(VARIANTS), help=f"variants, of {', '.join(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_variant(n, Path(tmp)) for n in names]
    print("gemma4 beside Gemma4ForCausalLM: 256 wide, 4 query heads, sliding heads of 64 over 8 positions, full heads "
          "of 128 with proportional RoPE (0.25); F32 weights, float32 on both sides, eager attention")
    print(f"{'variant':14} {'worst rel err':>14} {'max |diff|':>11} {'argmax eq':>9}  {'from float64: ours':>18} "
          f"{'theirs':>9}  greedy {N_GEN}")
    for r in rows:
        greedy = "equal" if r["greedy_equal"] else (f"part at {r['first_divergence']} (gap {r['their_gap_there']:.1e}"
                                                    + (", a tie)" if r["greedy_tie_tolerant"] else ")"))
        print(f"{r['variant']:14} {r['worst_rel_err']:14.2e} {r['max_abs_diff']:11.2e} {r['argmax_equal']:9.2f}  "
              f"{r['pebbling_from_float64']:18.2e} {r['transformers_float32_from_float64']:9.2e}  {greedy}")
    for r in rows:
        print(f"  {r['variant']}: {r['what']}; transformers' GGUF name map would leave out: "
              f"{', '.join(r['gguf_reader_would_miss']) or 'nothing'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    good = all(r["worst_rel_err"] <= TOLERANCE and r["greedy_tie_tolerant"] for r in rows)
    print(f"agree (rel err <= {TOLERANCE:g}, greedy tokens tie-tolerantly equal)" if good else "DISAGREE")
    return 0 if good else 1
