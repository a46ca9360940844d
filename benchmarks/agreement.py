"""Agreement: does pebbling compute what llama.cpp and Hugging Face transformers compute, on the same files
and weights? Logits, greedy tokens, tokenization, a context shifted past num_ctx.

    python benchmarks/agreement.py SUBCOMMAND [its options]   (SUBCOMMAND --help for them)

llama.cpp (llama-cpp-python) and transformers are not pebbling dependencies: the llama.cpp subcommands run
with an interpreter that has llama-cpp-python beside pebbling (where it is missing, they say how to make
one), `transformers` with torch, transformers and accelerate installed. A check that finds a disagreement
exits 1.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from lib.cli import run  # noqa: E402

COMMANDS = {
    "llamacpp": ("lib.agreement_llamacpp", "logits, greedy tokens and tokenization against llama.cpp for every "
                                           "architecture and tensor type"),
    "chat": ("lib.agreement_chat", "the prompt the server renders for a chat (tools, their results, think levels) "
                                   "against llama.cpp's rendering of the file's template, token for token"),
    "gpt-oss-transformers": ("lib.agreement_gpt_oss_hf", "gpt-oss beside transformers' GptOssForCausalLM in "
                                                        "float32 on the same weights (sinks and experts mapped by "
                                                        "hand): every position's logits, greedy tokens"),
    "gemma4-transformers": ("lib.agreement_gemma4_hf", "Gemma 4 (E2B-, 26B-A4B- and 31B-like) beside "
                                                      "transformers' Gemma4ForCausalLM in float32 on the same "
                                                      "weights (mapped by hand): every position's logits, greedy "
                                                      "tokens"),
    "moe-shape": ("lib.agreement_moe_shape", "the mixture-of-experts check on a real model's shape "
                                             "(Qwen3-30B-A3B), with pebbling's router margins"),
    "shift": ("lib.agreement_shift", "a generation past num_ctx: pebbling's context shifts and logits step by "
                                     "step against llama.cpp's server rule"),
    "transformers": ("lib.agreement_transformers", "an 8B random-weight Llama beside transformers (and "
                                                   "accelerate offload) on the same weights: tokens, peak "
                                                   "memory, speed at each budget"),
}

if __name__ == "__main__":
    sys.exit(run(__doc__, COMMANDS))
