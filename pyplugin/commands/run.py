"""`pebbling run MODEL PROMPT`: generate text and stream it to the terminal."""

from __future__ import annotations

import argparse
import sys

from ..loop import Generation
from ..model import load_model
from ..options import Options
from ..registry import resolve
from ..xp import NAMES, array_module


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="generate text from a model, streamed to the terminal",
                              description="Generate text from MODEL (a GGUF path, 'pebbling-demo', "
                                          "or a name in the models directory).")
    p.add_argument("model", help="GGUF file, 'pebbling-demo', NAME or NAME:TAG")
    p.add_argument("prompt", help="the user's message (or, with --raw, the exact text to continue)")
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 0.8)")
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--num-predict", type=int, help="most tokens to generate (-1 = no limit)")
    p.add_argument("--num-ctx", type=int, help="context length in tokens (default 2048)")
    p.add_argument("--num-batch", type=int, help="prompt tokens per prefill chunk (default 512)")
    p.add_argument("--xp", choices=NAMES, default="numpy", help="array module to compute with")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    xp = array_module(args.xp)
    model = load_model(resolve(args.model))
    if model.random_weights:
        print(f"(random weights) {model.path.stem}: the text below is noise", file=sys.stderr)
    given = {"temperature": args.temperature, "seed": args.seed, "num_predict": args.num_predict,
             "num_ctx": args.num_ctx, "num_batch": args.num_batch}
    options = Options.from_dict({k: v for k, v in given.items() if v is not None},
                                n_ctx_train=model.config.n_ctx_train)
    text = args.prompt if args.raw else model.chat_prompt([{"role": "user", "content": args.prompt}])
    generation = Generation(model, options, xp=xp)
    for piece in generation.text(model.tokenizer.encode(text)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
