"""Serving: the engine that loads models on demand, queues their requests and keeps them for their
keep_alive; the jobs that carry a request to a model's worker; the reply's thinking and tool calls; the
model catalogue (files, the demo and Ollama's store) and what writes that store (create, copy, delete,
pull). The HTTP server (server_patch) uses the names listed here and nothing else of pyplugin.
"""

from ..errors import OptionsError, PebblingError, StrategyError
from ..model import ChatTemplateError
from .catalogue import ModelListing, ModelLoadError, ModelNotFoundError, RunningModel, ServerBusyError
from .create import CreateSpec, copy_model, create_model
from .engine import Engine
from .estimates import ESTIMATE_OPTIONS, estimate_model
from .jobs import Final, GenerationRequest, Job
from .ollama_store import InvalidModelName, ModelLayers
from .pull import REGISTRY_ENV, PullStopped, pull_model
from .reply import Output
from .store_write import (BlobWriter, ModelNotInStore, RegistryError, StoreError, StoreWriteError, blob_path,
                          delete_model)
from .tool_calls import CutCall, ToolCall
from .settings import HOST_ENV, ORIGINS_ENV, is_loopback

__all__ = [
    "BlobWriter", "ChatTemplateError", "CreateSpec", "CutCall", "ESTIMATE_OPTIONS", "Engine", "Final",
    "GenerationRequest", "HOST_ENV", "InvalidModelName", "Job", "ModelLayers", "ModelListing", "ModelLoadError",
    "ModelNotFoundError", "ModelNotInStore", "ORIGINS_ENV", "OptionsError", "Output", "PebblingError", "PullStopped",
    "REGISTRY_ENV", "RegistryError", "RunningModel", "ServerBusyError", "StoreError", "StoreWriteError",
    "StrategyError", "ToolCall", "blob_path", "copy_model", "create_model", "delete_model", "estimate_model",
    "is_loopback", "pull_model",
]
