"""Model names -> GGUF files.

A name resolves, in order, to:
1. an existing file path;
2. ``pebbling-demo``: a random-weight Llama that pyplugin.synth writes into pebbling's cache
   (``demo_dir``: never a user's models directory) the first time it is asked for;
3. ``NAME`` or ``NAME:TAG`` in the models directory (``default_models_dir``: $PEBBLING_MODELS, else
   ./models where it is a directory, else ~/.cache/pebbling/models; callers may pass another), stored as
   NAME.gguf or NAME:TAG.gguf;
4. Ollama's local store (``find_in_ollama_store``), for any name Ollama's rules accept, namespaced or not.
``locate`` gives the file with the Modelfile layers Ollama's store holds for it (none elsewhere): the one
lookup every caller goes through.
A name that is not an existing path and could be read as one (a separator, '..') never reaches the
file system as a models-directory lookup.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path

from ..errors import ModelError
from . import ollama_store
from .ollama_store import ModelLayers, OllamaModel

MODELS_ENV = "PEBBLING_MODELS"
LOCAL_MODELS = "models"  # the directory `make serve` fills and serves, in the directory it runs in
CACHE_ENV = "PEBBLING_CACHE"
DEMO_NAME = "pebbling-demo"

# The demo: small enough to write in a couple of seconds, deep enough (16 layers) to stream.
DEMO_SPEC = dict(arch="llama", n_layer=16, n_embd=256, n_head=8, n_head_kv=4, n_ff=768, n_ctx=4096,
                 vocab="llama3", n_merges=500, weight_type="Q8_0",
                 tensor_types={"token_embd": "F16", "output": "F16"}, seed=20240517,
                 name="pebbling-demo (random weights)",
                 description="pebbling's demo model: a 16-layer Llama with RANDOM WEIGHTS. It "
                             "exercises loading, planning and streaming; its text is noise.")

# What a models-directory name may contain: no separators, no leading dot (so never '.' or '..').
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*(:[A-Za-z0-9_][A-Za-z0-9_.\-]*)?")


def default_models_dir() -> Path:
    """The one models directory every command and the server share: $PEBBLING_MODELS, else ./models where
    it is a directory (what `make serve` fills and serves, so that `pebbling estimate smollm2:135m` run
    beside it finds what it serves), else ~/.cache/pebbling/models (it need not exist). Absolute, so
    that it stays the same directory for a process that changes its directory (a Ray replica)."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return Path(env).expanduser().absolute()
    try:
        local = Path.cwd() / LOCAL_MODELS
    except OSError:  # the working directory was removed
        local = None
    return local if local is not None and local.is_dir() else Path.home() / ".cache" / "pebbling" / "models"


def demo_dir() -> Path:
    """Where pebbling writes the files it makes itself (the demo model): $PEBBLING_CACHE, else
    $XDG_CACHE_HOME/pebbling, else ~/.cache/pebbling (it need not exist)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pebbling"


def resolve(name: str | os.PathLike, models_dir: str | os.PathLike | None = None, *,
            allow_paths: bool = True) -> Path:
    """The GGUF file ``name`` stands for; ModelError when there is none.

    ``allow_paths=False`` (for names that arrive over the network) skips step 1: only names.
    """
    return locate(name, models_dir, allow_paths=allow_paths)[0]


def locate(name: str | os.PathLike, models_dir: str | os.PathLike | None = None, *,
           allow_paths: bool = True) -> tuple[Path, ModelLayers]:
    """The GGUF file ``name`` stands for and its Modelfile layers (empty outside Ollama's store)."""
    if allow_paths and (isinstance(name, os.PathLike) or Path(str(name)).is_file()):
        return Path(name), ModelLayers()
    name = str(name)
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    if name in (DEMO_NAME, f"{DEMO_NAME}:latest"):
        return ensure_demo(), ModelLayers()  # pebbling's own file, wherever the models directory is
    if _NAME.fullmatch(name) and ".." not in name:
        found = _in_models_dir(name, root)
        if found is not None:
            return found, ModelLayers()
    store_name = _ollama_name(name)
    if store_name:
        in_store = find_in_ollama_store(name)
        if in_store is not None:
            return in_store.path, in_store.layers
        if "/" in name:  # namespaced: a name only Ollama's store could hold
            raise NotFoundError(f"model {name!r} not found: not a file, and not in Ollama's local store")
    if "/" in name or os.sep in name or name.endswith(".gguf"):
        raise NotFoundError(f"model {name!r} not found: no such file")
    raise NotFoundError(f"model {name!r} not found: not a file, not {DEMO_NAME!r}, not in {root} "
                     f"(as NAME.gguf or NAME:TAG.gguf; set ${MODELS_ENV} to look elsewhere), "
                     "and not in Ollama's local store")


def _ollama_name(name: str) -> bool:
    """Whether Ollama's name rules accept `name` (so it may be looked up in its store)."""
    try:
        ollama_store.parse_name(name)
    except ModelError:
        return False
    return True


class NotFoundError(ModelError, LookupError):
    """Nothing has that name (a ModelError of any other kind: something has it and cannot be read)."""


class LinkOutsideError(ModelError):
    """A name in the models directory is a link to a file outside it: refused."""


def _in_models_dir(name: str, root: Path) -> Path | None:
    model, _, tag = name.partition(":")
    candidates = [f"{name}.gguf"]
    if tag in ("", "latest"):  # 'x' and 'x:latest' name the same model, as in Ollama
        candidates += [f"{model}.gguf", f"{model}:latest.gguf"]
    for candidate in dict.fromkeys(candidates):
        path = root / candidate
        if path.is_file():
            if not path.resolve().is_relative_to(root.resolve()):
                # A link to elsewhere could make a server read, and name in its errors, any file.
                raise LinkOutsideError(f"model {name!r}: {candidate} in the models directory is a link to a "
                                       "file outside it, which is not served; copy the file in, or serve the "
                                       f"directory it is in (--models or ${MODELS_ENV})")
            return path
    return None


def find_in_ollama_store(name: str) -> OllamaModel | None:
    """The model ``name`` names in Ollama's local store (its GGUF blob and Modelfile layers), or None."""
    return ollama_store.resolve(name)


def ensure_demo(directory: str | os.PathLike | None = None) -> Path:
    """The demo model's file in `directory` (default ``demo_dir()``), written on first use. Each writer
    writes a temporary file of its own and renames it into place, so a reader never sees a partial file
    and writers never share one: the threads of a server loading it for concurrent requests, and the
    processes of several servers (Ray replicas) sharing one cache, each end with the same whole file."""
    root = Path(directory) if directory is not None else demo_dir()
    path = root / f"{DEMO_NAME}.gguf"
    if path.is_file():
        return path
    with _DEMO_LOCK:  # one writer per process; the threads waiting here find the file written
        if path.is_file():
            return path
        _write_demo(root, path)
    return path


_DEMO_LOCK = threading.Lock()


def _write_demo(root: Path, path: Path) -> None:
    from ..model.synth import write_gguf  # only needed the first time

    partial = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=root, prefix=f".{DEMO_NAME}.", suffix=".partial")
        os.close(handle)
        partial = Path(name)
        write_gguf(partial, **DEMO_SPEC)
        os.replace(partial, path)  # the same bytes whoever renames last (the demo's seed is fixed)
    except OSError as exc:
        raise ModelError(f"cannot write the demo model into {root}: {exc.strerror or exc}; "
                         f"set ${CACHE_ENV} to a writable directory") from None
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)


def available(models_dir: str | os.PathLike | None = None) -> list[str]:
    """Names resolvable from the models directory, plus the demo."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    names = {DEMO_NAME}
    if root.is_dir():
        names.update(p.stem for p in root.glob("*.gguf") if _NAME.fullmatch(p.stem))
    return sorted(names)
