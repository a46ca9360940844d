"""The chat of `pebbling run MODEL` (no prompt): driven through a pseudo-terminal as a person types
it, in-process and through a server; and its commands one by one."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

import pyplugin
from helpers import free_port
from pyplugin.commands import chat
from pyplugin.errors import PebblingError

pexpect = pytest.importorskip("pexpect", reason="the terminal test needs pexpect (the 'test' extra)")

PROMPT = ">>> "
ACCEPTED = "\x1b[?2004l"  # prompt_toolkit leaves bracketed-paste mode once Enter accepts a line


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def server(models_dir):
    from server_patch import create_app
    from server_patch.local import serving

    with serving(create_app(models_dir=models_dir)) as url:
        yield url


def spawn(models_dir: Path, host: str, *flags: str):
    root = Path(pyplugin.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "PEBBLING_MODELS": str(models_dir), "PEBBLING_HOST": host, "TERM": "xterm",
           "PROMPT_TOOLKIT_NO_CPR": "1"}  # pexpect's terminal does not answer cursor-position queries
    return pexpect.spawn(sys.executable, ["-m", "pyplugin.cli", "run", "pebbling-demo", *flags], env=env,
                         encoding="utf-8", timeout=120, dimensions=(50, 200))


def turn(child, text: str) -> dict[str, int]:
    """Types a message and waits for its answer's timings (the chat runs --verbose)."""
    child.expect_exact(PROMPT)
    child.sendline(text)
    child.expect(r"prompt eval count:\s+(\d+) token")
    prompt = int(child.match.group(1))
    child.expect(r"prompt cached:\s+(\d+) token")
    cached = int(child.match.group(1))
    child.expect(r"\neval count:\s+(\d+) token")
    return {"prompt": prompt + cached, "cached": cached, "eval": int(child.match.group(1))}


@pytest.mark.parametrize("where", ["in-process", "server"])
def test_a_chat_typed_at_a_terminal(where, models_dir, request):
    host = request.getfixturevalue("server") if where == "server" else f"127.0.0.1:{free_port()}"
    child = spawn(models_dir, host, "--temperature", "0", "--num-predict", "3", "--verbose")
    try:
        first = turn(child, "hello there")
        second = turn(child, "hello there")
        # The history is sent again: the same message costs its own tokens plus the first exchange.
        assert second["prompt"] > 2 * first["prompt"] - 10 and second["prompt"] > first["prompt"] + 5
        assert second["cached"] >= first["prompt"]  # the first exchange came from the cache
        assert first["eval"] <= 3 and second["eval"] <= 3
        child.expect_exact(PROMPT)
        child.sendline("/set parameter num_predict 8")
        child.expect_exact("Set parameter 'num_predict' to '8'")
        third = turn(child, '"""tell me\nmore"""')
        assert 3 < third["eval"] <= 8
        child.expect_exact(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(models_dir):
    child = spawn(models_dir, f"127.0.0.1:{free_port()}", "--num-ctx", "2048")  # noise until 2048 tokens
    try:
        child.expect_exact(PROMPT)
        child.sendline("write forever")
        child.expect_exact(ACCEPTED)  # the line is read and the answer is being written
        child.expect(r"\w")
        started = time.monotonic()
        child.sendintr()
        child.expect_exact(PROMPT)
        assert time.monotonic() - started < 10  # the rest of the 2048 tokens were not generated
        child.sendintr()  # at the prompt: a reminder, as ollama gives
        child.expect_exact("Use Ctrl + d or /bye to exit.")
        child.expect_exact(PROMPT)
        child.sendline("/show info")
        child.expect_exact("architecture        llama")
        child.expect_exact(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_d_ends_the_chat(models_dir):
    child = spawn(models_dir, f"127.0.0.1:{free_port()}")
    try:
        child.expect_exact(PROMPT)
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


# ---------------------------------------------------------------------------------------------------
# the commands, without a terminal


def lines(*typed: str):
    queue = list(typed)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)
    return read


@pytest.mark.parametrize("typed,message", [
    (["one line"], "one line"),
    (['"""all on one"""'], "all on one"),
    (['"""', "first", "second", '"""'], "first\nsecond"),
    (['"""first', "second", 'third"""'], "first\nsecond\nthird"),
])
def test_multi_line_messages_between_triple_quotes(typed, message):
    assert chat._message(lines(*typed)) == message


class FakeSession:
    def __init__(self):
        self.options, self.system, self.messages, self.verbose, self.format = {}, None, [{"role": "user"}], False, None


def test_set_commands_change_the_session(capsys):
    s = FakeSession()
    assert chat.command(s, "/set parameter num_predict 8") is None
    assert chat.command(s, "/set parameter temperature 0.5") is None
    chat.command(s, "/set parameter stop <end>")
    chat.command(s, "/set parameter stop ###")
    chat.command(s, "/set parameter pebbling_strategy every:2")
    assert s.options == {"num_predict": 8, "temperature": 0.5, "stop": ["<end>", "###"],
                         "pebbling_strategy": "every:2"}
    chat.command(s, "/set system You are a pirate.")
    chat.command(s, "/set verbose")
    chat.command(s, "/set format json")
    assert (s.system, s.verbose, s.format) == ("You are a pirate.", True, "json")
    chat.command(s, "/set think high")
    assert s.think == "high"
    chat.command(s, "/set nothink")
    assert s.think is False
    chat.command(s, "/set think")
    assert s.think is True
    chat.command(s, "/clear")
    assert s.messages == []
    assert chat.command(s, "/bye") == "bye"
    out = capsys.readouterr().out
    assert "Set parameter 'num_predict' to '8'" in out and "Set system message." in out


@pytest.mark.parametrize("line,message", [
    ("/set parameter num_predict lots", "option 'num_predict'"),
    ("/set parameter top_p 7", "option 'top_p'"),
    ("/set parameter warmth 3", "option 'warmth' is not an option pebbling knows"),
    ("/set parameter pebbling_strategy fastest", "unknown strategy 'fastest'"),
])
def test_a_bad_parameter_is_refused_and_not_kept(line, message, capsys):
    s = FakeSession()
    chat.command(s, line)
    assert s.options == {}
    assert message in capsys.readouterr().err


def test_set_parameter_raises_for_the_caller():
    with pytest.raises(PebblingError, match="option 'num_ctx'"):
        chat.set_parameter({}, "num_ctx", "0")


def test_unknown_commands_and_help(capsys):
    s = FakeSession()
    chat.command(s, "/teleport")
    chat.command(s, "/?")
    out = capsys.readouterr().out
    assert "Unknown command '/teleport'. Type /? for help" in out
    assert all(re.search(rf"^\s+{re.escape(c)}", out, re.M) for c in ("/set parameter", "/set system", "/bye"))


class Answering(FakeSession):
    """Records what would be sent; the backend answers /show as a server does."""

    class backend:
        @staticmethod
        def show(model):
            return {"template": "{{ .Prompt }}", "parameters": "stop <end>", "license": "MIT",
                    "details": {"family": "llama", "parameter_size": "1.2M", "quantization_level": "Q8_0"},
                    "model_info": {"llama.context_length": 4096}, "capabilities": ["completion"]}

    model = "m"

    def __init__(self):
        super().__init__()
        self.sent = []

    def answer(self, text):
        self.sent.append(text)


def test_the_chat_reads_plain_lines_without_a_terminal(monkeypatch, capsys):
    """stdout is not a terminal under pytest: lines are read plainly, up to the end of input."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('hi\n\n/set system Be brief.\n"""one\ntwo"""\n/nope\n'))
    s = Answering()
    assert chat.chat(s) == 0
    assert s.sent == ["hi", "one\ntwo"] and s.system == "Be brief."
    out = capsys.readouterr().out
    assert out.count(">>> ") == 6 and out.count("... ") == 1 and "Unknown command '/nope'" in out


@pytest.mark.parametrize("topic,shown", [("template", "{{ .Prompt }}"), ("license", "MIT"),
                                         ("parameters", "stop <end>"), ("system", "No system message"),
                                         ("info", "quantization        Q8_0")])
def test_show_prints_what_the_backend_says(topic, shown, capsys):
    chat.command(Answering(), f"/show {topic}")
    assert shown in capsys.readouterr().out
