"""Thinking: `think: true` splits a reasoning model's <think>...</think> off its answer, into Ollama's
message.thinking (and generate's `thinking`) and OpenAI's reasoning_content, streamed too; `think: false`
turns thinking off as Ollama does (the template's enable_thinking, else an empty think block); a model
whose template marks no thinking refuses `think: true` with a 400."""

from __future__ import annotations

import json

import pytest
import requests

from chat_templates import DROPS_THINKING, OPENS_THINKING, QWEN3_THINKING
from helpers import script_replies, tiny_spec
from pyplugin.model import load_model
from pyplugin.model.synth import write_gguf
from pyplugin.serving import Engine, GenerationRequest
from pyplugin.serving.reply import ThinkingParser
from server_patch.local import serving

TEMPLATES = {"qwen3": QWEN3_THINKING, "opens": OPENS_THINKING, "drops": DROPS_THINKING}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
REPLY = "<think>\nThe user adds. 2 + 2 is 4.\n</think>\n\nIt is 4."


# ---------------------------------------------------------------------------------------------------
# the parser


def split(text: str, pieces: list[str], inside: bool = False) -> tuple[str, str]:
    parser, thinking, content = ThinkingParser(inside), "", ""
    for piece in pieces:
        t, c = parser.feed(piece)
        thinking, content = thinking + t, content + c
    t, c = parser.feed("", final=True)
    return thinking + t, content + c


@pytest.mark.parametrize("text,inside,expected", [
    (REPLY, False, ("The user adds. 2 + 2 is 4.", "It is 4.")),
    ("  <think>x y</think>answer", False, ("x y", "answer")),
    ("no thinking here", False, ("", "no thinking here")),
    ("<thin", False, ("", "<thin")),
    ("reasoning\nmore</think>\n\nanswer </think>", True, ("reasoning\nmore", "answer </think>")),
    ("<think>\nstill going \n", False, ("still going", "")),
])
def test_thinking_is_split_the_same_however_the_text_is_streamed(text, inside, expected):
    assert split(text, [text], inside) == expected
    assert split(text, list(text), inside) == expected
    for cut in range(1, len(text)):
        assert split(text, [text[:cut], text[cut:]], inside) == expected, cut


def test_thinking_streams_before_it_ends():
    parser = ThinkingParser()
    assert parser.feed("<think>\nFirst") == ("First", "")
    assert parser.feed(" step. </thi") == (" step.", "")  # a space that may end it, and half a tag, kept back
    assert parser.feed("nk>\n\nDone.") == ("", "Done.")


# ---------------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, template in TEMPLATES.items():
        write_gguf(root / f"{name}.gguf", tiny_spec("qwen2", n_layer=1, n_ctx=1024, chat_template=template))
    write_gguf(root / "plain.gguf", tiny_spec("qwen2", n_layer=1, n_ctx=1024))
    return root


@pytest.fixture
def scripted(monkeypatch, models):
    """`write(text)`: the next generations on the qwen3 model write `text` (then end)."""
    write = script_replies(monkeypatch, models)
    return lambda text: write("qwen3", text)


def chat(url, model="qwen3", stream=False, **body):
    body = {"model": model, "messages": QUESTION, "stream": stream, "options": {"num_predict": 100, "seed": 1},
            **body}
    r = requests.post(f"{url}/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()] if stream else r.json()


def openai(url, model="qwen3", stream=False, **body):
    body = {"model": model, "messages": QUESTION, "stream": stream, "max_tokens": 100, "seed": 1, **body}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_think_true_splits_thinking_from_the_answer_on_ollamas_api(url, scripted):
    scripted(REPLY)
    message = chat(url, think=True)["message"]
    assert message == {"role": "assistant", "content": "It is 4.", "thinking": "The user adds. 2 + 2 is 4."}
    lines = chat(url, stream=True, think=True)
    assert "".join(line["message"].get("thinking", "") for line in lines) == message["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == "It is 4."
    first_content = next(i for i, line in enumerate(lines) if line["message"]["content"])
    assert all("thinking" not in line["message"] for line in lines[first_content:])  # thinking came first
    assert sum("thinking" in line["message"] for line in lines) > 1  # and in pieces, as it was written
    generated = requests.post(f"{url}/api/generate", json={"model": "qwen3", "prompt": "2 + 2?", "think": True,
                                                           "stream": False}, timeout=60).json()
    assert (generated["thinking"], generated["response"]) == ("The user adds. 2 + 2 is 4.", "It is 4.")


def test_think_true_gives_reasoning_content_on_openais_api(url, scripted):
    scripted(REPLY)
    message = openai(url, think=True)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user adds. 2 + 2 is 4.", "It is 4.")
    deltas = [c["choices"][0]["delta"] for c in openai(url, stream=True, think=True) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."


def test_without_think_the_text_stays_as_the_model_wrote_it(url, scripted):
    scripted(REPLY)
    assert chat(url)["message"] == {"role": "assistant", "content": REPLY}
    assert openai(url)["choices"][0]["message"] == {"role": "assistant", "content": REPLY}


def prompt_of(models, model: str, **request) -> str:
    engine = Engine(models)
    try:
        job = engine.submit(GenerationRequest(model=model, messages=QUESTION, options={"num_predict": 1}, **request))
        job.result()
        return load_model(models / f"{model}.gguf", progress=False).tokenizer.decode(job.tokens, special=True)
    finally:
        engine.close()


@pytest.mark.parametrize("model,off_ends", [("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                                            ("opens", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                                            ("drops", "<|im_start|>assistant\n<think>\n\n</think>\n\n")])
def test_think_false_turns_thinking_off_as_ollama_does(models, url, model, off_ends):
    """Through the template's enable_thinking (qwen3), else an empty think block: closing the one the prompt
    opened (opens), or written after the prompt (drops)."""
    default, off = prompt_of(models, model), prompt_of(models, model, think=False)
    assert off.endswith(off_ends) and not default.endswith(off_ends)
    assert prompt_of(models, model, think=True) == default
    tokens = openai(url, model, reasoning_effort="none", max_tokens=1)["usage"]["prompt_tokens"]
    assert tokens == len(load_model(models / f"{model}.gguf", progress=False).tokenizer.encode(off))


def test_a_prompt_that_opens_the_block_makes_everything_up_to_its_end_thinking(url, models):
    """No script: a random model writes no </think>, so all it writes is thinking, the same text it writes
    for that prompt sent raw."""
    r = chat(url, "opens", think=True, options={"num_predict": 30, "seed": 3, "temperature": 0})
    raw = requests.post(f"{url}/api/generate", json={
        "model": "opens", "prompt": prompt_of(models, "opens"), "raw": True, "stream": False,
        "options": {"num_predict": 30, "seed": 3, "temperature": 0}}, timeout=60).json()["response"]
    assert r["message"]["content"] == "" and r["message"]["thinking"] == raw.strip() and raw.strip()


@pytest.mark.parametrize("path,body,needle", [
    ("/api/chat", {"model": "plain", "think": True}, "plain does not support thinking"),
    ("/api/generate", {"model": "plain", "prompt": "x", "think": True}, "plain does not support thinking"),
    ("/v1/chat/completions", {"model": "plain", "think": True}, "plain does not support thinking"),
    ("/api/chat", {"model": "qwen3", "think": "extreme"}, "think: got 'extreme'; accepted: true, false, or a level"),
    ("/v1/chat/completions", {"model": "plain", "reasoning_effort": "high"}, "reasoning_effort"),
    ("/api/generate", {"model": "qwen3", "prompt": "x", "raw": True, "think": True}, "chat template"),
])
def test_a_model_that_does_not_think_is_a_clear_400(url, path, body, needle):
    body = {"messages": QUESTION, "stream": False, **body}
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in (r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"])


def test_a_think_level_turns_thinking_on_for_a_model_without_levels(url, scripted):
    """Levels are gpt-oss's reasoning effort (test_harmony.py); another thinking model takes one as true, as
    OpenAI's reasoning_effort."""
    scripted(REPLY)
    assert chat(url, think="low")["message"] == chat(url, think=True)["message"]
    assert openai(url, reasoning_effort="high")["choices"][0]["message"]["reasoning_content"] == \
        "The user adds. 2 + 2 is 4."


def test_think_false_on_a_model_that_does_not_think_changes_nothing(url, models):
    plain = chat(url, "plain", options={"num_predict": 5, "seed": 2})
    off = chat(url, "plain", think=False, options={"num_predict": 5, "seed": 2})
    def prompt(r):  # the whole prompt: what ran plus what the last request left in the cache
        return r["prompt_eval_count"] + r["pebbling"]["cached_tokens"]
    assert off["message"] == plain["message"] and prompt(off) == prompt(plain)


def test_thinking_then_a_tool_call_comes_apart_on_both_apis(url, scripted):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    scripted('<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n'
             '</tool_call>')
    message = chat(url, think=True, tools=[tool])["message"]
    assert message == {"role": "assistant", "content": "", "thinking": "I should add.",
                       "tool_calls": [{"function": {"index": 0, "name": "add", "arguments": {"a": 2, "b": 2}}}]}
    choice = openai(url, think=True, tools=[tool])["choices"][0]
    assert choice["message"]["reasoning_content"] == "I should add." and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    assert choice["finish_reason"] == "tool_calls"
