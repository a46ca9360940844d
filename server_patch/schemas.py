"""Request bodies, as pydantic models: FastAPI validates them and publishes them in the OpenAPI schema.

Types are strict (a string is not a boolean, 1.0 is not a token id), as Ollama's Go decoder is; fields
whose accepted forms are several (options, keep_alive, stop) are typed ``Any`` here and checked by
pyplugin, whose messages name the value and what would be accepted. Unknown fields are ignored, as
Ollama ignores them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_OPTIONS_DOC = ("Ollama's options (temperature, top_k, top_p, min_p, seed, num_predict, num_ctx, "
                "num_batch, stop, repeat_penalty, repeat_last_n) plus pebbling_strategy (none, sqrt, "
                "adaptive, minimal, every:N), pebbling_enabled (bool), pebbling_memory_limit (bytes, "
                "or a size such as \"6GiB\"), pebbling_weights (quantized, the default: weights stay in "
                "their GGUF type; f16: expanded once at load), pebbling_kv_type (f16, the default, q8_0 or "
                "q4_0: the KV cache's type) and, for a mixture of experts, pebbling_expert_cache (the most "
                "experts of each layer kept on the device: experts as pebbles), pebbling_expert_prefetch (bool) "
                "and pebbling_expert_policy (lru, the default, or lfu)")
_KEEP_ALIVE_DOC = ('How long the model stays loaded after this request: seconds, or a duration such as '
                   '"10m"; 0 unloads it at once, a negative value keeps it loaded. Default 5m.')


_SHIFT_DOC = ("true (the default): a generation that fills num_ctx shifts it (num_keep tokens kept, half of the "
              "rest dropped) and goes on, as Ollama's does; false: it ends there (done_reason length)")
_THINK_DOC = ("true: the model thinks, and its thinking comes apart from the answer (message.thinking, or "
              "generate's thinking); "
              "false: thinking off; absent: the template's default, the text as written; \"low\", \"medium\" "
              "or \"high\": gpt-oss's reasoning effort (its thinking always comes apart), on for another "
              "thinking model. Refused (400) for a model whose template marks no <think> part")
_TOOLS_DOC = ('functions the model may call, rendered through its chat template: [{"type": "function", '
              '"function": {"name", "description", "parameters": {JSON schema}}}]; refused (400) for a '
              'model whose template takes no tools')


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class GenerateRequest(_Body):
    model: str = Field(description="pebbling-demo, NAME from --models DIR, or name:tag from Ollama's store")
    prompt: str = ""
    system: str | None = None
    template: str | None = Field(None, description="an Ollama prompt template: {{ .System }}, {{ .Prompt }}")
    context: list[int] | None = Field(None, description="the `context` a previous response returned")
    raw: bool = Field(False, description="send the prompt as is, without a template")
    stream: bool = True
    options: dict[str, Any] | None = Field(None, description=_OPTIONS_DOC)
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)
    format: Any = Field(None, description='"json", or a JSON schema the output must follow (constrained decoding)')
    images: list[str] | None = Field(None, description="not supported: text-only models")
    suffix: str | None = Field(None, description="fill in the middle: the text after the gap (`prompt` is the text "
                               "before it), for a model whose template reads .Suffix or whose vocabulary has "
                               "fill-in-the-middle tokens")
    think: Any = Field(None, description=_THINK_DOC)
    shift: bool = Field(True, description=_SHIFT_DOC)
    logprobs: bool | None = Field(None, description="each generated token's log probability (the model's "
                                  "log-softmax, before sampling) in `logprobs`")
    top_logprobs: int | None = Field(None, description="with logprobs: the N (0 to 20) most likely tokens of each step")


class Message(_Body):
    role: str = Field(description="system, user, assistant or tool")
    content: str | None = Field("", description="null is read as empty, as Ollama reads it")
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's calls: "
                                                    "[{\"function\": {\"name\", \"arguments\": {...}}}]")
    tool_name: str | None = Field(None, description="a tool message: the function whose result it holds")
    thinking: str | None = Field(None, description="an assistant's thinking, passed back to the template")


class ChatRequest(_Body):
    model: str
    messages: list[Message] = Field(default_factory=list)
    stream: bool = True
    options: dict[str, Any] | None = Field(None, description=_OPTIONS_DOC)
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)
    format: Any = Field(None, description='"json", or a JSON schema the output must follow (constrained decoding)')
    tools: list[Any] | None = Field(None, description=_TOOLS_DOC)
    think: Any = Field(None, description=_THINK_DOC)
    shift: bool = Field(True, description=_SHIFT_DOC)
    logprobs: bool | None = Field(None, description="each generated token's log probability (the model's "
                                  "log-softmax, before sampling) in `logprobs`")
    top_logprobs: int | None = Field(None, description="with logprobs: the N (0 to 20) most likely tokens of each step")


class EmbedRequest(_Body):
    model: str
    input: str | list[str] = Field(default_factory=list, description="a text, or a list of texts: one vector each")
    truncate: bool = Field(True, description="cut an input longer than num_ctx (false: refuse it)")
    dimensions: int | None = Field(None, ge=1, description="keep the first N values of each vector, renormalised")
    options: dict[str, Any] | None = Field(None, description=_OPTIONS_DOC)
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)


class EmbeddingsRequest(_Body):
    """The older /api/embeddings: one prompt, a vector that is not normalised."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = Field(None, description=_OPTIONS_DOC)
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = Field(None, description="older clients' spelling of `model`")
    verbose: bool = False


# ---------------------------------------------------------------------------------------------------
# OpenAI-compatible bodies


class _OpenAIBody(_Body):
    model: str
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Any = Field(None, description="a string or a list of strings")
    n: int = Field(1, ge=1, le=16, description="choices to generate (without stream)")
    logprobs: Any = Field(None, description="chat: true for each token's log probability (the model's log-softmax, "
                                            "before sampling); completions: N, the legacy form (with the N most likely)")
    top_logprobs: int | None = Field(None, description="chat, with logprobs: the N (0 to 20) most likely tokens of each step")
    logit_bias: dict[str, Any] | None = Field(None, description="not supported: refused when not empty")
    options: dict[str, Any] | None = Field(None, description="pebbling extension: " + _OPTIONS_DOC)
    pebbling_strategy: str | None = Field(None, description="pebbling extension, as in options")
    pebbling_enabled: bool | None = None
    pebbling_memory_limit: Any = None
    pebbling_weights: Any = None
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: str
    content: Any = Field(None, description="a string, or a list of {type: text, text} parts")
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's calls: [{id, type: "
                                                    "function, function: {name, arguments: JSON string}}]")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    name: str | None = None
    reasoning_content: str | None = Field(None, description="an assistant's thinking, passed back to the template")


class ChatCompletionRequest(_OpenAIBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = Field(None, description=_TOOLS_DOC)
    tool_choice: Any = Field(None, description="none (tools not offered), auto, required, or {\"type\": "
                             "\"function\", \"function\": {\"name\"}}: required and a named function "
                             "force a call by constrained decoding")
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most (with tool_choice "
                                             "required or a named function, which force exactly one)")
    functions: list[Any] | None = Field(None, description="not supported: send tools")
    function_call: Any = Field(None, description="not supported: send tool_choice")
    reasoning_effort: str | None = Field(None, description="\"none\": thinking off; \"low\", \"medium\" or "
                                         "\"high\": gpt-oss's reasoning effort, thinking on for another model")
    think: Any = Field(None, description="pebbling extension, as Ollama's: " + _THINK_DOC.replace(
        "message.thinking", "message.reasoning_content"))


class CompletionRequest(_OpenAIBody):
    prompt: str
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    echo: bool = False


class OpenAIEmbeddingsRequest(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text or a list of texts (token-id arrays are refused: another tokenizer's ids mean nothing)")
    encoding_format: str = Field("float", description="float, or base64 (little-endian float32)")
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    options: dict[str, Any] | None = Field(None, description="pebbling extension: " + _OPTIONS_DOC)
    pebbling_strategy: str | None = Field(None, description="pebbling extension, as in options")
    pebbling_memory_limit: Any = None
    pebbling_weights: Any = None
    keep_alive: Any = Field(None, description=_KEEP_ALIVE_DOC)
