"""The runtime: a request's options, its memory model and plan, sampling, the generation loop, and
the pebbled model where the plan, the store and the model meet."""

from .generation import Generation, GenerationStats, LayerSource, ResidentLayers, generate
from .options import Options
from .pebbled import PebbledModel
from .plan import MemoryModel, PebblingOptions, Plan, make_plan

__all__ = [
    "Generation", "GenerationStats", "LayerSource", "MemoryModel", "Options", "PebbledModel", "PebblingOptions",
    "Plan", "ResidentLayers", "generate", "make_plan",
]
