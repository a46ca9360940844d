"""Serving: the engine that loads models on demand, queues their requests and keeps them for their
keep_alive; the jobs that carry a request to a model's worker; the reply's thinking and tool calls; the
model catalogue (files, the demo and Ollama's store). The HTTP server (server_patch) uses the names listed
here and nothing else of pyplugin.
"""

from ..errors import OptionsError, PebblingError, StrategyError
from ..model import ChatTemplateError
from .catalogue import ModelListing, ModelLoadError, ModelNotFoundError, RunningModel, ServerBusyError
from .engine import Engine
from .jobs import Final, GenerationRequest, Job
from .ollama_store import InvalidModelName, ModelLayers
from .reply import Output
from .tool_calls import ToolCall
from .settings import HOST_ENV, ORIGINS_ENV, is_loopback

__all__ = [
    "ChatTemplateError", "Engine", "Final", "GenerationRequest", "HOST_ENV", "InvalidModelName", "Job",
    "ModelLayers", "ModelListing", "ModelLoadError", "ModelNotFoundError", "ORIGINS_ENV", "OptionsError", "Output", "PebblingError",
    "RunningModel", "ServerBusyError", "StrategyError", "ToolCall", "is_loopback",
]
