"""What a model's Modelfile layers make of a request, and how /api/show describes them, as in Ollama.

A TEMPLATE layer (a Go template) is the model's chat template, in place of the GGUF's; SYSTEM is the
system message of a request that sends none; PARAMETER values are defaults that a request's options
override; MESSAGE turns open every chat. An ADAPTER or a projector changes what the model computes and
is refused, naming it. A PARAMETER pebbling does not implement is left out with a warning in the log
and in /api/show, never applied half-way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import OptionsError
from ..runtime import Options
from . import store_write
from .catalogue import ModelLoadError
from .go_template import TemplateSyntaxError, parsed
from .jobs import GenerationRequest
from .modelfile_text import format_modelfile
from .ollama_store import ModelLayers
from .reply import thinks
from .tool_calls import tool_format

logger = logging.getLogger("pebbling")
_warned: set[tuple] = set()  # (model, parameters) whose leaving out the log has said


def usable_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the params pebbling applies, {name: why the others are not})."""
    kept, left = {}, {}
    for name, value in params.items():
        try:
            Options.from_dict({name: value})
        except OptionsError as exc:
            left[name] = str(exc)
            continue
        kept[name] = value
    return kept, left


def with_layers(request: GenerationRequest, layers: ModelLayers) -> GenerationRequest:
    """The request as the model's layers make it: their params under its options, their system message
    and opening turns where it sends none. A model with a layer pebbling cannot serve is refused."""
    if layers.unsupported:
        raise ModelLoadError(f"model '{request.model}' cannot be served: it has {' and '.join(layers.unsupported)}, "
                             "which pebbling does not support")
    changes: dict[str, Any] = {}
    if layers.params and isinstance(request.options, Mapping):
        kept, left = usable_params(layers.params)
        said = (request.model, tuple(sorted(left)))
        if left and said not in _warned:  # once per model, not on every request
            _warned.add(said)
            logger.warning("model=%s: parameters left out: %s", request.model, "; ".join(left.values()))
        changes["options"] = {**kept, **request.options}
    if request.messages is not None:
        messages = [*layers.messages, *request.messages]
        if layers.system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": layers.system})
        if messages != request.messages:
            changes["messages"] = messages
    elif layers.system and not request.system:
        changes["system"] = layers.system
    return dataclasses.replace(request, **changes) if changes else request


def template_source(layers: ModelLayers, jinja_source: str | None) -> str | None:
    """The chat template the model is served with: its Go template layer, else the GGUF's."""
    return layers.template if layers.template is not None else jinja_source


def chat_renderer(layers: ModelLayers, request: GenerationRequest) -> Callable[..., str] | None:
    """Renders a conversation with the model's Go template layer (tools and think as Ollama passes them),
    or None where the GGUF's own template renders it."""
    if layers.template is None:
        return None
    template = parsed(layers.template)
    return lambda messages, **_: template.render_chat(messages, tools=request.tools, think=request.think)


def reads_suffix(template: str | None) -> bool:
    """Whether a Go template takes a suffix (reads .Suffix), as Ollama's insert capability asks."""
    try:
        return template is not None and "suffix" in parsed(template).fields
    except TemplateSyntaxError:
        return False


def show_fields(name: str, layers: ModelLayers, gguf: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """/api/show's modelfile, parameters, template, system, license and capabilities of the model `name`,
    whose GGUF is `path`."""
    template = template_source(layers, gguf.get("template") or None) or ""
    license_text = layers.license or gguf.get("license", "")
    kept, left = usable_params(layers.params)
    parameters = []
    for key, value in layers.params.items():
        for one in value if isinstance(value, list) else [value]:
            parameters.append(f"{key:<15} {json.dumps(one) if isinstance(one, str) else one}")
    # A Modelfile that `create -f` makes into this model again: the Go template only (a GGUF's Jinja template
    # travels with the GGUF), and the licenses of the layers (the GGUF's own, likewise).
    modelfile = format_modelfile(name, _made_from(name, path), template=layers.template, system=layers.system,
                                 parameters=layers.params, messages=layers.messages, license=layers.license)
    capabilities = ["completion"] if not gguf.get("embedding_only") else []
    if tool_format(template) is not None:
        capabilities.append("tools")
    if reads_suffix(layers.template) or gguf.get("fim"):
        capabilities.append("insert")  # a suffix is taken (prompt.insert_prompt)
    if thinks(template):
        capabilities.append("thinking")
    if gguf.get("pools"):
        capabilities.append("embedding")
    fields = {"modelfile": modelfile, "parameters": "\n".join(parameters), "template": template,
              "license": license_text, "capabilities": capabilities}
    if layers.system:
        fields["system"] = layers.system
    if left or layers.unsupported:
        fields["pebbling_notes"] = [f"parameter {k} is not applied: {why}" for k, why in left.items()] + \
            [f"{what}: pebbling does not serve this model" for what in layers.unsupported]
    return fields


def _made_from(name: str, path: Path) -> str:
    """What a Modelfile's FROM names for the model's GGUF: its blob (sha256:<hex>) where it is one of the
    store that create writes to, as Ollama names its blob; else the model's own name (a file of the models
    directory, the demo or another store's blob, which create imports). Never a path: responses name none."""
    blobs = store_write.store_root() / "blobs"
    if path.parent == blobs and path.name.startswith("sha256-"):
        return "sha256:" + path.name.removeprefix("sha256-")
    return name
