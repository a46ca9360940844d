"""The client libraries people use, against a real server on loopback: the official `ollama` and `openai`
clients and LangChain's ChatOllama, OllamaEmbeddings, ChatOpenAI and OpenAIEmbeddings, each on the demo model
and on a tiny model of every architecture. What is checked is what each client hands its caller: parsed
objects, vectors, logprobs, streamed pieces that add up to the whole, tool calls.

The models write noise (random weights), so structured output and forced tool calls are the grammar's
doing, and a tool call Ollama's API has no way to force is scripted: the sampler is made to write it.
"""

from __future__ import annotations

import json
import math
import shutil
from typing import Literal

import jsonschema
import ollama
import openai
import pytest
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field, ValidationError

from helpers import ARCHS, script_replies, tiny_path
from server_patch import create_app
from server_patch.local import serving

CLIENT_ARCHS = (*ARCHS, "qwen3", "gemma3", "gemma2")  # every architecture pebbling serves
MODELS = ["pebbling-demo", *(f"tiny-{arch}" for arch in CLIENT_ARCHS)]
# Phi-3's and the Gemmas' templates take no tools: a 400 that says so, as Ollama answers.
NO_TOOLS = {"tiny-phi3", "tiny-gemma3", "tiny-gemma2"}
# The demo's template is tiny-llama's (Llama 3, calls in its JSON format), and a scripted reply does not
# depend on the weights: the scripted cases and the streamed deltas run on the tiny models only, since
# the demo's quantized 16 layers take seconds per prompt with tools in it on the CPU.
TINY = MODELS[1:]
OPTIONS = {"num_predict": 4, "seed": 1}
HI = [{"role": "user", "content": "Hi"}]


class Answer(BaseModel):
    """What the structured-output cases ask for, as a Pydantic model (its schema says nothing of other keys)."""

    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


class WeatherArgs(BaseModel):
    city: str = Field(max_length=12, description="the city")


@tool(args_schema=WeatherArgs)
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for arch in CLIENT_ARCHS:
        # A context long enough for a prompt with tools in it and a forced call after it.
        shutil.copy(tiny_path(arch, n_ctx=1024), root / f"tiny-{arch}.gguf")
    return root  # the demo model is written here on first use


@pytest.fixture(scope="module")
def url(models_dir):
    with serving(create_app(models_dir=models_dir)) as url:
        yield url


@pytest.fixture(params=MODELS)
def model(request):
    return request.param


def oc(url) -> ollama.Client:
    return ollama.Client(host=url, timeout=120)


def ai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def decoded(logprobs) -> str:
    """The text the tokens of a reply's logprobs spell (their bytes, so split characters come out whole)."""
    raw = b"".join(bytes(t["bytes"] if isinstance(t, dict) else t.bytes) for t in logprobs)
    return raw.decode("utf-8", "replace")


def ascii_of(text: str) -> str:
    return "".join(c for c in text if c < "\x80")


def spelled(logprobs, text: str) -> bool:
    """Whether the ollama client's logprobs (tokens as text; it keeps no bytes) spell `text`: exactly in its
    ASCII characters, which no token splits (a character split across tokens shows as U+FFFD in each)."""
    return ascii_of("".join(t.token for t in logprobs)) == ascii_of(text)


def unit(vector) -> bool:
    return math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-4)


# ---------------------------------------------------------------------------------------------------
# ollama


def test_ollama_chat_and_generate_stream_and_not(url, model):
    """Each reply checked against its own logprobs (a repeat of a prompt need not give the same text: the
    second starts from cached KV, whose last step rounds differently, and a random model's near-flat
    distribution turns that into another draw)."""
    client = oc(url)
    whole = client.chat(model=model, messages=HI, options=OPTIONS, logprobs=True)
    assert whole.done and whole.message.role == "assistant" and whole.eval_count <= 4
    assert len(whole.logprobs) == whole.eval_count and spelled(whole.logprobs, whole.message.content)
    pieces = list(client.chat(model=model, messages=HI, options=OPTIONS, stream=True, logprobs=True))
    streamed = [t for p in pieces for t in (p.logprobs or [])]
    assert spelled(streamed, "".join(p.message.content for p in pieces))
    assert pieces[-1].done and pieces[-1].eval_count == len(streamed)
    made = client.generate(model=model, prompt="Once upon a time", options=OPTIONS, logprobs=True, top_logprobs=2)
    assert made.context and len(made.logprobs) == made.eval_count and spelled(made.logprobs, made.response)
    assert all(len(t.top_logprobs) == 2 for t in made.logprobs)
    parts = list(client.generate(model=model, prompt="Once upon a time", options=OPTIONS, stream=True, logprobs=True))
    assert spelled([t for p in parts for t in (p.logprobs or [])], "".join(p.response for p in parts))
    assert parts[-1].done and parts[-1].context


def test_ollama_format_follows_a_pydantic_schema(url, model):
    r = oc(url).chat(model=model, messages=HI, format=Answer.model_json_schema(),
                     options={"seed": 2, "num_predict": 60})
    assert isinstance(Answer.model_validate_json(r.message.content), Answer) and r.done_reason == "stop"


def test_ollama_embed(url, model):
    r = oc(url).embed(model=model, input=["The quick brown fox.", "A memory plugin."])
    first, second = r.embeddings
    assert len(first) == len(second) > 0 and unit(first) and unit(second) and first != second


# ---------------------------------------------------------------------------------------------------
# openai


def test_openai_parse_gives_the_pydantic_object(url, model):
    r = ai(url).chat.completions.parse(model=model, messages=HI, response_format=Answer, max_tokens=60, seed=3)
    assert isinstance(r.choices[0].message.parsed, Answer) and r.choices[0].finish_reason == "stop"


def test_openai_embeddings_equal_ollamas(url, model):
    texts = ["The quick brown fox.", "A memory plugin."]
    r = ai(url).embeddings.create(model=model, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    expected = oc(url).embed(model=model, input=texts).embeddings
    for got, want in zip(r.data, expected):
        assert got.embedding == pytest.approx(want, abs=1e-6)


def test_openai_logprobs_with_top_three(url, model):
    r = ai(url).chat.completions.create(model=model, messages=HI, max_tokens=6, seed=4, logprobs=True,
                                        top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert decoded(content) == choice.message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] <= 0


def test_openai_streaming_adds_up_to_the_whole(url, model):
    client = ai(url)
    messages = [{"role": "developer", "content": "Be brief."}, *HI]  # OpenAI's newer name for system
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=5, stream=True,
                                                 logprobs=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.content]
    assert "".join(c.delta.content or "" for c in choices) == decoded(tokens)
    assert choices[-1].finish_reason in ("stop", "length") and all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
    assert client.models.retrieve(model).id in [m.id for m in client.models.list()]


def test_openai_unknown_model_is_not_found(url):
    with pytest.raises(openai.NotFoundError):
        ai(url).models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):
        ai(url).chat.completions.create(model="no-such-model", messages=HI)


# ---------------------------------------------------------------------------------------------------
# LangChain


def test_langchain_chat_ollama_with_structured_output(url, model):
    llm = ChatOllama(model=model, base_url=url, seed=6, num_predict=60)
    assert isinstance(llm.with_structured_output(Answer).invoke("Hi"), Answer)


def test_langchain_ollama_embeddings(url, model):
    emb = OllamaEmbeddings(model=model, base_url=url)
    docs = emb.embed_documents(["The quick brown fox.", "A memory plugin."])
    assert len(docs) == 2 and all(unit(v) for v in docs)
    assert emb.embed_query("The quick brown fox.") == pytest.approx(docs[0], abs=1e-6)
    via_openai = OpenAIEmbeddings(model=model, base_url=f"{url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False).embed_query("The quick brown fox.")
    assert via_openai == pytest.approx(docs[0], abs=1e-6)


def test_langchain_chat_openai(url, model):
    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", max_tokens=6, seed=7, max_retries=0,
                     logprobs=True, stream_usage=True)
    whole = llm.invoke("Hi")
    assert decoded(whole.response_metadata["logprobs"]["content"]) == whole.content
    assert whole.usage_metadata["output_tokens"] == whole.response_metadata["token_usage"]["completion_tokens"]
    chunks = list(llm.stream("Hi"))
    joined = chunks[0]
    for c in chunks[1:]:
        joined += c
    assert decoded(joined.response_metadata["logprobs"]["content"]) == joined.content
    assert joined.usage_metadata["output_tokens"] == len(joined.response_metadata["logprobs"]["content"])


def test_validate_model_on_init(url, model):
    reply = ChatOllama(model=model, base_url=url, validate_model_on_init=True, num_predict=2).invoke("Hi")
    assert reply.usage_metadata["output_tokens"] <= 2 and reply.usage_metadata["input_tokens"] > 0
    assert OllamaEmbeddings(model=model, base_url=url, validate_model_on_init=True).embed_query("x")
    with pytest.raises(ValidationError, match="not found"):
        ChatOllama(model="no-such-model", base_url=url, validate_model_on_init=True)


# ---------------------------------------------------------------------------------------------------
# tool calls


@pytest.fixture
def scripted(models_dir, monkeypatch):
    """`write(model, text)`: the model's next replies write `text` and end, for a tool call Ollama's API
    offers no way to force; returns the tokens it takes (num_predict must leave room for them)."""
    return script_replies(monkeypatch, models_dir)


def tool_call_text(model: str) -> str:
    """A call to get_weather in the format the model's template names."""
    if model in ("tiny-qwen2", "tiny-qwen3"):
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    return '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'  # Llama 3's


@pytest.mark.parametrize("model", TINY)
def test_ollama_tools(url, model, scripted):
    client = oc(url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    if model in NO_TOOLS:
        with pytest.raises(ollama.ResponseError, match="does not support tools") as err:
            client.chat(model=model, messages=ask, tools=[WEATHER])
        assert err.value.status_code == 400
        return
    room = {"num_predict": scripted(model, tool_call_text(model))}
    r = client.chat(model=model, messages=ask, tools=[WEATHER], options=room)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [c for c in client.chat(model=model, messages=ask, tools=[WEATHER], stream=True, options=room)
                if c.message.tool_calls]
    assert [c.message.tool_calls for c in streamed] == [r.message.tool_calls]
    back = ask + [r.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    assert client.chat(model=model, messages=back, tools=[WEATHER], options=room).done


def test_openai_tools_required(url, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    if model in NO_TOOLS:
        with pytest.raises(openai.BadRequestError, match="does not support tools"):
            ai(url).chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required")
        return
    r = ai(url).chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                                        max_tokens=120, seed=8)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    back = ask + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert ai(url).chat.completions.create(model=model, messages=back, tools=[WEATHER], max_tokens=4).choices


@pytest.mark.parametrize("model", [m for m in TINY if m not in NO_TOOLS])
def test_openai_tool_call_deltas_stream(url, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = dict(model=model, messages=ask, tools=[WEATHER], tool_choice="required", max_tokens=120, seed=9)
    whole = ai(url).chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(ai(url).chat.completions.create(**body, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("model", TINY)
def test_langchain_bind_tools(url, model, scripted):
    if model in NO_TOOLS:
        with pytest.raises(openai.BadRequestError, match="does not support tools"):
            ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", max_retries=0).bind_tools(
                [get_weather], tool_choice="required").invoke("What is the weather in Paris?")
        return
    forced = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", max_tokens=120, seed=10,
                        max_retries=0).bind_tools([get_weather], tool_choice="required")
    (call,) = forced.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    room = scripted(model, tool_call_text(model))
    reply = ChatOllama(model=model, base_url=url, num_predict=room).bind_tools([get_weather]).invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
