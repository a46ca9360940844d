"""`pebbling run MODEL PROMPT`: generate text through the pebble store and stream it to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from ..runtime import Generation
from ..runtime.plan import format_bytes
from .common import (add_pebbling_arguments, chat_tokens, format_duration, load_pebbled, options_from_flags,
                     pebbling_options)


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
    add_pebbling_arguments(p)
    p.add_argument("--verbose", action="store_true",
                   help="after the text, print timings and the pebbling report to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter_ns()
    # Options first: a bad flag is reported before the model is read.
    pebbling = pebbling_options(args.pebbling_strategy, args.pebbling_memory_limit, args.pebbling_weights)
    loaded = load_pebbled(args.model, args.backend, pebbling.effective_weights)
    model = loaded.model
    if model.random_weights:
        print(f"(random weights) {model.path.stem}: the text below is noise", file=sys.stderr)
    options = options_from_flags(model, temperature=args.temperature, seed=args.seed, num_predict=args.num_predict,
                                 num_ctx=args.num_ctx, num_batch=args.num_batch)
    tokens = chat_tokens(model, args.prompt, raw=args.raw)
    try:
        generation = loaded.pebbled.generation(options, pebbling, len(tokens))
        for piece in generation.text(tokens):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()  # the text, then the timings: stdout and stderr may share a terminal
        if args.verbose:
            _print_verbose(generation, time.perf_counter_ns() - started, loaded.load_ns)
    finally:
        loaded.pebbled.close()
    return 0


def _print_verbose(gen: Generation, total_ns: int, load_ns: int) -> None:
    """Ollama's `run --verbose` timings, then the pebbling report, to stderr."""
    s, report = gen.stats, gen.report()
    lines = [
        ("total duration", format_duration(total_ns)),
        ("load duration", format_duration(load_ns)),
        ("prompt eval count", f"{s.prompt_tokens} token(s)"),
        ("prompt eval duration", format_duration(s.prompt_ns)),
        ("prompt eval rate", _rate(s.prompt_tokens, s.prompt_ns)),
        ("eval count", f"{s.generated_tokens} token(s)"),
        ("eval duration", format_duration(s.generate_ns)),
        ("eval rate", _rate(s.generated_tokens, s.generate_ns)),
        ("pebbling strategy", report["strategy"]),
        ("backend", report["backend"]),
        ("weights", report["weights"]),
        ("resident layers", f"{report['resident_layers']}/{report['n_layers']}"),
        ("budget", "no limit" if report["budget_bytes"] is None else format_bytes(report["budget_bytes"])),
        ("estimated peak", f"{format_bytes(report['estimated_peak_bytes'])} (estimate)"),
        ("measured peak", f"{format_bytes(report['measured_peak_bytes'])} ({report['measured_peak_how']})"),
        ("bytes restored", f"{format_bytes(report['bytes_restored'])} ({report['bytes_restored']} bytes)"),
        ("restores", str(report["restores"])),
        ("bytes restored/token", "n/a (no token decoded)" if report["bytes_restored_per_token"] is None
         else format_bytes(report["bytes_restored_per_token"])),
    ]
    if report.get("process_rss_bytes") is not None:  # what the whole process holds, beside the accounting
        lines.append(("process memory", f"{format_bytes(report['process_rss_bytes'])} resident, "
                                        f"{format_bytes(report['process_peak_rss_bytes'])} peak (measured)"))
    for name, value in lines:
        print(f"{name + ':':22}{value}", file=sys.stderr)


def _rate(tokens: int, ns: int) -> str:
    return f"{tokens / (ns / 1e9):.2f} tokens/s" if ns else "n/a"
