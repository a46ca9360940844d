"""pebbling: run GGUF models in any GPU memory budget by streaming layer state between device memory
and pinned host memory.

Subpackages, each importing only those below it (tests/test_architecture.py checks it):
  model/     GGUF -> model, tokenizer, chat template, the pure forward pass (kernels come in as arguments)
  store/     the pebble store's interface, its backends as objects, the kernels
  runtime/   options, sampling, memory model and plan, generation, the pebbled model
  serving/   the engine (load, queue, keep_alive), jobs, the model catalogue
  commands/  the CLI's subcommands
with `errors`, `ggml_types` and `xp` as leaves every layer may use. Importing this package imports
none of them: `import pyplugin.model` does not load the store.
"""

from .errors import ModelError, OptionsError, PebbleError, PebblingError

__all__ = ["PebblingError", "PebbleError", "ModelError", "OptionsError"]
