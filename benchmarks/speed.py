"""Speed: how fast pebbling prefills and decodes beside llama.cpp on the same CPU and on a GPU (and beside
transformers + accelerate there), and where a token's time goes.

    python benchmarks/speed.py SUBCOMMAND [its options]       (SUBCOMMAND --help for them)

The files are random-weight GGUFs of real models' shapes, written for the run; every figure is measured in
the run, the peers in the same run where they import (llama-cpp-python, transformers: not pebbling
dependencies), and a peer that does not is recorded absent. benchmarks/README.md has the latest figures.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from lib.cli import run  # noqa: E402

COMMANDS = {
    "cpu": ("lib.speed_cpu", "the host backend beside llama.cpp on one CPU: the same files and threads, "
                             "interleaved runs, load, prefill, decode, peak RSS"),
    "gpu": ("lib.speed_gpu", "Llama-3-8B's shape on a GPU, every strategy at batch 1 and 8, beside llama.cpp and "
                             "transformers + accelerate; peaks beside the estimate (issue 25's checks)"),
    "moe": ("lib.speed_moe", "a Qwen3-30B-A3B-shaped mixture of experts in an 8 GiB budget, beside llama.cpp's "
                             "--n-cpu-moe"),
    "profile": ("lib.speed_profile", "where the host backend's decode step spends its time: the native step, "
                                     "Python, the attention over N cached rows"),
    "matvec": ("lib.speed_matvec", "the matrix-vector kernels on Llama-3-8B's matrices against the device's copy "
                                   "bandwidth; builds and switches side by side"),
    "forward": ("lib.speed_forward", "the forward pass (numpy, CuPy) on a ~100M-parameter Llama, every layer "
                                     "resident"),
    "structured": ("lib.speed_structured", "what a JSON schema costs a decoded token, and the grammar's mask "
                                           "over real vocabulary sizes"),
}

if __name__ == "__main__":
    sys.exit(run(__doc__, COMMANDS))
