"""`pebbling run MODEL [PROMPT]`: one answer, or a chat when no prompt is given, streamed to the
terminal as `ollama run` does. A `pebbling serve` that answers on $PEBBLING_HOST does the work; when
none answers the model is loaded in this process."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import OptionsError, PebblingError
from ..runtime import Options
from ..serving.jobs import KEEP_ALIVE_HELP, parse_keep_alive, spelled_duration
from .backends import Local, Remote, looks_like_path
from .client import Client
from .common import add_pebbling_arguments, format_duration, pebbling_options

# Flags that become Ollama options: (flag's dest, option name).
SAMPLING_FLAGS = (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                  ("repeat_penalty", "repeat_penalty"), ("seed", "seed"), ("num_predict", "num_predict"),
                  ("num_ctx", "num_ctx"), ("num_batch", "num_batch"), ("stop", "stop"))

DESCRIPTION = """\
Generate text from MODEL: a GGUF file, pebbling-demo, NAME[:TAG] from the models directory, or a
model in Ollama's store (me/mario:7b, registry.ollama.ai/library/llama3.2:latest).

With PROMPT (or text on stdin), print one answer and exit. Without either, chat: type a message, or
/? for the chat's commands; /bye or Ctrl-D ends it.

When a pebbling server (pebbling serve) answers on $PEBBLING_HOST (default 127.0.0.1:11435) it does the work and
keeps the model loaded between runs; otherwise the model is loaded in this process."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="chat with a model, or answer one prompt",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file, pebbling-demo, NAME[:TAG] or an Ollama model name")
    # default=[]: without one, argparse reports the optional PROMPT as required when MODEL is missing
    p.add_argument("prompt", nargs="*", default=[], help="the message (several words are joined by spaces); "
                                             "text on stdin comes before it")
    p.add_argument("--system", metavar="TEXT", help="the system message")
    g = p.add_argument_group("sampling (Ollama's options; the model's own defaults when not given)")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens; 0 = all (default 40)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling; 1 = off (default 0.9)")
    g.add_argument("--repeat-penalty", type=float, metavar="R", help="1 = off (default 1.1)")
    g.add_argument("--seed", type=int, help="makes sampling reproducible")
    g.add_argument("--num-predict", type=int, metavar="N", help="most tokens to generate (-1 = no limit, "
                                                                "-2 = fill the context)")
    g.add_argument("--num-ctx", type=int, metavar="N", help="context length in tokens (default 2048)")
    g.add_argument("--num-batch", type=int, metavar="N", help="prompt tokens per prefill chunk (default 512)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop before this text (repeat for more)")
    p.add_argument("--format", choices=("json",), help="answer in JSON (constrained decoding)")
    p.add_argument("--keepalive", metavar="DURATION",
                   help="how long the server keeps the model loaded after the answer: " + KEEP_ALIVE_HELP
                        + ', or in words ("5 minutes")')
    p.add_argument("--raw", action="store_true", help="with PROMPT: send it as it is, without the chat template")
    p.add_argument("--think", nargs="?", const="true", choices=THINK_CHOICES, metavar="true|false|low|medium|high",
                   help="thinking on (alone or true), off (false), or gpt-oss's reasoning effort; the model's "
                        "thinking is printed before its answer, as Ollama prints it")
    p.add_argument("--hidethinking", action="store_true", help="think, but print only the answer")
    p.add_argument("--verbose", action="store_true", help="after each answer, print timings and the pebbling "
                                                          "report to stderr")
    add_pebbling_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Every flag is checked before anything is loaded or sent.
    options = options_from_args(args)
    if args.keepalive is not None:
        given, args.keepalive = args.keepalive, spelled_duration(args.keepalive)  # "5 minutes": "5m"
        try:
            parse_keep_alive(args.keepalive)
        except OptionsError:
            raise PebblingError(f"--keepalive {given!r}: not a duration; accepted: {KEEP_ALIVE_HELP}, "
                                "or in words (\"5 minutes\")") from None
    prompt = " ".join(args.prompt)
    piped = _piped_text()
    if piped is not None:  # as Ollama: piped text is the prompt (then the words given), and no chat
        prompt = " ".join(part for part in (piped, prompt) if part)
        if not prompt.strip():
            raise PebblingError("stdin was empty and no PROMPT was given: nothing to answer")
    elif not prompt and args.raw:
        raise PebblingError("--raw needs a PROMPT: a chat always uses the model's template")
    backend = connect(args.model, args.backend)
    try:
        info = backend.show(args.model)  # an unknown model is named before anything else is printed
        if info.get("model_info", {}).get("pebbling.random_weights"):
            print(f"(random weights) {args.model}: the text below is noise", file=sys.stderr)
        think = {"true": True, "false": False}.get(args.think, args.think)
        session = Session(backend, args.model, options, system=args.system, format=args.format,
                          keep_alive=args.keepalive, verbose=args.verbose, think=think,
                          hide_thinking=args.hidethinking)
        if prompt:
            session.answer(prompt, raw=args.raw)
            return 0
        from .chat import chat

        return chat(session)
    finally:
        backend.close()


def _piped_text() -> str | None:
    """What stdin holds when it is not a terminal; None when it is one (a chat can be had). A stdin
    that cannot be read (closed, or held by a test runner) holds nothing."""
    if sys.stdin is None:
        return ""
    try:
        return None if sys.stdin.isatty() else sys.stdin.read()
    except (OSError, ValueError):
        return ""


def connect(model: str, store_backend: str | None) -> Remote | Local:
    """The server on $PEBBLING_HOST if it answers, else an engine in this process. A model given as a
    file is always loaded here: the server takes names, never paths, from its clients."""
    client = Client()
    if Path(model).expanduser().is_file() or looks_like_path(model):
        if client.answers():
            print(f"pebbling: note: {model} is a file, loaded in this process; the server at {client.address.url} "
                  "serves names (put the file in its models directory to serve it)", file=sys.stderr)
    elif client.answers():
        if store_backend is not None:
            print(f"pebbling: note: --backend {store_backend} applies to a model loaded in this process; "
                  f"the server at {client.address.url} uses its own", file=sys.stderr)
        return Remote(client)
    client.close()
    return Local(store_backend)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Ollama's options from the flags given, each checked alone so that an error names its flag."""
    options: dict[str, Any] = {}
    for dest, name in SAMPLING_FLAGS:
        value = getattr(args, dest)
        if value is None:
            continue
        try:
            Options.from_dict({name: value})
        except OptionsError as exc:
            flag = "--" + dest.replace("_", "-")
            accepted = str(exc).partition("accepted: ")[2] or str(exc)
            raise PebblingError(f"{flag} {value}: not accepted; accepted: {accepted}") from None
        options[name] = value
    pebbling = pebbling_options(args.pebbling_strategy, args.pebbling_memory_limit, args.pebbling_weights)
    if args.pebbling_strategy is not None:
        options["pebbling_strategy"] = args.pebbling_strategy
    if pebbling.memory_limit is not None:
        options["pebbling_memory_limit"] = pebbling.memory_limit
    options["pebbling_weights"] = pebbling.effective_weights
    return options


class Session:
    """A conversation with one model: its options, system message and history, whichever backend answers."""

    def __init__(self, backend: Remote | Local, model: str, options: dict[str, Any], *, system: str | None = None,
                 format: str | None = None, keep_alive: str | None = None, verbose: bool = False,
                 think: bool | str | None = None, hide_thinking: bool = False):
        self.backend, self.model, self.options = backend, model, dict(options)
        self.system, self.format, self.keep_alive, self.verbose = system, format, keep_alive, verbose
        self.think, self.hide_thinking = think, hide_thinking
        self.messages: list[dict[str, str]] = []  # the turns so far, without the system message

    def body(self, **fields) -> dict[str, Any]:
        body = {"model": self.model, "options": self.options, **fields}
        if self.format:
            body["format"] = self.format
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        if self.think is not None:
            body["think"] = self.think
        return body

    def answer(self, prompt: str, *, raw: bool = False) -> str:
        """One turn: the reply streamed to stdout, kept in the history, then the timings when verbose."""
        if raw:
            items = self.backend.generate(self.body(prompt=prompt, raw=True))
        else:
            system = [{"role": "system", "content": self.system}] if self.system else []
            turn = {"role": "user", "content": prompt}
            items = self.backend.chat(self.body(messages=system + self.messages + [turn]))
        pieces, final, thinking = [], None, _Thinking(self.hide_thinking)
        try:
            for item in items:
                if item.get("done"):
                    final = item
                    break
                part = item["message"] if "message" in item else item
                thinking.write(part.get("thinking", ""))
                text = part.get("content", part.get("response", ""))
                if text:
                    thinking.close()
                pieces.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
        finally:
            items.close()
            thinking.close()
            sys.stdout.write("\n")
            sys.stdout.flush()  # the text, then the timings: stdout and stderr may share a terminal
        reply = "".join(pieces)
        if not raw:
            self.messages += [turn, {"role": "assistant", "content": reply}]
        if self.verbose and final is not None:
            print_verbose(final)
        return reply


THINK_CHOICES = ("true", "false", "low", "medium", "high")


class _Thinking:
    """A reply's thinking as Ollama's CLI prints it: "Thinking...", the thinking (dim on a terminal), then
    "...done thinking." before the answer; nothing where hidden or where the reply has none."""

    def __init__(self, hidden: bool):
        self.hidden, self.state = hidden, "before"   # before -> open -> closed
        self.dim = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"

    def write(self, text: str) -> None:
        if not text or self.hidden or self.state == "closed":
            return
        if self.state == "before":
            sys.stdout.write("Thinking...\n" + ("\x1b[2m" if self.dim else ""))
            self.state = "open"
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        if self.state == "open":
            sys.stdout.write(("\x1b[0m" if self.dim else "") + "\n...done thinking.\n\n")
            sys.stdout.flush()
        self.state = "closed"


def print_verbose(final: dict[str, Any]) -> None:
    """Ollama's `run --verbose` timings, then the pebbling report, to stderr."""
    from ..runtime.plan import format_bytes

    def rate(tokens: int, ns: int) -> str:
        return f"{tokens / (ns / 1e9):.2f} tokens/s" if ns else "n/a"

    lines = [
        ("total duration", format_duration(final.get("total_duration", 0))),
        ("load duration", format_duration(final.get("load_duration", 0))),
        ("prompt eval count", f"{final.get('prompt_eval_count', 0)} token(s)"),
        ("prompt cached", f"{(final.get('pebbling') or {}).get('cached_tokens', 0)} token(s) (from the last turn)"),
        ("prompt eval duration", format_duration(final.get("prompt_eval_duration", 0))),
        ("prompt eval rate", rate(final.get("prompt_eval_count", 0), final.get("prompt_eval_duration", 0))),
        ("eval count", f"{final.get('eval_count', 0)} token(s)"),
        ("eval duration", format_duration(final.get("eval_duration", 0))),
        ("eval rate", rate(final.get("eval_count", 0), final.get("eval_duration", 0))),
    ]
    report = final.get("pebbling")
    if report:
        lines += [
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
    sys.stderr.flush()
