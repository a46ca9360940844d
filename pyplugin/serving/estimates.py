"""A model's estimate for the HTTP API (/api/pebbling/estimate): `pebbling estimate`'s figures
(runtime/estimate.py), every strategy's estimated peak and adaptive's budgets with the speed predicted at
each, for the web page's chart.

The prediction needs a restore and a layer measured through a store, so the model is read into a store of
its own for it, as the command reads it, beside any copy the engine has loaded (whose store and worker it
leaves alone), and closed after. One estimate runs at a time, and what it found is kept for the same model
file and options while the server runs: a page drawn again costs nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping

from ..errors import OptionsError
from ..model import load_model
from ..runtime import Options, PebbledModel, PebblingOptions
from ..runtime.estimate import estimate
from .catalogue import ServerBusyError, model_errors, with_tag
from .jobs import GenerationRequest
from .modelfile import with_layers

# The options that shape an estimate; any other is refused, since it would change nothing.
ESTIMATE_OPTIONS = ("num_ctx", "num_batch", "pebbling_memory_limit", "pebbling_weights", "pebbling_kv_type",
                    "pebbling_expert_cache", "pebbling_expert_prefetch")
KEPT = 16              # estimates remembered
WAIT_SECONDS = 120.0   # how long a request waits for the estimate running before it is told the server is busy

_lock = threading.Lock()
_kept: OrderedDict[tuple, dict[str, Any]] = OrderedDict()


def estimate_model(engine: Any, name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The estimate of model `name` (an Engine's) for Ollama-style `options` (those of ESTIMATE_OPTIONS):
    `pebbling estimate`'s JSON, with the model's name and no path. Raises OptionsError for a bad option
    (400), ModelNotFoundError (404), ModelLoadError, ServerBusyError while another estimate runs too long."""
    if options is not None and not isinstance(options, Mapping):
        raise OptionsError(f"'options' must be an object, got {type(options).__name__}")
    given = dict(options or {})
    if unknown := sorted(set(given) - set(ESTIMATE_OPTIONS)):
        raise OptionsError(f"option {unknown[0]!r} does not shape an estimate; accepted: {', '.join(ESTIMATE_OPTIONS)}")
    path, layers = engine.find(name)
    # The Modelfile's parameters (its num_ctx, say) under the request's, as a generation takes them.
    merged = with_layers(GenerationRequest(model=name, options=given), layers).options
    given = {k: v for k, v in merged.items() if k in ESTIMATE_OPTIONS}
    pebbling = PebblingOptions.from_options(given)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, engine.backend, engine.max_context,
           tuple(sorted((k, repr(v)) for k, v in given.items())))
    if not _lock.acquire(timeout=WAIT_SECONDS):
        raise ServerBusyError("the server is busy estimating another model; try again later")
    try:
        if key in _kept:
            _kept.move_to_end(key)
            return _kept[key]
        with model_errors(name, path):
            model = load_model(path, weights=pebbling.effective_weights, progress=False)
        pebbled = PebbledModel(model, backend=engine.backend, keep_host_weights=False)  # each layer held once
        try:
            opts = Options.from_dict(given, n_ctx_train=model.config.n_ctx_train, max_ctx=engine.max_context,
                                     head_dim=model.config.head_dim)
            found = {"model": with_tag(name), **estimate(pebbled, opts, pebbling.memory_limit, None,
                                                         pebbling=pebbling)}
        finally:
            pebbled.close()
        _kept[key] = found
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
        return found
    finally:
        _lock.release()
