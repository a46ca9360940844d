"""Memory and streaming: what a model takes of device memory under each strategy, beside the plan's estimate,
and what streaming layers (and experts) from the host tier costs against the bus.

    python benchmarks/memory.py SUBCOMMAND [its options]      (SUBCOMMAND --help for them)

Every figure is measured in the run (NVML on a GPU; the store's byte accounting on the host and stub
backends, labelled so); an estimate is printed as one. benchmarks/README.md has the latest figures.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from lib.cli import run  # noqa: E402

COMMANDS = {
    "streaming": ("lib.memory_streaming", "each strategy on one random-weight Llama: peak beside the estimate, "
                                          "tokens equal to none's, decode against the transfer bound"),
    "store": ("lib.memory_store", "pinned host<->device bandwidth through the store (pebble_restore, pebble_save)"),
    "quantized": ("lib.memory_quantized", "quantized weights on the device against their stored bytes, decode "
                                          "beside f16, the fused kernels against the device's bandwidth"),
    "experts": ("lib.memory_experts", "experts as pebbles on a Qwen3-30B-A3B shape: hit rate, bytes restored, "
                                      "prefetch accuracy per cache size and policy; a Zipf routing trace"),
    "estimate": ("lib.memory_estimate", "pebbling estimate on a shape larger than the machine (gpt-oss-120b), "
                                        "its file a sparse one of the real size"),
    "steps": ("lib.memory_steps", "one process's device memory step by step over a model's load and requests"),
    "probe": ("lib.memory_probe", "what a GPU machine is, whether pebbling runs on it, and what the CUDA "
                                  "context, cuBLAS and threads take (gpu_check.py's first stage)"),
}

if __name__ == "__main__":
    sys.exit(run(__doc__, COMMANDS))
