"""`pebbling verify MODEL`: run one prompt greedily under `none` (every layer resident) and under
each streaming strategy, and check that every strategy produces exactly the same tokens while
holding less device memory. Peak memory and speed are those of this run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from ..errors import PebblingError
from ..model import WEIGHT_FORMS
from ..runtime import Generation, MemoryModel, Options, PebblingOptions, make_plan
from ..runtime.plan import format_bytes, parse_size, smallest_footprint
from ..store import Strategy
from .common import (Loaded, add_backend_argument, add_weights_argument, chat_tokens, decode_rate, format_table,
                     load_pebbled, options_from_flags, plain)
from .ties import DEFAULT_TIE_TOLERANCE, Recorder, compare, forced_steps
from .ties import describe as describe_ties

STRATEGIES = ("none", "sqrt", "adaptive", "minimal", "every:2")
DEFAULT_PROMPT = "Why is the sky blue?"
DEFAULT_NUM_PREDICT = 32


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="check that every strategy gives the tokens of full residency",
                              description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file, 'pebbling-demo', NAME or NAME:TAG")
    p.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help=f"the user's message (default {DEFAULT_PROMPT!r})")
    p.add_argument("--num-predict", type=int, default=DEFAULT_NUM_PREDICT,
                   help=f"tokens to generate (default {DEFAULT_NUM_PREDICT})")
    p.add_argument("--num-ctx", type=int, help="context length in tokens (default 2048)")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="adaptive's budget (default halfway between minimal's and none's estimated peak, "
                        "so that adaptive has to choose)")
    add_weights_argument(p)
    p.add_argument("--compare-weights", action="store_true",
                   help="also load the model in the other weight form (f16 beside quantized, or the "
                        "reverse) and check that none gives the same tokens from it, or parts from them only "
                        "at near-ties")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE, metavar="LOGITS",
                   help="with --compare-weights: where the other form, fed the same tokens, chooses another "
                        "token, the reference's logits for the two may lie this far apart and still count as a "
                        f"near-tie that either form may break (default {DEFAULT_TIE_TOLERANCE}: the two forms' "
                        "rounding on the demo model; verify prints what it measured)")
    add_backend_argument(p)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw peak memory and decode speed per strategy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    limit = None if args.memory_limit is None else parse_size(args.memory_limit, "--memory-limit")
    if not args.tie_tolerance >= 0:  # NaN too
        raise PebblingError(f"--tie-tolerance {args.tie_tolerance}: must be a number of logits, 0 or more")
    pyplot = _pyplot() if args.plot else None  # before the run: a missing matplotlib fails fast
    loaded = load_pebbled(args.model, args.backend, args.pebbling_weights)
    try:
        options = options_from_flags(loaded.model, temperature=0, num_predict=args.num_predict,
                                     num_ctx=args.num_ctx)
        result = verify(loaded, options, args.prompt, limit)
        reference_steps = result.pop("reference_steps")
    finally:
        loaded.pebbled.close()
    if args.compare_weights:
        other = next(form for form in WEIGHT_FORMS if form != args.pebbling_weights)
        del loaded  # the first form's host copy goes before the second is read
        result["other_weights"] = other_form(args.model, args.backend, other, options, args.prompt,
                                             result["strategies"]["none"], reference_steps, args.tie_tolerance)
        result["all_tokens_equal"] = result["all_tokens_equal"] and result["other_weights"]["tokens_equal"]
        result["passed"] = result["passed"] and parted_at_near_ties_only(result["other_weights"])
    if args.json:
        if result["random_weights"]:
            print(f"(random weights) {result['model']}: its text is noise", file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
    if pyplot:
        plot(result, args.plot, pyplot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0 if result["passed"] else 1


def verify(loaded: Loaded, options: Options, prompt: str, limit: int | None) -> dict[str, Any]:
    """Each strategy's tokens, peak memory and speed, through one store (no reload in between)."""
    model, pebbled = loaded.model, loaded.pebbled
    tokens = chat_tokens(model, prompt)

    def generate(strategy: str, memory: MemoryModel, options: Options = options,
                 record: bool = False) -> tuple[list[int], Generation]:
        budget = None
        if strategy == "adaptive":
            budget = limit if limit is not None else (
                smallest_footprint(memory) + make_plan(memory, "none").estimated_peak_bytes) // 2
        pebbling = PebblingOptions(Strategy.parse(strategy), None, budget)
        gen = pebbled.generation(options, pebbling, plan=make_plan(memory, strategy, budget))
        if record:  # the reference: the logits of each choice, for --compare-weights
            gen.recorder = Recorder(gen)
        return list(gen.tokens(tokens)), gen

    # Untimed warm-up: the first pass pays one-time costs (caches, kernel compilation) that would
    # otherwise be charged to `none` and flatter every other strategy's slowdown.
    generate("none", pebbled.memory_model(options, len(tokens)), replace(options, num_predict=2))
    # On the GPU the backend's overhead has now grown by the kernels and libraries a request loads;
    # one memory model taken after that serves every strategy, so their estimates compare like with like.
    memory = pebbled.memory_model(options, len(tokens))

    rows: dict[str, dict[str, Any]] = {}
    for name in STRATEGIES:
        out, gen = generate(name, memory, record=name == "none")
        if name == "none":
            reference_steps = gen.recorder.steps
        report, stats = gen.report(), gen.stats
        rows[name] = {**report, "tokens": out, "generated_tokens": stats.generated_tokens,
                      "decode_tokens_per_s": decode_rate(stats)}
    reference = rows["none"]
    for row in rows.values():
        row["tokens_equal"] = row["tokens"] == reference["tokens"]
        saved = 1 - row["measured_peak_bytes"] / reference["measured_peak_bytes"]
        row["reduction_pct"] = round(100 * saved, 1)
        rate, base = row["decode_tokens_per_s"], reference["decode_tokens_per_s"]
        row["slowdown"] = round(base / rate, 3) if rate and base else None
    return {
        "model": loaded.path.stem,
        "path": str(loaded.path),
        "random_weights": model.random_weights,
        "backend": pebbled.backend.name,
        "weights": pebbled.weights,
        "layer_weight_bytes": pebbled.weight_bytes,
        "n_layers": model.config.n_layer,
        "prompt": prompt,
        "prompt_tokens": len(tokens),
        "num_predict": options.num_predict,
        "num_ctx": options.num_ctx,
        "adaptive_budget_bytes": rows["adaptive"]["budget_bytes"],
        "measured_peak_how": reference["measured_peak_how"],
        "strategies": rows,
        "all_tokens_equal": all(row["tokens_equal"] for row in rows.values()),
        "passed": all(row["tokens_equal"] for row in rows.values()),
        "reference_steps": reference_steps,
    }


def other_form(name: str, backend: str | None, weights: str, options: Options, prompt: str,
               reference: dict[str, Any], reference_steps: list, tolerance: float) -> dict[str, Any]:
    """`none` with the model's weights in form `weights`, against the first form's `none` row: its own
    greedy tokens, and its choices when fed the reference's tokens (ties.py)."""
    loaded = load_pebbled(name, backend, weights)
    try:
        model, pebbled = loaded.model, loaded.pebbled
        tokens = chat_tokens(model, prompt)
        gen = pebbled.generation(options, PebblingOptions(Strategy.parse("none")), len(tokens))
        out = list(gen.tokens(tokens))
        report, stats = gen.report(), gen.stats
        forced = pebbled.generation(options, PebblingOptions(Strategy.parse("none")), len(tokens))
        steps = forced_steps(forced, tokens, reference["tokens"], len(reference_steps))
    finally:
        loaded.pebbled.close()
    ties = compare(reference["tokens"], reference_steps, steps, tolerance)
    return {"weights": weights, "tokens": out, "tokens_equal": out == reference["tokens"], **ties,
            "layer_weight_bytes": pebbled.weight_bytes, "measured_peak_bytes": report["measured_peak_bytes"],
            "estimated_peak_bytes": report["estimated_peak_bytes"],
            "decode_tokens_per_s": decode_rate(stats)}


def parted_at_near_ties_only(other: dict[str, Any]) -> bool:
    """The other form's tokens are the reference's, or, fed the reference's tokens, it chose differently
    somewhere and only where the reference's logits lie within the tie tolerance."""
    return other["tokens_equal"] or bool(other["near_ties"]) and other["choices_agree_within_tolerance"]


def render(r: dict[str, Any]) -> str:
    rows, how = r["strategies"], r["measured_peak_how"]
    peak_label = how.split(" ", 1)[0]  # "measured" on the GPU, "byte-accounted" on host and stub
    table = []
    for name, s in rows.items():
        rate = "n/a" if s["decode_tokens_per_s"] is None else f"{s['decode_tokens_per_s']:.1f}"
        slowdown = "n/a" if s["slowdown"] is None else f"{s['slowdown']:.2f}x"
        equal = "yes (reference)" if name == "none" else "yes" if s["tokens_equal"] else "NO"
        table.append([name, f"{s['resident_layers']}/{s['n_layers']}",
                      format_bytes(s["measured_peak_bytes"]), format_bytes(s["estimated_peak_bytes"]),
                      f"{s['reduction_pct']:.1f}%", rate, slowdown, equal])
    n = rows["none"]["generated_tokens"]
    lines = [f"{r['model']}: {r['n_layers']} layers, store backend {r['backend']}, weights {r['weights']}"]
    if r["random_weights"]:
        lines.append("This demo model has RANDOM WEIGHTS: its text is noise, but the check below means "
                     "the same as on a real model.")
    lines += [
        f"Prompt {r['prompt']!r} ({r['prompt_tokens']} tokens with the chat template); each strategy "
        f"generates {n} tokens from it greedily (temperature 0), num_ctx {r['num_ctx']}, and must produce "
        "exactly the tokens of `none`, which keeps every layer resident.",
        "",
        format_table(["strategy", "resident", f"peak ({peak_label})", "peak (estimate)", "vs none",
                      "decode tok/s", "slowdown", "tokens equal none"], table),
        "",
        f"peak: {how}.",
        "peak (estimate): the plan's figure, from the model's shape and this prompt's length, before "
        "the run.",
        "decode tok/s: tokens generated / decode time in this run (Ollama's eval rate); "
        "slowdown: none's rate / this rate.",
        f"adaptive: budget {format_bytes(r['adaptive_budget_bytes'])}, keeps "
        f"{rows['adaptive']['resident_layers']} of {r['n_layers']} layers resident.",
        "",
    ]
    other = r.get("other_weights")
    tied = other and not other["tokens_equal"] and parted_at_near_ties_only(other)
    if other:
        rate = "n/a" if other["decode_tokens_per_s"] is None else f"{other['decode_tokens_per_s']:.1f} tok/s"
        lines += [f"weights {other['weights']} (none): layers hold {format_bytes(other['layer_weight_bytes'])}, "
                  f"peak {format_bytes(other['measured_peak_bytes'])} ({peak_label}), decode {rate}; tokens "
                  f"equal weights {r['weights']}: "
                  + ("yes" if other["tokens_equal"] else "no, at near-ties" if tied else "NO"),
                  describe_ties(other, r["weights"]) + ".", ""]
    differ = [name for name, s in rows.items() if not s["tokens_equal"]]
    if other and not other["tokens_equal"] and not tied:
        differ.append(f"none with weights {other['weights']} (beyond --tie-tolerance {other['tie_tolerance']:g}: "
                      "see above)")
    if differ:
        lines.append(f"FAILED: {', '.join(differ)} produced tokens different from none's.")
    else:
        also = "" if not other else (
            f", and none with weights {other['weights']} parted from them only at near-ties within "
            f"--tie-tolerance {other['tie_tolerance']:g}" if tied else
            f", and so did none with weights {other['weights']}")
        lines.append(f"OK: all {len(rows)} strategies produced the same {n} tokens{also}.")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PebblingError("--plot needs matplotlib: pip install matplotlib (or, from the repository, "
                            "pip install '.[plot]')") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as pyplot

    return pyplot


def plot(r: dict[str, Any], path: str, pyplot) -> None:
    names = list(r["strategies"])
    rows = [r["strategies"][n] for n in names]
    peak_label = r["measured_peak_how"].split(" ", 1)[0]
    fig, (memory, speed) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(names))
    memory.bar(x, [s["measured_peak_bytes"] / 2**20 for s in rows], color="tab:blue", label=peak_label)
    memory.scatter(x, [s["estimated_peak_bytes"] / 2**20 for s in rows], color="black", marker="_", s=400,
                   zorder=3, label="estimate")
    memory.set(title="peak device memory", ylabel="MiB", xticks=list(x), xticklabels=names)
    memory.legend()
    speed.bar(x, [s["decode_tokens_per_s"] or 0 for s in rows], color="tab:orange")
    speed.set(title="decode speed (measured)", ylabel="tokens/s", xticks=list(x), xticklabels=names)
    random = ", random weights" if r["random_weights"] else ""
    n = r["strategies"]["none"]["generated_tokens"]
    fig.suptitle(f"{r['model']}{random}: backend {r['backend']}, {n} greedy tokens, num_ctx {r['num_ctx']}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise PebblingError(f"--plot {path}: cannot write the file: {exc.strerror or exc}") from None
    finally:
        pyplot.close(fig)
