"""/v1/responses (OpenAI's Responses API) with the official `openai` client: text in (a string or a message
list, instructions), text out, plain and streamed as its events; function tools answered as function_call
items and their outputs sent back; text.format; bad requests a 400 that says what is accepted."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from chat_templates import QWEN3_THINKING
from helpers import script_replies, tiny_path, tiny_spec
from pyplugin.model.synth import write_gguf

MODEL = "tiny-qwen2"  # ChatML, whose template takes tools
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_path("qwen2", n_ctx=1024), root / f"{MODEL}.gguf")
    write_gguf(root / "thinker.gguf", tiny_spec("qwen2", n_layer=1, n_ctx=1024, chat_template=QWEN3_THINKING))
    return root


@pytest.fixture
def scripted(monkeypatch, models):
    """`write(text)`: the thinker's next replies write `text`, then end."""
    write = script_replies(monkeypatch, models)
    return lambda text: write("thinker", text)


@pytest.fixture(scope="module")
def ai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_plain_text_with_instructions_is_the_chat_it_stands_for(ai):
    r = ai.responses.create(model=MODEL, input="Hi there", instructions="Be brief.", max_output_tokens=5,
                            temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    (message,) = [item for item in r.output if item.type == "message"]
    assert message.role == "assistant" and r.output_text == message.content[0].text
    assert 0 < r.usage.output_tokens <= 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == 5:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # The same conversation through Chat Completions: the same prompt, token for token counted.
    chat = ai.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    listed = ai.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]}])
    assert listed.usage.input_tokens == r.usage.input_tokens


def test_streamed_events_add_up_to_the_response(ai):
    events = list(ai.responses.create(model=MODEL, input="Tell me", max_output_tokens=6, extra_body={"seed": 3}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done.text == final.output_text
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < \
        kinds.index("response.output_text.delta") < kinds.index("response.output_text.done") < \
        kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    assert 1 <= kinds.count("response.output_text.delta") and 1 <= final.usage.output_tokens <= 6


def test_function_tools_give_function_call_items_and_take_their_outputs(ai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ai.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                            max_output_tokens=120, extra_body={"seed": 8})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    back = ask + [call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answered = ai.responses.create(model=MODEL, input=back, tools=[WEATHER], max_output_tokens=3)
    assert answered.usage.input_tokens > r.usage.input_tokens  # the call and its output are in the prompt
    named = ai.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=120, extra_body={"seed": 8},
                                tool_choice={"type": "function", "name": "get_weather"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]

    events = list(ai.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                      max_output_tokens=120, extra_body={"seed": 8}, stream=True))
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    streamed = [item for item in events[-1].response.output if item.type == "function_call"]
    assert [c.arguments for c in streamed] == [args_done.arguments]
    jsonschema.validate(json.loads(args_done.arguments), WEATHER["parameters"])


def test_text_format_json_schema_is_followed(ai):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = ai.responses.create(model=MODEL, input="A number?", max_output_tokens=40, extra_body={"seed": 2},
                            text={"format": {"type": "json_schema", "name": "number", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("extra,says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
    ({"input": [{"role": "robot", "content": "x"}]}, "'input.0.role': Input should be 'user', 'assistant', 'system' or 'developer'"),
    ({"input": []}, "'input' must be a string or a non-empty list"),
    ({"input": "x", "previous_response_id": "resp_1"}, "stores no responses"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "'tool_choice' must be"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "'text.format' must be"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "needs 'call_id' and 'output'"),
    ({"input": "x", "model": "absent"}, "not found"),
])
def test_bad_requests_say_what_is_accepted(ai, extra, says):
    with pytest.raises(openai.APIStatusError) as err:
        ai.responses.create(**{"model": MODEL, **extra})
    assert err.value.status_code in (400, 404) and says in err.value.message


def test_thinking_comes_as_a_reasoning_item_before_the_message(ai, scripted):
    scripted("<think>\nTwo and two make four.\n</think>\n\nIt is 4.")
    r = ai.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "low"},
                            max_output_tokens=100)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two and two make four." and r.output_text == "It is 4."
    events = list(ai.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "high"},
                                      max_output_tokens=100, stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output_text == "It is 4."
    plain = ai.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "none"},
                                max_output_tokens=3)
    assert [item.type for item in plain.output] == ["message"]
