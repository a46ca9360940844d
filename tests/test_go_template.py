"""Go's text/template as Ollama executes it: each construct, Ollama's published templates against the
prompts Ollama renders from them, tools and tool calls through the Qwen 3 and Llama 3.2 templates, the
older System/Prompt/Response templates, and the errors and limits."""

from __future__ import annotations

import threading
import time

import pytest

from chat_templates import OLLAMA_LLAMA32_GO, OLLAMA_QWEN3_GO
from ollama_templates import CONVERSATIONS, RENDERED, TEMPLATES
from pyplugin.errors import OptionsError
from pyplugin.model import chat
from pyplugin.serving import go_template
from pyplugin.serving.go_functions import GoTemplateError
from pyplugin.serving.go_template import GoTemplate, render_go_template


def render(source: str, **data) -> str:
    return GoTemplate(source).render(data)


# -- constructs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,data,expected", [
    ("{{ .A }}-{{ .B.C }}", {"A": "x", "B": {"C": 3}}, "x-3"),
    ("a  {{- .A -}}  b", {"A": "x"}, "axb"),
    ("a {{/* a comment, don't */}} b {{- /* trimmed */ -}} c", {}, "a  bc"),
    ("{{ if .A }}yes{{ else if .B }}b{{ else }}no{{ end }}", {"A": 0, "B": "z"}, "b"),
    ("{{ if and .A .B }}1{{ end }}{{ if or .A .B }}2{{ end }}{{ if not .A }}3{{ end }}", {"A": "", "B": 1}, "23"),
    ("{{ and .A .B }}|{{ or .A .B }}", {"A": "", "B": "b"}, "|b"),
    ("{{ range .L }}[{{ . }}]{{ else }}none{{ end }}", {"L": [1, 2]}, "[1][2]"),
    ("{{ range .L }}[{{ . }}]{{ else }}none{{ end }}", {"L": []}, "none"),
    ("{{ range $i, $v := .L }}{{ $i }}={{ $v }};{{ end }}", {"L": ["a", "b"]}, "0=a;1=b;"),
    ("{{ range $k, $v := .M }}{{ $k }}:{{ $v }} {{ end }}", {"M": {"b": 2, "a": 1}}, "a:1 b:2 "),
    ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}",
     {"L": [1, 2, 3, 4, 5]}, "13"),
    ("{{ with .A }}<{{ . }}>{{ else }}empty{{ end }}", {"A": "v"}, "<v>"),
    ("{{ with .A }}<{{ . }}>{{ else with .B }}b={{ . }}{{ end }}", {"A": "", "B": 2}, "b=2"),
    ("{{ $x := .A }}{{ $x }}{{ $x = \"changed\" }}{{ $x }}", {"A": "first"}, "firstchanged"),
    ("{{ range .L }}{{ $.Top }}{{ end }}", {"L": [1, 2], "Top": "t"}, "tt"),
    ("{{ len .L }} {{ len .S }} {{ index .L 1 }} {{ index .M \"k\" }}", {"L": [5, 6], "S": "é", "M": {"k": "v"}},
     "2 2 6 v"),
    ("{{ slice .L 1 }} {{ slice .L 0 1 }} {{ len (slice .L 1) }}", {"L": [1, 2, 3]}, "[2 3] [1] 2"),
    ("{{ eq .A 1 2 3 }} {{ ne .A 1 }} {{ lt .A 5 }} {{ le .A 3 }} {{ gt .S \"a\" }} {{ ge .A 4 }}",
     {"A": 3, "S": "b"}, "true true true true true false"),
    ("{{ print \"a\" 1 2 \"b\" }}|{{ printf \"%s=%d %q\" \"k\" 7 \"v\" }}|{{ println 1 2 }}", {}, "a1 2b|k=7 \"v\"|1 2\n"),
    ("{{ .A | printf \"<%s>\" }} {{ \"x\" | print \"y\" }}", {"A": "p"}, "<p> yx"),
    ("{{ json .M }} {{ json .S }}", {"M": {"b": [1, "<&>"], "a": None}, "S": "q\""},
     '{"a":null,"b":[1,"\\u003c\\u0026\\u003e"]} "q\\""'),
    ("{{ (index .L 0).Name }}", {"L": [{"Name": "n"}]}, "n"),
    ("{{ .Missing }}|{{ if .Missing }}x{{ end }}", {}, "<no value>|"),
    ("{{ true }} {{ false }} {{ 1.5 }} {{ 0x10 }} {{ 'a' }} {{ `raw\\n` }} {{ nil | print }}", {},
     "true false 1.5 16 97 raw\\n <nil>"),
])
def test_each_construct_renders_as_go_renders_it(source, data, expected):
    assert render(source, **data) == expected


@pytest.mark.parametrize("source,message", [
    ("{{ if .A }}x", "has no {{ end }}"),
    ("{{ end }}", "without an if"),
    ("{{ else }}", "outside an if"),
    ("{{ template \"x\" }}", "not supported"),
    ("{{ define \"x\" }}{{ end }}", "not supported"),
    ("{{ .A", "not closed"),
    ("{{ nope }}", "'nope' is not defined"),
    ("{{ \"a\" 1 }}", "only a function takes arguments"),
    ("{{ $y }}", r"undefined variable \$y"),
    ("{{ len 3 }}", "len of"),
    ("{{ index .L 5 }}", "out of range"),
    ("{{ lt 1 \"a\" }}", "incompatible types"),
    ("{{ break }}", "outside a range"),
    ("{{ range .L }}{{ .Name }}{{ end }}", "can't evaluate field Name"),
])
def test_what_is_wrong_or_not_implemented_is_an_error_that_says_so(source, message):
    with pytest.raises(OptionsError, match=message):
        render(source, L=[1], A=1)


def test_rendering_is_bounded_in_output_and_time(monkeypatch):
    monkeypatch.setattr(chat, "MAX_OUTPUT", 1000)
    import pyplugin.serving.go_template as go
    monkeypatch.setattr(go, "MAX_OUTPUT", 1000)
    with pytest.raises(OptionsError, match="more than 1000 characters"):
        render("{{ range .L }}{{ range $.L }}xxxxxxxxxx{{ end }}{{ end }}", L=list(range(100)))
    monkeypatch.setattr(go, "MAX_SECONDS", 0.0)
    with pytest.raises(OptionsError, match="took more than"):
        render("{{ range .L }}{{ range $.L }}{{ end }}{{ end }}", L=list(range(100)))


# -- Ollama's published templates ------------------------------------------------------------------------

@pytest.mark.parametrize("name,case", sorted(RENDERED))
def test_ollamas_templates_render_what_ollama_renders(name, case):
    assert GoTemplate(TEMPLATES[name]).render_chat(CONVERSATIONS[case]) == RENDERED[(name, case)]


def test_consecutive_messages_of_a_role_are_merged_and_system_messages_joined():
    template = GoTemplate("{{ .System }}|{{ range .Messages }}{{ .Role }}:{{ .Content }};{{ end }}")
    messages = [{"role": "system", "content": "s1"}, {"role": "user", "content": "a"},
                {"role": "user", "content": "b"}, {"role": "system", "content": "s2"},
                {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"}]
    assert template.render_chat(messages) == "s1\n\ns2|system:s1;user:a\n\nb;system:s2;tool:t1;tool:t2;"


# -- older templates: System, Prompt and Response, once per exchange (Ollama's own cases) -----------------

MISTRAL_OLD = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] "
MISTRAL_OLD_RESPONSE = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] {{ .Response }}"
CHATML_OLD = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
              "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")
HELLO = [{"role": "user", "content": "Hello friend!"}, {"role": "assistant", "content": "Hello human!"},
         {"role": "user", "content": "What is your name?"}]


@pytest.mark.parametrize("source", [MISTRAL_OLD, MISTRAL_OLD_RESPONSE])
def test_an_older_template_runs_once_per_exchange_and_stops_at_the_response(source):
    template = GoTemplate(source)
    assert not template.reads_messages
    assert template.render_chat(HELLO) == "[INST] Hello friend![/INST] Hello human![INST] What is your name?[/INST] "
    system = [{"role": "system", "content": "You are a helpful assistant!"}] + HELLO
    assert template.render_chat(system) == ("[INST] You are a helpful assistant!\n\nHello friend![/INST] Hello human!"
                                            "[INST] What is your name?[/INST] ")


def test_an_older_chatml_template_leaves_the_last_answer_open():
    system = [{"role": "system", "content": "You are a helpful assistant!"}] + HELLO
    assert GoTemplate(CHATML_OLD).render_chat(system) == (
        "<|im_start|>system\nYou are a helpful assistant!<|im_end|>\n<|im_start|>user\nHello friend!<|im_end|>\n"
        "<|im_start|>assistant\nHello human!<|im_end|>\n<|im_start|>user\nWhat is your name?<|im_end|>\n"
        "<|im_start|>assistant\n")


# -- tools -----------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"unit": {"type": "string", "enum": ["c", "f"], "description": "Unit"},
                                  "city": {"type": "string", "description": "City"}}}}}
WEATHER_JSON = ('{"type":"function","function":{"name":"get_weather","description":"The weather in a city",'
                '"parameters":{"type":"object","required":["city"],"properties":{"city":{"type":"string",'
                '"description":"City"},"unit":{"type":"string","description":"Unit","enum":["c","f"]}}}}}')
FUNCTION_JSON = WEATHER_JSON[len('{"type":"function","function":'):-1]
CALL_TURN = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}}]},
             {"role": "tool", "content": "21 degrees", "tool_name": "get_weather"}]


def test_a_tool_prints_as_ollamas_json():
    assert render("{{ range .Tools }}{{ . }}{{ end }}", Tools=[]) == ""
    template = GoTemplate("{{ range .Tools }}{{ . }}|{{ .Function }}|{{ .Function.Name }}{{ end }}"
                          "{{ range .Messages }}{{ end }}")
    assert template.render_chat([{"role": "user", "content": "x"}], tools=[WEATHER]) == \
        f"{WEATHER_JSON}|{FUNCTION_JSON}|get_weather"


def test_qwen3s_template_renders_tools_calls_and_results():
    out = GoTemplate(OLLAMA_QWEN3_GO).render_chat([{"role": "system", "content": "Be brief."}] + CALL_TURN,
                                                  tools=[WEATHER])
    # Worked out by hand from the template: the system turn with the tools, the user turn, the call
    # written back with its arguments as JSON (keys sorted, as Go marshals a map), the result as a user
    # turn, and the assistant's turn opened.
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f'{{"type": "function", "function": {FUNCTION_JSON}}}\n</tools>\n\nFor each function call, return a json '
        "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_llama32s_template_offers_the_tools_with_the_last_user_message():
    out = GoTemplate(OLLAMA_LLAMA32_GO).render_chat([{"role": "user", "content": "Weather in Paris?"}],
                                                    tools=[WEATHER])
    assert out == (
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n"
        "When you receive a tool call response, use the output to format an answer to the orginal user "
        "question.\n\nYou are a helpful assistant with tool calling capabilities.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
        "for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
        'format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use '
        f"variables.\n\n{WEATHER_JSON}\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    after = GoTemplate(OLLAMA_LLAMA32_GO).render_chat(CALL_TURN, tools=[WEATHER])
    assert after.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
        '{"city":"Paris","unit":"c"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n21 degrees<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_think_and_is_think_set_reach_the_template():
    template = GoTemplate("{{ if .IsThinkSet }}{{ if .Think }}on{{ else }}off{{ end }}{{ else }}unset{{ end }}"
                          "{{ range .Messages }}{{ end }}")
    user = [{"role": "user", "content": "x"}]
    assert [template.render_chat(user, think=t) for t in (None, True, False)] == ["unset", "on", "off"]


# -- slow renderings take turns -------------------------------------------------------------------------

def test_slow_renderings_run_one_at_a_time(monkeypatch):
    """Past SLOW_RENDER_SECONDS a rendering goes on only in its turn: of three slow ones in three threads,
    never two at once past that point, and each gives its whole text."""
    holders, most = [0], [0]
    turn = threading.RLock()

    class Counted:
        def acquire(self):
            turn.acquire()
            holders[0] += 1
            most[0] = max(most[0], holders[0])

        def release(self):
            holders[0] -= 1
            turn.release()

    monkeypatch.setattr(go_template, "SLOW_RENDER_SECONDS", 0.0)
    monkeypatch.setattr(go_template, "_SLOW_TURN", Counted())
    texts = []
    threads = [threading.Thread(target=lambda: texts.append(render_go_template(
        "{{range 20000}}{{if eq . 19999}}{{.}}{{end}}{{end}}", {}))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts == ["19999"] * 3 and most[0] == 1 and holders[0] == 0


def test_the_wait_for_a_turn_does_not_count_against_the_time_limit(monkeypatch):
    monkeypatch.setattr(go_template, "SLOW_RENDER_SECONDS", 0.0)
    monkeypatch.setattr(go_template, "MAX_SECONDS", 0.2)
    go_template._SLOW_TURN.acquire()  # another slow rendering has the turn for longer than the limit
    result = []
    worker = threading.Thread(target=lambda: result.append(render_go_template("{{range 3}}{{.}}{{end}}", {})))
    worker.start()
    time.sleep(0.4)
    assert result == []  # still waiting
    go_template._SLOW_TURN.release()
    worker.join(timeout=10)
    assert result == ["012"]
    with pytest.raises(GoTemplateError, match="took more than 0.2 s"):  # its own running still counts
        render_go_template("{{range 100000000}}{{if ge . 99999999}}{{break}}{{end}}{{end}}", {})


def test_only_templates_of_a_real_size_are_kept_parsed():
    small = "{{ .Prompt }} small"
    big = "{{ .Prompt }}" + "x" * (go_template.CACHED_SOURCE + 1)
    assert go_template.parsed(small) is go_template.parsed(small)
    assert go_template.parsed(big) is not go_template.parsed(big)  # parsed each time, never kept
    assert render_go_template(big, {"Prompt": "p"}) == "p" + "x" * (go_template.CACHED_SOURCE + 1)
