"""Tool calling on both APIs: the tools rendered through the model's template, calls parsed from what the
model writes (whole and streamed), tool_choice forcing a call by constrained decoding, results sent back
under role "tool", and a clear 400 for what a model or a request cannot do."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from chat_templates import OLLAMA_LLAMA32_GO, OLLAMA_QWEN3_GO, PHI3_TOOLS, QWEN3_THINKING
from helpers import prompt_of, script_replies, tiny_spec
from pyplugin.errors import OptionsError
from pyplugin.model import load_model
from pyplugin.model.synth import CHATML_TEMPLATE, LLAMA3_TEMPLATE, PHI3_TEMPLATE, write_gguf
from pyplugin.serving.tool_calls import (GENERIC, LLAMA3, QWEN, ToolCall, ToolCallParser, call_grammar,
                                         forced_tools, tool_format)
from server_patch.local import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Llama and Qwen with the templates synth gives them (the demo model's is the Llama one); Phi-3 has none that
# takes tools, so this one is written for it, calls in the JSON fallback format.
MODELS = {"llama": ("llama", None), "qwen": ("qwen2", None), "phi": ("phi3", PHI3_TOOLS)}


# ---------------------------------------------------------------------------------------------------
# the format, from the template


@pytest.mark.parametrize("template,expected", [
    (LLAMA3_TEMPLATE, LLAMA3), (CHATML_TEMPLATE, QWEN), (QWEN3_THINKING, QWEN), (OLLAMA_QWEN3_GO, QWEN),
    (OLLAMA_LLAMA32_GO, LLAMA3), (PHI3_TOOLS, GENERIC), ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}", GENERIC),
    ("{{ if .Tools }}{{ .Tools }}{{ end }}{{ .Prompt }}", GENERIC),
    (PHI3_TEMPLATE, None), ("{{ messages }}", None), (None, None), ("", None)])
def test_the_call_format_is_read_from_the_template_jinja_or_go(template, expected):
    assert tool_format(template) == expected


# ---------------------------------------------------------------------------------------------------
# parsing


def parse_streamed(fmt, text: str, cut: int | None = None) -> tuple[str, list[ToolCall]]:
    """The text fed whole, or in two pieces cut at `cut`, or one character at a time (cut=-1)."""
    parser = ToolCallParser(fmt, TOOLS)
    pieces = list(text) if cut == -1 else [text] if cut is None else [text[:cut], text[cut:]]
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content, calls = content + c, calls + k
    c, k = parser.finish()
    return content + c, calls + k


CASES = [
    (QWEN, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
           '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.\n\n", [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"}), ToolCall("add", {"a": 1, "b": 2})]),
    (QWEN, 'A <tool_call> is written <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',  # never closed
     "A <tool_call> is written ", [ToolCall("add", {"a": 1, "b": 2})]),
    (QWEN, "<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    (QWEN, "no calls at all, a < b", "no calls at all, a < b", []),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "get_weather", "parameters": '
             '{"city": "Oslo", "unit": "celsius"}}', "", [ToolCall("add", {"a": 3, "b": 4}),
                                                          ToolCall("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    (LLAMA3, ' {"name": "add", "parameters": {"a": "{}", "b": 4}}', "", [ToolCall("add", {"a": "{}", "b": 4})]),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),  # JSON that calls no offered tool is an answer
    (LLAMA3, '{"name": "add", "parameters": {"a": 1}} and then prose', "and then prose", [ToolCall("add", {"a": 1})]),
    (LLAMA3, "Sure: 2 + 2 = 4.", "Sure: 2 + 2 = 4.", []),
    (GENERIC, '{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}', "", [ToolCall("add", {"a": 5, "b": 6})]),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_calls_are_parsed_the_same_however_the_text_is_streamed(fmt, text, content, calls):
    assert parse_streamed(fmt, text) == (content, calls)
    assert parse_streamed(fmt, text, cut=-1) == (content, calls)
    for cut in range(1, len(text)):
        assert parse_streamed(fmt, text, cut) == (content, calls), cut


def test_content_before_a_call_streams_before_the_call_is_complete():
    parser = ToolCallParser(QWEN, TOOLS)
    assert parser.feed("Checking the weather") == ("Checking the weather", [])
    assert parser.feed(" now <tool") == (" now ", [])  # "<tool" may open a call: held back
    assert parser.feed('_call>\n{"name": "add", "arguments": {"a": 1,') == ("", [])
    assert parser.feed(' "b": 2}}\n</tool_call>') == ("", [ToolCall("add", {"a": 1, "b": 2})])


def test_the_forcing_grammar_names_only_the_chosen_tools():
    assert forced_tools(TOOLS, "auto") is None and forced_tools(TOOLS, None) is None
    assert forced_tools(TOOLS, "required") == TOOLS
    assert forced_tools(TOOLS, {"type": "function", "function": {"name": "add"}}) == [ADD]
    grammar = call_grammar(QWEN, [ADD])
    assert '"<tool_call>\\n"' in grammar and '"const": "add"' in grammar and "get_weather" not in grammar
    with pytest.raises(OptionsError, match="'nope', which is not among the tools"):
        forced_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(OptionsError, match="accepted"):
        forced_tools(TOOLS, "sometimes")


# ---------------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, (arch, template) in MODELS.items():
        write_gguf(root / f"{name}.gguf", tiny_spec(arch, n_layer=1, n_ctx=1024, chat_template=template))
    write_gguf(root / "plain.gguf", tiny_spec("phi3", n_layer=1, n_ctx=1024))  # Phi-3's template: no tools
    return root


@pytest.fixture
def scripted(monkeypatch, models):
    """`write(model, text)`: the next generations write `text` (then end)."""
    return script_replies(monkeypatch, models)


def openai(url, model, stream=False, **body):
    body = {"model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 200, "seed": 1, "tools": TOOLS, "stream": stream, **body}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def ollama(url, model, stream=False, **body):
    body = {"model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "options": {"num_predict": 200, "seed": 1}, "tools": TOOLS, "stream": stream, **body}
    r = requests.post(f"{url}/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()] if stream else r.json()


def check_openai_call(call: dict, name: str | None = None) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert name is None or call["function"]["name"] == name
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("choice,name", [("required", None), ({"type": "function", "function": {"name": "add"}}, "add"),
                                         ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")])
def test_tool_choice_forces_a_valid_call_on_openais_api(url, model, choice, name):
    for seed in range(3):
        r = openai(url, model, tool_choice=choice, seed=seed)
        (c,) = r["choices"]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        check_openai_call(call, name)


@pytest.mark.parametrize("model", MODELS)
def test_a_forced_call_streams_as_one_tool_call_delta_with_the_same_call(url, model):
    whole = openai(url, model, tool_choice="required", seed=5)["choices"][0]["message"]["tool_calls"][0]
    chunks = openai(url, model, stream=True, tool_choice="required", seed=5)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and len(calls[0]) == 1 and calls[0][0]["index"] == 0
    check_openai_call(calls[0][0])
    assert calls[0][0]["function"] == whole["function"]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("model", MODELS)
def test_ollamas_api_parses_a_call_after_content_whole_and_streamed(url, model, scripted):
    call = {"qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                    '</tool_call>',
            "llama": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            "phi": ' {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'}[model]
    expected = [{"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]
    text = ("Let me look that up. " if model == "qwen" else "") + call
    scripted(model, text)
    r = ollama(url, model)
    assert r["message"]["tool_calls"] == expected and r["done_reason"] == "stop"
    assert r["message"]["content"] == ("Let me look that up. " if model == "qwen" else "")
    lines = ollama(url, model, stream=True)
    with_calls = [i for i, line in enumerate(lines) if line["message"].get("tool_calls")]
    assert len(with_calls) == 1 and lines[with_calls[0]]["message"]["tool_calls"] == expected
    before = "".join(line["message"]["content"] for line in lines[:with_calls[0]])
    assert before == r["message"]["content"] and lines[-1]["done"]
    if model == "qwen":  # the content came first, in pieces, before the call was complete
        assert with_calls[0] > 1 and lines[0]["message"]["content"]


def test_openai_auto_streams_content_then_each_call_with_its_index(url, scripted):
    scripted("qwen", 'Two calls.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    chunks = openai(url, "qwen", stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Two calls."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = openai(url, "qwen")["choices"][0]
    assert whole["message"]["content"].strip() == "Two calls." and len(whole["message"]["tool_calls"]) == 2


def test_a_reply_without_a_call_is_content_and_stops(url, scripted):
    scripted("llama", '{"answer": 42}')
    c = openai(url, "llama")["choices"][0]
    assert c["message"] == {"role": "assistant", "content": '{"answer": 42}'} and c["finish_reason"] == "stop"


# ---------------------------------------------------------------------------------------------------
# the prompt


@pytest.mark.parametrize("model", MODELS)
def test_the_tools_are_rendered_into_the_prompt(models, model):
    messages = [{"role": "user", "content": "Weather?"}]
    with_tools = prompt_of(models, model, messages=messages, tools=TOOLS)
    without = prompt_of(models, model, messages=messages)
    for tool in TOOLS:
        assert json.dumps(tool["function"]["parameters"]) in with_tools
        assert tool["function"]["description"] in with_tools and tool["function"]["name"] not in without
    assert ("<tool_call>" in with_tools) == (model == "qwen") and ('"parameters"' in with_tools)


ROUND_TRIP = {
    "qwen": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
             "<tool_response>\n21 degrees\n</tool_response>"],
    "llama": ['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>',
              "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees"],
    "phi": ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}<|end|>',
            "Result of get_weather: 21 degrees"],
}


@pytest.mark.parametrize("model", MODELS)
def test_a_tool_result_goes_back_through_the_template_on_both_apis(url, models, model):
    """The call and its result, in each API's shape, reach the template as Hugging Face's convention has
    them: the prompt the server evaluates is the one the template renders for that conversation."""
    args = {"city": "Paris", "unit": "celsius"}
    expected = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "content": "21 degrees", "name": "get_weather"}]
    prompt = prompt_of(models, model, messages=expected, tools=TOOLS)
    for piece in ROUND_TRIP[model]:
        assert piece in prompt
    n_tokens = len(load_model(models / f"{model}.gguf", progress=False).tokenizer.encode(prompt))
    ollama_messages = [expected[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": "21 degrees", "tool_name": "get_weather"}]
    r = ollama(url, model, messages=ollama_messages, options={"num_predict": 1})
    assert r["prompt_eval_count"] + r["pebbling"]["cached_tokens"] == n_tokens
    openai_messages = [expected[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = openai(url, model, messages=openai_messages, max_tokens=1)
    assert r["usage"]["prompt_tokens"] == n_tokens


def test_tool_choice_none_offers_no_tools(url):
    plain = openai(url, "qwen", tools=None, max_tokens=1)["usage"]["prompt_tokens"]
    assert openai(url, "qwen", tool_choice="none", max_tokens=1)["usage"]["prompt_tokens"] == plain
    assert openai(url, "qwen", max_tokens=1)["usage"]["prompt_tokens"] > plain
    assert openai(url, "plain", tool_choice="none", max_tokens=1)["choices"][0]["finish_reason"] in ("stop", "length")


# ---------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("path,body,needle", [
    ("/api/chat", {"model": "plain", "tools": TOOLS}, "plain does not support tools"),
    ("/v1/chat/completions", {"model": "plain", "tools": TOOLS}, "plain does not support tools"),
    ("/v1/chat/completions", {"model": "qwen", "tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "'nope', which is not among the tools"),
    ("/v1/chat/completions", {"model": "qwen", "tool_choice": "required"}, "tool_choice' needs 'tools'"),
    ("/v1/chat/completions", {"model": "qwen", "tools": TOOLS, "parallel_tool_calls": False},
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"model": "qwen", "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "send one of them"),
    ("/api/chat", {"model": "qwen", "tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ("/api/chat", {"model": "qwen", "tools": [{"type": "retrieval"}]}, "accepted"),
    ("/v1/chat/completions", {"model": "qwen", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments is not JSON"),
])
def test_what_cannot_be_done_is_a_400_saying_why(url, path, body, needle):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": False, **body}
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
    assert needle in message


def test_parallel_tool_calls_false_is_honoured_with_a_forced_call(url):
    r = openai(url, "qwen", tool_choice="required", parallel_tool_calls=False)
    assert len(r["choices"][0]["message"]["tool_calls"]) == 1


def test_the_demo_model_takes_tools(url):
    """The demo is written into the models directory on first use, with the Llama 3 template synth gives it."""
    r = openai(url, "pebbling-demo", tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60)
    (call,) = r["choices"][0]["message"]["tool_calls"]
    check_openai_call(call, "add")


# Parameters as Pydantic writes them for a nested model: the nested one under "$defs", reached by "$ref".
ORDER = {"type": "function", "function": {"name": "place_order", "description": "Order one item", "parameters": {
    "$defs": {"Item": {"title": "Item", "type": "object", "required": ["sku", "qty"], "properties": {
        "sku": {"type": "string", "enum": ["a1", "b2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "title": "Order", "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]}}}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}])
def test_tool_parameters_with_defs_and_refs_can_be_forced(url, model, choice):
    schemas = {**PARAMS, "place_order": ORDER["function"]["parameters"]}
    r = openai(url, model, tools=[ORDER, ADD], tool_choice=choice)
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert choice == "required" or call["function"]["name"] == "place_order"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
