"""`benchmarks/speed.py moe`'s choice of llama.cpp's layers with experts on the CPU: from the file's own tensors, the
fewest first layers that leave the rest within the budget (its run needs the 17 GB file and a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import tiny_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import speed_moe as bench  # noqa: E402
from pyplugin.model import GGUFFile  # noqa: E402


def test_each_layers_expert_bytes_and_the_rest_but_the_embedding_come_from_the_file():
    path = tiny_path("qwen3moe", vocab="qwen3", key_length=32, n_ff_exp=32, n_embd=64, n_head=4, n_head_kv=2,
                     n_ff=96, n_ctx=128, n_merges=150, n_layer=2, n_expert=8, n_expert_used=3)
    experts, other = bench.layer_bytes(path)
    tensors = GGUFFile(path).tensors
    for i in range(2):
        want = sum(tensors[f"blk.{i}.{name}.weight"].nbytes for name in bench.EXPERT_TENSORS)
        assert experts[i] == want > 0
    everything = sum(t.nbytes for t in tensors.values())
    assert other == everything - sum(experts) - tensors["token_embd.weight"].nbytes


def test_the_fewest_first_layers_whose_experts_leave_the_rest_within_the_budget():
    experts, other, kv = [100, 100, 100, 100], 50, 10
    fits = lambda n: other + sum(experts[n:]) + kv + bench.COMPUTE_BYTES  # noqa: E731
    assert bench.first_layers_on_cpu(experts, other, kv, fits(0)) == 0
    assert bench.first_layers_on_cpu(experts, other, kv, fits(0) - 1) == 1
    assert bench.first_layers_on_cpu(experts, other, kv, fits(3)) == 3
    assert bench.first_layers_on_cpu(experts, other, kv, fits(4) - 1) == 4  # nothing fits: every layer's on the CPU
