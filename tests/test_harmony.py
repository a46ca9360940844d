"""gpt-oss's chat format (harmony): its reply split into thinking (the analysis channel), content (the final
channel, a preamble) and tool calls (commentary to a function) however the text streams; the harmony
vocabulary's end tokens and shown headers as llama.cpp has them; and a conversation with a tool call and its
result, and think levels, through /api/chat and /v1/chat/completions, streamed and not, on a synthetic gpt-oss
file with a harmony template (written short after gpt-oss's own: pyplugin.model.synth_vocab)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import requests

from helpers import QUESTION, api_chat, openai_chat, prompt_of, script_replies, tiny_spec
from pyplugin.model.synth import write_gguf
from pyplugin.model.synth_vocab import build_vocab
from pyplugin.model.tokenizer import Tokenizer
from pyplugin.serving.harmony import HarmonyParser
from pyplugin.serving.tool_calls import ToolCall
from server_patch.local import serving

THOUGHT = "<|channel|>analysis<|message|>The user adds. 2 + 2 is 4.<|start|>assistant"
ANSWER = "<|channel|>final<|message|>It is 4."
CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}'
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


# ---------------------------------------------------------------------------------------------------
# the parser


def split(pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
    parser, thinking, content, calls = HarmonyParser(), "", "", []
    for piece in pieces + [None]:
        t, c, k = parser.feed(piece) if piece is not None else parser.finish()
        thinking, content, calls = thinking + t, content + c, calls + k
    return thinking, content, calls


@pytest.mark.parametrize("text,expected", [
    (THOUGHT + ANSWER, ("The user adds. 2 + 2 is 4.", "It is 4.", [])),
    (THOUGHT + CALL, ("The user adds. 2 + 2 is 4.", "", [ToolCall("add", {"a": 2, "b": 2})])),
    # the address before the channel, as the template writes past calls; a preamble; two calls
    ('assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}', ("", "", [ToolCall("add", {"a": 1})])),
    ("<|channel|>commentary<|message|>Adding.<|start|>assistant" + CALL + "<|start|>assistant" + CALL,
     ("", "Adding.", [ToolCall("add", {"a": 2, "b": 2})] * 2)),
    ("no harmony at all", ("", "no harmony at all", [])),
    (THOUGHT + "<|channel|>fin", ("The user adds. 2 + 2 is 4.", "", [])),   # a header the token limit cut
])
def test_a_reply_is_split_the_same_however_the_text_is_streamed(text, expected):
    assert split([text]) == expected
    assert split(list(text)) == expected
    for cut in range(1, len(text)):
        assert split([text[:cut], text[cut:]]) == expected, cut


@pytest.mark.parametrize("text", ['<|channel|>commentary to=functions.add<|message|>{"a": 2, "b"',
                                  '<|channel|>commentary to=functions.add<|message|>not json<|start|>assistant'])
def test_a_call_whose_arguments_are_not_json_is_cut_never_made(text):
    parser = HarmonyParser()
    assert parser.feed(text) == ("", "", []) and parser.finish() == ("", "", [])
    assert parser.cut is not None and parser.cut.name == "add"


def test_thinking_and_answer_stream_as_they_come():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|mess") == ("", "", [])     # a header: held until it ends
    assert parser.feed("age|>First step. <|sta") == ("First step. ", "", [])  # half a <|start|> kept back
    assert parser.feed("rt|>assistant<|channel|>final<|message|>Four") == ("", "Four", [])
    assert parser.finish() == ("", "", [])


def test_the_harmony_vocabulary_ends_a_reply_at_return_or_call_and_shows_the_headers():
    v = build_vocab("harmony")
    tok = Tokenizer(v.tokens, v.types, kind="bpe", merges=v.merges, pre=v.pre, bos_id=v.bos_id, eos_id=v.eos_id)
    ids = {t: v.tokens.index(t) for t in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>")}
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eog_ids and ids["<|end|>"] not in tok.eog_ids
    text = "<|channel|>final<|message|>Hi<|end|>"
    assert tok.decode(tok.encode(text)) == "<|channel|>final<|message|>Hi"  # <|end|> hidden, headers shown
    chatml = build_vocab("chatml")  # another vocabulary keeps its end tokens
    assert chatml.tokens.index("<|im_end|>") in Tokenizer(chatml.tokens, chatml.types, kind="bpe", merges=chatml.merges,
                                                          pre=chatml.pre, eos_id=chatml.eos_id).eog_ids


# ---------------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "oss.gguf", tiny_spec("gpt-oss", vocab="harmony", n_layer=2, n_ctx=1024, n_expert=4,
                                            n_expert_used=2, key_length=16, n_ff_exp=32, sliding_window=8))
    return root


@pytest.fixture
def scripted(monkeypatch, models):
    write = script_replies(monkeypatch, models)
    return lambda text: write("oss", text)


def chat(url, stream=False, **body):
    return api_chat(url, "oss", stream, **body)


def openai(url, stream=False, **body):
    return openai_chat(url, "oss", stream, **body)


@pytest.mark.parametrize("think", [None, True, "high"])
def test_thinking_and_answer_come_apart_on_ollamas_api(url, scripted, think):
    scripted(THOUGHT + ANSWER + "<|return|>")
    message = chat(url, **({"think": think} if think is not None else {}))["message"]
    assert message == {"role": "assistant", "content": "It is 4.", "thinking": "The user adds. 2 + 2 is 4."}
    lines = chat(url, stream=True, think=think)
    assert "".join(line["message"].get("thinking", "") for line in lines) == message["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == "It is 4."
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_a_tool_call_comes_back_in_each_apis_fields_streamed_and_not(url, scripted):
    scripted(THOUGHT + CALL + "<|call|>")
    message = chat(url, tools=[ADD])["message"]
    assert message == {"role": "assistant", "content": "", "thinking": "The user adds. 2 + 2 is 4.",
                       "tool_calls": [{"function": {"index": 0, "name": "add", "arguments": {"a": 2, "b": 2}}}]}
    lines = chat(url, stream=True, tools=[ADD])
    assert [c["function"]["name"] for line in lines for c in line["message"].get("tool_calls", [])] == ["add"]
    choice = openai(url, tools=[ADD])["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == choice["message"]["reasoning_content"] == "The user adds. 2 + 2 is 4."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    chunks = [c["choices"][0] for c in openai(url, stream=True, tools=[ADD]) if c["choices"]]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user adds. 2 + 2 is 4."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "add", {"a": 2, "b": 2})]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_the_call_and_its_result_go_back_through_the_template(url, models, scripted):
    history = [*QUESTION, {"role": "assistant", "content": "", "thinking": "I should add.", "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}, {"role": "tool", "content": "4", "tool_name": "add"}]
    prompt = prompt_of(models, "oss", messages=history, tools=[ADD])
    assert "<|start|>assistant<|channel|>analysis<|message|>I should add.<|end|>" in prompt
    assert '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 2}<|call|>' in prompt
    assert "<|start|>functions.add to=assistant<|channel|>commentary<|message|>4<|end|><|start|>assistant" in prompt
    assert 'type add = (_: {"type": "object"' in prompt and "// Adds two integers." in prompt
    scripted(ANSWER + "<|return|>")
    assert chat(url, messages=history, tools=[ADD])["message"]["content"] == "It is 4."
    openai_history = [*QUESTION, {"role": "assistant", "content": None, "reasoning_content": "I should add.",
                                  "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                      "name": "add", "arguments": json.dumps({"a": 2, "b": 2})}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    assert openai(url, messages=openai_history, tools=[ADD])["choices"][0]["message"]["content"] == "It is 4."


def test_generate_splits_a_harmony_reply_too(url, scripted):
    scripted(THOUGHT + ANSWER + "<|return|>")
    r = requests.post(f"{url}/api/generate", json={"model": "oss", "prompt": "What is 2 + 2?", "stream": False},
                      timeout=60).json()
    assert (r["thinking"], r["response"]) == ("The user adds. 2 + 2 is 4.", "It is 4.")


def test_show_lists_thinking_and_tools_among_the_capabilities(url):
    shown = requests.post(f"{url}/api/show", json={"model": "oss"}, timeout=60).json()
    assert {"completion", "tools", "thinking"} <= set(shown["capabilities"])


@pytest.mark.parametrize("level", ["low", "medium", "high"])
def test_a_think_level_is_the_templates_reasoning_effort(models, level):
    assert f"Reasoning: {level}" in prompt_of(models, "oss", messages=QUESTION, think=level)
    assert "Reasoning: medium" in prompt_of(models, "oss", messages=QUESTION)


def test_openais_reasoning_effort_is_the_level(url, scripted):
    scripted(THOUGHT + ANSWER + "<|return|>")
    assert openai(url, reasoning_effort="low")["choices"][0]["message"]["reasoning"] == "The user adds. 2 + 2 is 4."
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "oss", "messages": QUESTION,
                                                          "reasoning_effort": "extreme"}, timeout=60)
    assert r.status_code == 400 and "'low', 'medium', 'high'" in r.json()["error"]["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_is_a_valid_harmony_call_streamed_and_not(url, choice):
    """Constrained decoding writes the call's header and its arguments by the tool's schema (the random
    weights choose the numbers), whatever the think level."""
    for seed in range(3):
        choice_out = openai(url, tools=[ADD], tool_choice=choice, seed=seed, max_tokens=200, think="high")["choices"][0]
        assert choice_out["finish_reason"] == "tool_calls" and choice_out["message"]["content"] is None
        (call,) = choice_out["message"]["tool_calls"]
        assert call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
    chunks = [c["choices"][0] for c in openai(url, stream=True, tools=[ADD], tool_choice=choice, seed=1, max_tokens=200)
              if c["choices"]]
    calls = [call for c in chunks for call in c["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["add"] and chunks[-1]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------------------------------
# the installed command


PEBBLING = Path(sys.executable).with_name("pebbling")  # the console script the package installs


@pytest.mark.parametrize("flags,shown", [
    (["--think", "high"], "Thinking...\nThe user adds. 2 + 2 is 4.\n...done thinking.\n\nIt is 4.\n"),
    (["--hidethinking"], "It is 4.\n"),
])
def test_pebbling_run_prints_the_thinking_before_the_answer_as_ollama_does(url, models, scripted, flags, shown):
    assert PEBBLING.is_file(), f"the pebbling command is not installed beside {sys.executable}"
    scripted(THOUGHT + ANSWER + "<|return|>")
    env = {**os.environ, "PEBBLING_HOST": url.removeprefix("http://"), "PEBBLING_MODELS": str(models)}
    done = subprocess.run([str(PEBBLING), "run", "oss", "What is 2 + 2?", *flags], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown


def test_structured_output_is_the_content_of_a_harmony_model(url):
    """A format constrains the whole reply to JSON, so it opens with no harmony header: all of it is content."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    for stream in (False, True):
        out = chat(url, stream=stream, format=schema, options={"num_predict": 60, "seed": 3})
        content = "".join(line["message"]["content"] for line in out) if stream else out["message"]["content"]
        assert isinstance(json.loads(content)["answer"], int)


def test_openais_reasoning_content_reaches_a_template_that_reads_thinking():
    """gpt-oss's template reads an assistant's earlier thinking as `thinking`; OpenAI's clients send it as
    `reasoning_content`: the route passes it under both names, as Ollama's route does."""
    from server_patch.openai_compat import _text_content
    from server_patch.replies import openai_messages
    from server_patch.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(model="oss", messages=[*QUESTION, {
        "role": "assistant", "content": None, "reasoning_content": "I should add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"}])
    assistant = openai_messages(body, _text_content)[1]
    assert assistant["thinking"] == assistant["reasoning_content"] == "I should add."
