"""The model: GGUF loading, tokenizer, chat template and the transformer forward pass.

It knows nothing of strategies or the store, and imports nothing of them: the forward pass is a set
of pure functions, the kernels that compute from quantized weights come in as arguments, and the
layer loop belongs to pyplugin.runtime.
"""

from .chat import ChatTemplate, ChatTemplateError
from .gguf_file import GGUFFile
from .load import SUPPORTED_ARCHS, WEIGHT_FORMS, Model, check_weight_form, load_model, read_config
from .qweight import QuantWeight
from .tokenizer import StreamDecoder, Tokenizer
from .transformer import (KVCache, LayerWeights, ModelConfig, OuterWeights, embed, layer_forward,
                          output_logits)

__all__ = [
    "ChatTemplate", "ChatTemplateError", "GGUFFile", "KVCache", "LayerWeights", "Model",
    "ModelConfig", "OuterWeights", "QuantWeight", "StreamDecoder", "SUPPORTED_ARCHS",
    "Tokenizer", "WEIGHT_FORMS", "check_weight_form", "embed", "layer_forward", "load_model", "output_logits",
    "read_config",
]
