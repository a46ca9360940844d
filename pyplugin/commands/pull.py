"""`pebbling pull NAME`: download a model from Ollama's registry (or $PEBBLING_REGISTRY) into Ollama's
store ($OLLAMA_MODELS, else ~/.ollama/models), where pebbling and Ollama both find it. A download that
breaks off is resumed by the next pull; every blob is checked against its sha256 digest."""

from __future__ import annotations

import sys

from tqdm import tqdm

from ..serving.pull import pull_model
from .common import plain


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("pull", help="download a model from a registry into Ollama's store",
                                   description=plain(__doc__))
    parser.add_argument("model", help="a name such as llama3.2:1b or namespace/model:tag")
    parser.add_argument("--insecure", action="store_true",
                        help="http:// for a name that carries its own registry host")
    parser.set_defaults(func=run)


def run(args) -> int:
    bars: dict[str, tqdm] = {}
    try:
        for update in pull_model(args.model, insecure=args.insecure):
            digest = update.get("digest")
            if digest and "total" in update:
                bar = bars.get(digest)
                if bar is None:
                    bar = bars[digest] = tqdm(total=update["total"], unit="B", unit_scale=True,
                                              desc=update["status"], file=sys.stderr, leave=True)
                bar.update(update.get("completed", 0) - bar.n)
            else:
                for bar in bars.values():
                    bar.close()
                print(update["status"], file=sys.stderr)
    finally:
        for bar in bars.values():
            bar.close()
    return 0
