"""Gemma 4's replies: its thought channel returned as thinking and its calls (in its own notation) as tool calls,
however the text streams; and through /api/chat, /api/generate and /v1/chat/completions, streamed and not, on a
synthetic file with the Gemma 4 vocabulary and template (pyplugin.model.synth_vocab_gemma4), `think` reaching the
template as enable_thinking."""

from __future__ import annotations

import json

import pytest
import requests

from helpers import QUESTION, api_chat, openai_chat, prompt_of, script_replies, tiny_spec
from pyplugin.errors import OptionsError
from pyplugin.model.synth import write_gguf
from pyplugin.model.synth_vocab import build_vocab
from pyplugin.serving import GenerationRequest
from pyplugin.serving.gemma4 import Gemma4Parser, parse_arguments, parse_call
from pyplugin.serving.reply import ReplyPlan, thinks
from pyplugin.serving.tool_calls import ToolCall, tool_format
from server_patch.local import serving

THOUGHT = "<|channel>thought\nThe user adds. 2 + 2 is 4.\n<channel|>"
ANSWER = "It is 4."
CALL = '<|tool_call>call:add{a:2,b:2}<tool_call|>'
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


# ---------------------------------------------------------------------------------------------------
# the parser


def split(pieces: list[str], tools: bool = True) -> tuple[str, str, list[ToolCall]]:
    parser, thinking, content, calls = Gemma4Parser(tools), "", "", []
    for piece in pieces + [None]:
        t, c, k = parser.feed(piece) if piece is not None else parser.finish()
        thinking, content, calls = thinking + t, content + c, calls + k
    return thinking, content, calls


@pytest.mark.parametrize("text,expected", [
    (THOUGHT + ANSWER, ("The user adds. 2 + 2 is 4.", "It is 4.", [])),
    (THOUGHT + CALL, ("The user adds. 2 + 2 is 4.", "", [ToolCall("add", {"a": 2, "b": 2})])),
    ("<|channel>thought\n<channel|>" + ANSWER, ("", "It is 4.", [])),           # the empty thought
    (ANSWER, ("", "It is 4.", [])),
    ("Adding." + CALL + CALL, ("", "Adding.", [ToolCall("add", {"a": 2, "b": 2})] * 2)),
    ('<|tool_call>call:f{s:<|"|>a, b: {c}<|"|>,l:[1,-2.5,true,null],o:{k:<|"|><|"|>}}<tool_call|>',
     ("", "", [ToolCall("f", {"s": "a, b: {c}", "l": [1, -2.5, True, None], "o": {"k": ""}})])),
    ("<|tool_call>call:add{a:2,b:}<tool_call|>", ("", "<|tool_call>call:add{a:2,b:}<tool_call|>", [])),  # not one
    (ANSWER + "<channel|>", ("", "It is 4.", [])),                              # a stray closing marker
    ("<|channel>thought\nstill thinking when cut", ("still thinking when cut", "", [])),
    ("a < b <| c", ("", "a < b <| c", [])),
])
def test_a_reply_is_split_the_same_however_the_text_is_streamed(text, expected):
    assert split([text]) == expected
    assert split(list(text)) == expected
    for cut in range(1, len(text)):
        assert split([text[:cut], text[cut:]]) == expected, cut


def test_calls_are_read_only_where_tools_were_offered():
    assert split([THOUGHT + CALL], tools=False) == ("The user adds. 2 + 2 is 4.", CALL, [])


def test_thinking_streams_as_it_comes():
    parser = Gemma4Parser()
    assert parser.feed("<|channel>thou") == ("", "", [])
    assert parser.feed("ght\nOne, ") == ("One,", "", [])
    assert parser.feed("two.") == (" two.", "", [])
    assert parser.feed("<channel|>Ans") == ("", "Ans", [])
    assert parser.finish() == ("", "", [])


@pytest.mark.parametrize("text,value", [
    ('{a:1,b:<|"|>x<|"|>}', {"a": 1, "b": "x"}), ("[]", []), ("{}", {}), ("1e3", 1000.0), ("false", False),
    ('{<|"|>quoted<|"|>:[{x:null}]}', {"quoted": [{"x": None}]}), ("{ a : 1 , b : [ 1 , 2 ] }", {"a": 1, "b": [1, 2]}),
])
def test_gemma4_notation(text, value):
    assert parse_arguments(text) == value


@pytest.mark.parametrize("text", ['{a:1', '<|"|>open', "{a}", "[1 2]", "{a:1}x", "call"])
def test_what_is_not_gemma4_notation(text):
    with pytest.raises(ValueError):
        parse_arguments(text)
    assert parse_call(f"call:f{text}") is None


def test_the_template_is_recognised():
    template = build_vocab("gemma4").chat_template
    assert thinks(template) and tool_format(template).name == "gemma4"
    plan = ReplyPlan.of(GenerationRequest(model="m", messages=[], think=True), template)
    assert plan.template_args == {"enable_thinking": True} and plan.gemma4
    with pytest.raises(OptionsError, match="not supported for Gemma 4"):
        ReplyPlan.of(GenerationRequest(model="m", messages=[], tools=[ADD], tool_choice="required"), template)


# ---------------------------------------------------------------------------------------------------
# through the APIs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "g4.gguf", tiny_spec("llama", vocab="gemma4", n_ctx=2048))
    return root


@pytest.fixture
def scripted(monkeypatch, models):
    write = script_replies(monkeypatch, models)
    return lambda text: write("g4", text)


def chat(url, stream=False, **body):
    return api_chat(url, "g4", stream, **body)


def openai(url, stream=False, **body):
    return openai_chat(url, "g4", stream, **body)


@pytest.mark.parametrize("think", [None, True])
def test_thinking_and_answer_come_apart_on_ollamas_api(url, scripted, think):
    scripted(THOUGHT + ANSWER + "<turn|>")
    message = chat(url, **({"think": think} if think is not None else {}))["message"]
    assert message == {"role": "assistant", "content": "It is 4.", "thinking": "The user adds. 2 + 2 is 4."}
    lines = chat(url, stream=True, think=think)
    assert "".join(line["message"].get("thinking", "") for line in lines) == message["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == "It is 4."
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_think_is_the_templates_enable_thinking(models):
    assert prompt_of(models, "g4", messages=QUESTION, think=True).startswith(
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWhat is 2 + 2?<turn|>\n<|turn>model\n")
    for think in (False, None):
        assert prompt_of(models, "g4", messages=QUESTION, think=think).startswith(
            "<bos><|turn>user\nWhat is 2 + 2?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")


def test_a_tool_call_comes_back_in_each_apis_fields_streamed_and_not(url, scripted):
    scripted(THOUGHT + CALL + "<|tool_response>")
    message = chat(url, tools=[ADD], think=True)["message"]
    assert message == {"role": "assistant", "content": "", "thinking": "The user adds. 2 + 2 is 4.",
                       "tool_calls": [{"function": {"index": 0, "name": "add", "arguments": {"a": 2, "b": 2}}}]}
    lines = chat(url, stream=True, tools=[ADD])
    assert [c["function"]["name"] for line in lines for c in line["message"].get("tool_calls", [])] == ["add"]
    choice = openai(url, tools=[ADD])["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user adds. 2 + 2 is 4."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    chunks = [c["choices"][0] for c in openai(url, stream=True, tools=[ADD]) if c["choices"]]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user adds. 2 + 2 is 4."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 2, "b": 2})]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_the_call_and_its_result_go_back_through_the_template(url, models, scripted):
    history = [*QUESTION, {"role": "assistant", "content": "", "thinking": "I should add.", "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}, {"role": "tool", "content": "4", "tool_name": "add"}]
    # (the Ollama route passes an assistant's thinking as reasoning_content too, which Gemma 4's template reads)
    prompt = prompt_of(models, "g4", messages=[QUESTION[0], {**history[1], "reasoning_content": "I should add."},
                                               history[2]], tools=[ADD])
    assert prompt.startswith("<bos><|turn>system\n<|tool>declaration:add{")
    assert ("<|turn>model\n<|channel>thought\nI should add.\n<channel|><|tool_call>call:add{a:2,b:2}<tool_call|>"
            '<|tool_response>response:add{value:<|"|>4<|"|>}<tool_response|>') in prompt
    scripted(ANSWER + "<turn|>")
    assert chat(url, messages=history, tools=[ADD])["message"]["content"] == "It is 4."
    openai_history = [*QUESTION, {"role": "assistant", "content": None, "reasoning_content": "I should add.",
                                  "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                      "name": "add", "arguments": json.dumps({"a": 2, "b": 2})}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    assert openai(url, messages=openai_history, tools=[ADD])["choices"][0]["message"]["content"] == "It is 4."


def test_generate_splits_a_gemma4_reply_too(url, scripted):
    scripted(THOUGHT + ANSWER + "<turn|>")
    r = requests.post(f"{url}/api/generate", json={"model": "g4", "prompt": "What is 2 + 2?", "stream": False},
                      timeout=60).json()
    assert (r["thinking"], r["response"]) == ("The user adds. 2 + 2 is 4.", "It is 4.")


def test_show_lists_thinking_and_tools_among_the_capabilities(url):
    shown = requests.post(f"{url}/api/show", json={"model": "g4"}, timeout=60).json()
    assert {"completion", "tools", "thinking"} <= set(shown["capabilities"])
