"""What the tests share: the store backends to run on, and tiny synthetic GGUF models.

A plain module, not a conftest: pytest puts tests/ on sys.path (rootdir insertion), so the test files
import it as ``from helpers import ...``. Files and loaded models are cached for the session.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import requests
import pytest
import requests
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from pyplugin.ggml_types import SUPPORTED_NAMES
from pyplugin.model import Model, load_model
from pyplugin.model.synth import SynthSpec, write_gguf
from pyplugin.model.synth_mix import quantize_mix
from pyplugin.store import BACKENDS, probe


def store_backend_params(names=BACKENDS) -> list:
    """cuda, host and stub (or those of `names`: a test that means nothing on some backend leaves it out
    rather than skipping it there) as pytest params; one that is absent here, or left out by
    PEBBLING_TEST_BACKENDS (a comma list, e.g. "host" for the sanitizer run), is skipped with the reason."""
    listed = os.environ.get("PEBBLING_TEST_BACKENDS", "")
    wanted = {name.strip().lower() for name in listed.split(",") if name.strip()} or set(BACKENDS)
    unknown = wanted - set(BACKENDS)
    if unknown:
        raise ValueError(f"PEBBLING_TEST_BACKENDS={listed!r} names {sorted(unknown)}; valid: "
                         f"{', '.join(BACKENDS)}")
    params = []
    for name in (n for n in BACKENDS if n in names):
        marks = [pytest.mark.gpu] if name == "cuda" else []
        if name not in wanted:
            marks.append(pytest.mark.skip(reason=f"left out by PEBBLING_TEST_BACKENDS={listed}"))
        else:
            found = probe(name)
            if not found.usable:
                marks.append(pytest.mark.skip(reason=f"{name} backend unavailable: {found.reason}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


# ---------------------------------------------------------------------------------------------------
# tiny models

ARCHS = ("llama", "qwen2", "phi3")
TYPES = SUPPORTED_NAMES
VOCAB_OF_ARCH = {"llama": "llama3", "qwen2": "chatml", "phi3": "spm", "qwen3": "qwen3", "gemma2": "gemma",
                 "gemma3": "gemma", "qwen2moe": "chatml", "qwen3moe": "qwen3",
                 "gpt-oss": "chatml", "gemma4": "gemma4"}

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256, n_merges=200)
# K-quants and IQ4_XS pack 256 values per block, so every row (n_embd, n_ff) must be a multiple of 256.
TINY_256 = dict(TINY, n_layer=1, n_embd=256, n_ff=256)

# Files mixed as llama-quantize writes them (pyplugin.model.synth_mix), each a tiny model whose shape lets its
# rules show: Q3_K_M's ffn_down takes Q5_K in the first n_layer/16 layers (16 layers: the first), Q2_K's
# attn_v Q4_K where four query heads share a KV head, and IQ4_XS's rows of 320 values (not whole 256-value
# blocks) fall back to IQ4_NL, its first layer's Q5_K to Q5_1.
# MXFP4_MOE, gpt-oss's mix, puts the experts of a qwen3moe in MXFP4 and every other matrix in Q8_0.
MIX_SHAPES = {"Q3_K_M": dict(n_layer=16, n_embd=256, n_ff=256, n_head=4, n_head_kv=2),
              "Q2_K": dict(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=1),
              "IQ4_XS": dict(n_layer=8, n_embd=256, n_ff=320, n_head=4, n_head_kv=2),
              "MXFP4_MOE": dict(n_layer=2, n_embd=64, n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=64,
                                key_length=32)}
MIX_ARCHS = {"MXFP4_MOE": "qwen3moe"}  # the others: llama

_DIR = tempfile.TemporaryDirectory(prefix="pebbling-model-tests-")


FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: their matvec takes x as it is


def quantizes_x(backend: str, qtype: int) -> bool:
    """Whether the backend's matvec multiplies x quantized to 8-bit blocks (pebble.h): the host library's
    for every quantized type; the cuda library's too, its integer kernel (unless PEBBLING_CUDA_MATVEC=float),
    which quantizes x as the host does; the stub's never."""
    if backend == "cuda" and os.environ.get("PEBBLING_CUDA_MATVEC") == "float":
        return False
    return backend in ("host", "cuda") and int(qtype) not in FLOAT_TYPES


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """nbytes of random bytes, the same for the same seed: what a store test saves and expects back."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def restored(store, layer: int, tensor_id: int) -> np.ndarray:
    """The whole entry (layer, tensor_id) of `store`, restored into a new uint8 array."""
    out = np.empty(store.entry_info(layer, tensor_id).nbytes, dtype=np.uint8)
    store.restore(layer, tensor_id, out)
    return out


def to_host(array) -> np.ndarray:
    """A numpy copy of a numpy or CuPy array."""
    return array.get() if hasattr(array, "get") else np.asarray(array)


def blocks_of_256(type_name: str | None) -> bool:
    """Whether a GGUF type (by name) packs 256 values per block (the K-quants, IQ4_XS, most IQ types)."""
    return type_name in GGMLQuantizationType.__members__ and \
        GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0] == 256


def tiny_spec(arch: str = "llama", **overrides) -> SynthSpec:
    base = TINY_256 if blocks_of_256(overrides.get("weight_type")) else TINY
    return SynthSpec(**{"arch": arch, "vocab": VOCAB_OF_ARCH[arch], **base, **overrides})


def mix_overrides(mix: str, arch: str | None = None, **shape) -> dict:
    """tiny_path/tiny_model overrides for a file of llama-quantize's `mix` (synth_mix) of that architecture
    and shape (by default MIX_ARCHS' and MIX_SHAPES')."""
    arch, shape = arch or MIX_ARCHS.get(mix, "llama"), shape or MIX_SHAPES[mix]
    spec = quantize_mix(tiny_spec(arch, **shape), mix)
    return dict(shape, weight_type=spec.weight_type, tensor_types=spec.tensor_types)


def tiny_path(arch: str = "llama", **overrides) -> Path:
    """A GGUF file for the spec, written once per session."""
    return _write(tiny_spec(arch, **overrides))


def tiny_model(arch: str = "llama", *, weights: str = "f16", **overrides) -> Model:
    """The loaded model for the spec, loaded once per session and weight form (treat it as read-only).
    The default form here is `f16` (float32 arrays on the host), which the reference tests compare
    element by element; pass weights="quantized" for matrices kept in their GGUF form."""
    return _load(tiny_spec(arch, **overrides), weights)


_paths: dict[str, Path] = {}     # keyed by repr(spec): a spec holds a dict, so it is not hashable
_models: dict[str, Model] = {}


def _write(spec: SynthSpec) -> Path:
    key = repr(spec)
    if key not in _paths:
        _paths[key] = write_gguf(Path(_DIR.name) / f"model-{len(_paths)}.gguf", spec)
    return _paths[key]


def _load(spec: SynthSpec, weights: str) -> Model:
    key = f"{weights} {spec!r}"
    if key not in _models:
        _models[key] = load_model(_write(spec), weights=weights, progress=False)
    return _models[key]


def script_replies(monkeypatch, models_dir: Path):
    """`write(model, text)`: the next generations on `model` (a file in models_dir) write `text` and end,
    token by token through the real generation and streaming, for replies a tiny random model would not
    write by itself (a tool call, a thinking part); returns the tokens it takes with the end."""
    from pyplugin.model import GGUFFile, Tokenizer
    from pyplugin.runtime.generation import Generation

    script: dict = {}
    real = Generation.sample

    def sample(self, logits, history):
        if "ids" not in script:
            return real(self, logits, history)
        n = len(self.generated)
        return script["ids"][n] if n < len(script["ids"]) else min(self.model.tokenizer.eog_ids)

    def write(model: str, text: str) -> int:
        with GGUFFile(models_dir / f"{model}.gguf") as f:  # the tokenizer alone: no weights loaded
            tokenizer = Tokenizer.from_metadata(f.metadata, model)
        script["ids"] = tokenizer.encode_fragment(text)
        return len(script["ids"]) + 1

    monkeypatch.setattr(Generation, "sample", sample)
    return write


def craft(base: Path, path: Path, tensor: str, qtype: int | None, ne: tuple[int, ...]) -> Path:
    """A copy of `base` whose tensor `tensor` claims type `qtype` and shape `ne`, written into its header in
    place (the data section stays as it was)."""
    shutil.copy(base, path)
    reader = GGUFReader(path, "r+")
    parts = next(t for t in reader.tensors if t.name == tensor).field.parts
    assert len(parts[3]) == len(ne), "the crafted shape keeps the number of dimensions"
    parts[3][:] = ne
    if qtype is not None:
        parts[4][:] = qtype
    reader.data.flush()
    del reader
    return path


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def free_port() -> int:
    """A loopback port nothing listens on now (bound, then let go): for a server to start on, or for a
    client to find nothing at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def pebbling_serve(models: Path, env: dict[str, str]) -> Iterator[tuple[str, dict, int]]:
    """`pebbling serve` in its own process (as a user runs it, so that its memory is its own) over `models`,
    with `env` added to this process's environment; yields its URL, the statuses its OpenAPI document lists
    ({path: {METHOD: {"200", ...}}}) and its process id. At the end it must stop cleanly when terminated.
    Its log goes to a file, never a pipe: a pipe nobody reads fills, and the server's next log line blocks it."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--host", "127.0.0.1", "--port",
                                    str(port), "--models", str(models), "--log-level", "warning"],
                                   stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **env})

        def logged() -> str:
            log.seek(0)
            return log.read()[-2000:]

        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    requests.get(url, timeout=5)
                    break
                except requests.ConnectionError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"pebbling serve did not start: {logged()}") from None
                    time.sleep(0.2)
            documented = {path: {m.upper(): set(ops[m]["responses"]) for m in ops}
                          for path, ops in requests.get(f"{url}/openapi.json", timeout=30).json()["paths"].items()}
            yield url, documented, process.pid
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            assert process.returncode in (0, -15), logged()


def rewrite_gguf(src, dst, *, drop=(), strings=None, tensors=None):
    """A copy of the GGUF file src without the keys and tensors in drop, with extra string keys and extra
    `tensors` (name -> float32 array)."""
    from gguf import GGUFReader, GGUFWriter
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    for t in reader.tensors:
        if t.name not in drop:
            raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def prompt_of(models, model: str, **request) -> str:
    """The prompt an Engine over the models directory evaluates for `request` on `model` (a file there), as
    text with its special tokens (and the one token it generates after)."""
    from pyplugin.model import load_model
    from pyplugin.serving import Engine, GenerationRequest
    engine = Engine(models)
    try:
        job = engine.submit(GenerationRequest(model=model, options={"num_predict": 1}, **request))
        job.result()
        return load_model(models / f"{model}.gguf", progress=False).tokenizer.decode(job.tokens, special=True)
    finally:
        engine.close()


QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


def api_chat(url: str, model: str, stream: bool = False, **body) -> Any:
    """POST /api/chat (QUESTION, 100 tokens, unless `body` says otherwise): the reply, or each streamed line's."""
    body = {"model": model, "messages": QUESTION, "stream": stream, "options": {"num_predict": 100}, **body}
    r = requests.post(f"{url}/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()] if stream else r.json()


def openai_chat(url: str, model: str, stream: bool = False, **body) -> Any:
    """POST /v1/chat/completions (QUESTION, 100 tokens, unless `body` says otherwise): the reply, or each streamed
    chunk."""
    body = {"model": model, "messages": QUESTION, "stream": stream, "max_tokens": 100, **body}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] if stream else r.json()
