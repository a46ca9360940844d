"""Real models' shapes, for random-weight GGUF files of them: the shapes, llama.cpp's Q4_K_M mix for each, and
the files the benchmarks write (synth's random values, or its random valid blocks where a file is large)."""

from __future__ import annotations

from pathlib import Path

N_VOCAB = 151936
# Shapes of real models (--shape), random weights. Where a row is not whole 256-element blocks llama.cpp's
# Q4_K_M falls back to Q5_0 for Q4_K and Q8_0 for Q6_K, and so do these files; Q6_K goes to attn_v and
# ffn_down on half the layers (every other one here) and to the output, as its mix does.
SHAPES = {
    "qwen2-0.5b": dict(arch="qwen2", n_layer=24, n_embd=1024, n_head=16, n_head_kv=2, n_ff=4864, vocab="chatml",
                       tied_output=True, vocab_size=N_VOCAB),
    "smollm2-135m": dict(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, vocab="llama3",
                         tied_output=True, vocab_size=49152),
    "gemma3-270m": dict(arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, key_length=256, n_ff=2048,
                        vocab="gemma", vocab_size=262144, sliding_window=512),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, key_length=128, n_ff=3072,
                       vocab="qwen3", tied_output=True, vocab_size=N_VOCAB),
    "qwen2.5-1.5b": dict(arch="qwen2", n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, vocab="chatml",
                         tied_output=True, vocab_size=N_VOCAB),
    # A mixture of experts: its Q4_K_M-like file is 17.3 GiB at 48 layers, so its matrices are random valid blocks
    # written directly (synth's random_blocks), not quantized from floats: the whole file in minutes.
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, key_length=128, n_ff=6144,
                          n_ff_exp=768, n_expert=128, n_expert_used=8, vocab="qwen3", vocab_size=N_VOCAB,
                          random_blocks=True),
    # gpt-oss-20b and -120b: 64 query heads of 64 over 8 KV heads on 2880, experts of 2880 (4 used), every other
    # layer sliding over 128, YaRN x32 of 4096 on a base of 150000, o200k's 201088 tokens; random valid blocks
    "gpt-oss-20b": dict(arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, key_length=64, n_ff=2880,
                        n_ff_exp=2880, n_expert=32, n_expert_used=4, vocab="harmony", vocab_size=201088,
                        sliding_window=128, rope_yarn=(32.0, 4096), rope_theta=150000.0, random_blocks=True),
    "gpt-oss-120b": dict(arch="gpt-oss", n_layer=36, n_embd=2880, n_head=64, n_head_kv=8, key_length=64, n_ff=2880,
                         n_ff_exp=2880, n_expert=128, n_expert_used=4, vocab="harmony", vocab_size=201088,
                         sliding_window=128, rope_yarn=(32.0, 4096), rope_theta=150000.0, random_blocks=True),
    # Gemma 4, as its released configs have it: sliding layers of head 256 (window 512, or 1024 on the 26B and 31B)
    # and full layers of head 512 turning a quarter of it (proportional RoPE), four or five sliding to a full one;
    # E2B and E4B: per-layer embeddings of 256 (a second table of n_layer x 256 a token) and their last 20 or 18
    # layers reading earlier layers' caches (E2B's FFNs there twice as wide); 26B-A4B: 128 experts of 704 (8 used)
    # beside a dense FFN of 2112, full layers' V their keys' projection over 2 KV heads; 31B: dense, likewise over 4.
    # Gemma's 262144 tokens; random valid blocks.
    "gemma4-e2b": dict(arch="gemma4", n_layer=35, n_embd=1536, n_head=8, n_head_kv=1, key_length=512, n_ff=6144,
                       vocab="gemma4", vocab_size=262144, sliding_window=512, swa_pattern=[i % 5 < 4 for i in range(35)],
                       gemma4=dict(head_dim_swa=256, shared_kv_layers=20, n_embd_per_layer=256, double_wide=True),
                       rope_theta=1e6, random_blocks=True),
    "gemma4-e4b": dict(arch="gemma4", n_layer=42, n_embd=2560, n_head=8, n_head_kv=2, key_length=512, n_ff=10240,
                       vocab="gemma4", vocab_size=262144, sliding_window=512, swa_pattern=[i % 6 < 5 for i in range(42)],
                       gemma4=dict(head_dim_swa=256, shared_kv_layers=18, n_embd_per_layer=256),
                       rope_theta=1e6, random_blocks=True),
    "gemma4-26b-a4b": dict(arch="gemma4", n_layer=30, n_embd=2816, n_head=16, n_head_kv=8, key_length=512, n_ff=2112,
                           n_ff_exp=704, n_expert=128, n_expert_used=8, vocab="gemma4", vocab_size=262144,
                           sliding_window=1024, swa_pattern=[i % 6 < 5 for i in range(30)], rope_theta=1e6,
                           gemma4=dict(head_dim_swa=256, n_head_kv_full=2, k_eq_v=True), random_blocks=True),
    "gemma4-31b": dict(arch="gemma4", n_layer=60, n_embd=5376, n_head=32, n_head_kv=16, key_length=512, n_ff=21504,
                       vocab="gemma4", vocab_size=262144, sliding_window=1024, swa_pattern=[i % 6 < 5 for i in range(60)],
                       rope_theta=1e6, gemma4=dict(head_dim_swa=256, n_head_kv_full=4, k_eq_v=True), random_blocks=True),
    # Llama-3.2-3B: 3.2 billion weights, so random valid blocks as for the mixture of experts.
    "llama3.2-3b": dict(arch="llama", n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, vocab="llama3",
                        tied_output=True, vocab_size=128256, rope_theta=500000.0, random_blocks=True),
}


def q4_k_m(shape: dict, k_type: str = "Q4_K") -> dict:
    """llama.cpp's Q4_K_M mix for a shape (Q5_K_M's with k_type Q5_K), with its fallbacks for rows that are not
    whole K-blocks."""
    whole = shape["n_embd"] % 256 == 0
    base, high = (k_type, "Q6_K") if whole else ("Q5_0" if k_type == "Q4_K" else "Q5_1", "Q8_0")
    types = {"attn_v": high, "token_embd": high, "output": high}
    head = shape.get("key_length") or shape["n_embd"] // shape["n_head"]
    down = "ffn_down_exps" if shape.get("n_expert") else "ffn_down"   # a mixture of experts: its experts' down
    ff_whole = shape.get("n_ff_exp" if shape.get("n_expert") else "n_ff", shape["n_ff"]) % 256 == 0
    q_whole = (shape["n_head"] * head) % 256 == 0
    ff_base, ff_high = (k_type, "Q6_K") if ff_whole else ("Q5_0" if k_type == "Q4_K" else "Q5_1", "Q8_0")
    types[down] = ff_base
    if shape.get("n_expert") and shape["arch"] == "gemma4" and shape["n_ff"] % 256:  # its dense FFN beside them
        types["ffn_down"] = "Q5_0" if k_type == "Q4_K" else "Q5_1"
    if q_whole and not whole:
        types["attn_output"] = k_type
    for i in range(0, shape["n_layer"], 2):
        types[f"blk.{i}.attn_v"] = high
        types[f"blk.{i}.{down}"] = ff_high
    for i in range(1, shape["n_layer"], 2):
        types[f"blk.{i}.attn_v"] = base
    return dict(weight_type=base, tensor_types=types)


def low_bit_mix(name: str):
    """llama-quantize's mix `name` (Q3_K_M, Q2_K, IQ4_XS) for a shape: pyplugin.model.synth_mix's rules, the
    matrices as random valid blocks (these types' quantizers fit each block from floats: too slow for billions
    of weights)."""
    def mix(shape: dict) -> dict:
        from pyplugin.model.synth import SynthSpec  # noqa: PLC0415
        from pyplugin.model.synth_mix import quantize_mix  # noqa: PLC0415

        spec = quantize_mix(SynthSpec(**shape), name)
        return dict(weight_type=spec.weight_type, tensor_types=spec.tensor_types, random_blocks=True)
    return mix


FILES = {
    "Q4_K_M": q4_k_m,
    "Q5_K_M": lambda shape: q4_k_m(shape, "Q5_K"),
    "Q3_K_M": low_bit_mix("Q3_K_M"),
    "Q2_K": low_bit_mix("Q2_K"),
    "IQ4_XS": low_bit_mix("IQ4_XS"),
    # llama-quantize's MXFP4_MOE, as the released gpt-oss files have it: experts MXFP4, every other matrix Q8_0
    "MXFP4_MOE": lambda shape: dict(weight_type="Q8_0", tensor_types=dict.fromkeys(
        ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), "MXFP4"), random_blocks=True),
    "Q8_0": lambda shape: dict(weight_type="Q8_0"),
    "Q4_1": lambda shape: dict(weight_type="Q4_1", tensor_types={"token_embd": "Q8_0"}),
}


def with_layers(shape: dict, n_layer: int | None) -> dict:
    """`shape` cut to `n_layer` layers (a quick run): a Gemma 4's sliding pattern kept, and its share of layers
    reading earlier caches, so that the last layer keeping caches of its own is a full one (llama.cpp's rule)."""
    if not n_layer:
        return dict(shape)
    out = dict(shape, n_layer=n_layer)
    if isinstance(shape.get("swa_pattern"), list):
        period = shape["swa_pattern"].index(False) + 1
        out["swa_pattern"] = [i % period < period - 1 for i in range(n_layer)]
        shared = shape["gemma4"].get("shared_kv_layers", 0)
        if shared:
            own = max(period, round(n_layer * (1 - shared / shape["n_layer"]) / period) * period)
            out["gemma4"] = dict(shape["gemma4"], shared_kv_layers=max(0, n_layer - own))
    return out


def write_files(directory: Path, names: list[str], shape_name: str, n_layer: int | None) -> dict[str, Path]:
    """A file of `shape_name` (with `n_layer` layers where given) in each of FILES' `names`, into `directory`;
    a file already there is kept."""
    from pyplugin.model.synth import write_gguf  # noqa: PLC0415

    shape = with_layers(SHAPES[shape_name], n_layer)
    paths = {}
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = directory / f"{shape_name}-{shape['n_layer']}L-shaped-{name}.gguf"
        if not path.exists():
            write_gguf(path, **{**shape, **FILES[name](shape)}, n_ctx=4096)
        paths[name] = path
    return paths
