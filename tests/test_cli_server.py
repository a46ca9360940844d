"""The command line against a `pebbling serve` on loopback: `list`, `ps`, `show`, `stop`, and `run`
through the server giving what `run` in-process gives; prompts from stdin; $PEBBLING_HOST read as
Ollama reads $OLLAMA_HOST; flag errors in one line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

import pyplugin
from helpers import free_port
from pyplugin.cli import build_parser, main
from pyplugin.commands.client import parse_host
from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving

TINY = dict(arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=4096)
GREEDY = ["--temperature", "0", "--num-predict", "6"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    return root


@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory, models_dir) -> Path:
    """Ollama's layout (manifests + blobs) holding the tiny model as someone/tiny:q8."""
    root = tmp_path_factory.mktemp("ollama")
    data = (models_dir / "tiny.gguf").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir()
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / "someone" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}", "size": len(data)}]}))
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    with serving(create_app(models_dir=models_dir)) as url:
        yield url


@pytest.fixture(autouse=True)
def environment(models_dir, ollama_store, monkeypatch):
    """The in-process path reads the same models directory and store as the server; stdin is empty."""
    monkeypatch.setenv("PEBBLING_MODELS", str(models_dir))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


@pytest.fixture
def remote(server, monkeypatch) -> str:
    monkeypatch.setenv("PEBBLING_HOST", server)
    yield server
    for m in requests.get(f"{server}/api/ps", timeout=30).json()["models"]:  # the next test starts unloaded
        requests.post(f"{server}/api/generate", json={"model": m["name"], "keep_alive": 0}, timeout=30)


@pytest.fixture
def local(monkeypatch) -> None:
    monkeypatch.setenv("PEBBLING_HOST", f"127.0.0.1:{free_port()}")


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code


def loaded(url: str) -> list[str]:
    return [m["name"] for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]]


# ---------------------------------------------------------------------------------------------------
# run: through the server, or in-process when none answers


@pytest.mark.parametrize("name", ["tiny", "tiny:latest", "someone/tiny:q8",
                                  "registry.ollama.ai/someone/tiny:q8"])
def test_run_through_the_server_gives_the_in_process_text(name, server, monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", f"127.0.0.1:{free_port()}")
    assert cli("run", name, "hello there", *GREEDY) == 0
    in_process = capsys.readouterr().out
    assert loaded(server) == []  # nothing asked the server
    monkeypatch.setenv("PEBBLING_HOST", server)
    assert cli("run", name, "hello there", *GREEDY) == 0
    through_server = capsys.readouterr().out
    assert len(loaded(server)) == 1  # the server did the work, and keeps the model for its keep_alive
    assert in_process.strip() and through_server == in_process
    requests.post(f"{server}/api/generate", json={"model": name, "keep_alive": 0}, timeout=30)


@pytest.mark.parametrize("where", ["remote", "local"])
def test_run_a_gguf_path_loads_it_in_process(where, models_dir, request, capsys):
    request.getfixturevalue(where)
    assert cli("run", str(models_dir / "tiny.gguf"), "hello there", *GREEDY) == 0
    by_path, err = capsys.readouterr()
    assert ("is a file, loaded in this process" in err) == (where == "remote")
    if where == "remote":
        assert loaded(request.getfixturevalue("server")) == []  # the server never saw the path
    assert cli("run", "tiny", "hello there", *GREEDY) == 0
    assert by_path.strip() and capsys.readouterr().out == by_path


def test_run_keepalive_zero_unloads_after_the_answer(remote, capsys):
    assert cli("run", "tiny", "hi", *GREEDY, "--keepalive", "0") == 0
    assert capsys.readouterr().out.strip()
    assert loaded(remote) == []


@pytest.mark.parametrize("where", ["remote", "local"])
def test_run_system_and_verbose_on_both_paths(where, request, capsys):
    request.getfixturevalue(where)

    def prompt_tokens(*flags: str) -> int:
        assert cli("run", "tiny", "hi", *GREEDY, "--verbose", *flags) == 0
        err = capsys.readouterr().err
        fields = dict(line.split(":", 1) for line in err.splitlines() if ":" in line)
        assert fields["eval count"].strip() == "6 token(s)"
        assert fields["pebbling strategy"].strip() and fields["estimated peak"].strip().endswith("(estimate)")
        return int(fields["prompt eval count"].split()[0])

    assert prompt_tokens("--system", "You answer in one short sentence.") > prompt_tokens() + 5


def test_format_json_constrains_the_answer_on_both_paths(server, monkeypatch, capsys):
    answers = []
    for host in (f"127.0.0.1:{free_port()}", server):
        monkeypatch.setenv("PEBBLING_HOST", host)
        assert cli("run", "tiny", "hi", "--temperature", "0", "--num-predict", "12", "--format", "json",
                   "--stop", "never-seen", "--top-k", "5", "--top-p", "0.5", "--repeat-penalty", "1.2",
                   "--seed", "3", "--keepalive", "0") == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].lstrip().startswith("{")  # random weights, yet JSON


@pytest.mark.parametrize("where", ["remote", "local"])
def test_run_unknown_model_is_one_line(where, request, capsys):
    request.getfixturevalue(where)
    assert cli("run", "nope", "hi") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pebbling: error: ") and "'nope' not found" in err


# ---------------------------------------------------------------------------------------------------
# prompts from stdin


def test_stdin_is_the_prompt_and_comes_before_the_words(local, monkeypatch, capsys):
    assert cli("run", "tiny", "why is the sky blue?", *GREEDY) == 0
    direct = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("why is the sky blue?"))
    assert cli("run", "tiny", *GREEDY) == 0
    assert capsys.readouterr().out == direct
    monkeypatch.setattr("sys.stdin", io.StringIO("why is the sky"))
    assert cli("run", "tiny", "blue?", *GREEDY) == 0
    assert capsys.readouterr().out == direct


def test_empty_stdin_and_no_prompt_is_one_line(local, capsys):
    assert cli("run", "tiny") == 1
    assert "stdin was empty" in capsys.readouterr().err


def test_a_pipe_into_the_command(models_dir, ollama_store):
    root = Path(pyplugin.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "PEBBLING_MODELS": str(models_dir), "PEBBLING_HOST": f"127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-m", "pyplugin.cli", "run", "tiny", *GREEDY, "--verbose"],
                          input="hello there", capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "eval count:           6 token(s)" in done.stderr


# ---------------------------------------------------------------------------------------------------
# list, ps, show, stop


def table(out: str) -> dict[str, list[str]]:
    lines = out.rstrip("\n").splitlines()
    return {line.split()[0]: line.split() for line in lines[1:]}


def test_list_shows_the_servers_models(remote, capsys):
    assert cli("list") == 0
    out = capsys.readouterr().out
    assert out.split()[:4] == ["NAME", "ID", "SIZE", "MODIFIED"]
    rows = table(out)
    tags = requests.get(f"{remote}/api/tags", timeout=30).json()["models"]
    assert set(rows) == {m["name"] for m in tags} and {"tiny:latest", "someone/tiny:q8"} <= set(rows)
    for m in tags:
        assert rows[m["name"]][1] == m["digest"][:12]
    assert " ".join(rows["tiny:latest"][4:]) in ("just now", "1 second ago") or rows["tiny:latest"][-1] == "ago"


def test_ps_shows_what_is_loaded_and_stop_unloads_it(remote, capsys):
    assert cli("ps") == 0
    assert table(capsys.readouterr().out) == {}
    assert cli("run", "tiny", "hi", *GREEDY, "--keepalive", "10m") == 0
    capsys.readouterr()
    assert cli("ps") == 0
    row = " ".join(table(capsys.readouterr().out)["tiny:latest"])
    assert row.endswith(("9 minutes from now", "10 minutes from now")), row
    assert cli("stop", "tiny") == 0
    assert loaded(remote) == []
    assert cli("stop", "tiny") == 1
    assert "model 'tiny' is not loaded; loaded: none" in capsys.readouterr().err


def test_stop_takes_the_name_in_any_form_ollama_takes(remote, capsys):
    assert cli("run", "someone/tiny:q8", "hi", *GREEDY) == 0
    assert loaded(remote) == ["someone/tiny:q8"]
    assert cli("stop", "registry.ollama.ai/someone/tiny:q8") == 0
    assert loaded(remote) == []


@pytest.mark.parametrize("field", ["modelfile", "parameters", "template", "system", "license"])
def test_show_prints_the_field_the_server_returns(remote, field, capsys):
    answer = requests.post(f"{remote}/api/show", json={"model": "tiny"}, timeout=30).json()
    code = cli("show", "tiny", f"--{field}")
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out == answer.get(field, "").rstrip("\n") + "\n"  # blank where the model has none, as ollama shows it


def test_show_summarises_and_json_is_the_whole_answer(remote, capsys):
    assert cli("show", "tiny") == 0
    out = capsys.readouterr().out
    assert "architecture        llama" in out and "context length      4096" in out
    assert cli("show", "tiny", "--json") == 0
    assert json.loads(capsys.readouterr().out) == requests.post(f"{remote}/api/show", json={"model": "tiny"},
                                                                timeout=30).json()
    assert cli("show", "nope") == 1
    assert "'nope' not found" in capsys.readouterr().err


def test_no_server_is_one_line_naming_the_address(local, capsys):
    assert cli("list") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not reach pebbling serve at http://127.0.0.1:" in err


# ---------------------------------------------------------------------------------------------------
# $PEBBLING_HOST, flags, help


@pytest.mark.parametrize("text,url", [
    ("", "http://127.0.0.1:11435"),
    ("example.org", "http://example.org:11435"),
    ("127.0.0.1:8080", "http://127.0.0.1:8080"),
    (":9000", "http://127.0.0.1:9000"),
    ("0.0.0.0", "http://127.0.0.1:11435"),
    ("[::1]:7000", "http://[::1]:7000"),
    ("http://box", "http://box:80"),
    ("https://box:8443/ollama/", "https://box:8443/ollama"),
    (' "localhost:1234" ', "http://localhost:1234"),
])
def test_host_is_read_as_ollama_reads_its_host(text, url):
    assert parse_host(text).url == url


def test_serve_listens_where_the_clients_call(monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", "0.0.0.0:12001")
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("0.0.0.0", 12001)
    assert parse_host("0.0.0.0:12001").url == "http://127.0.0.1:12001"  # where run, list... dial it
    monkeypatch.setenv("PEBBLING_HOST", "[::1]")
    assert vars(build_parser().parse_args(["serve", "--port", "12002"]))["host"] == "::1"
    monkeypatch.setenv("PEBBLING_HOST", "box:port")
    assert cli("serve") == 1
    assert "$PEBBLING_HOST is 'box:port': port 'port'" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [("ftp://box", "scheme 'ftp'"), ("box:99999", "port '99999'"),
                                          ("box:http", "port 'http'")])
def test_bad_host_is_one_line(text, message, monkeypatch, capsys):
    monkeypatch.setenv("PEBBLING_HOST", text)
    assert cli("ps") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$PEBBLING_HOST" in err and message in err


@pytest.mark.parametrize("flags,code,message", [
    (["--temperature", "-1"], 1, "--temperature -1.0: not accepted; accepted: a number >= 0"),
    (["--top-k", "-3"], 1, "--top-k -3: not accepted; accepted: an integer"),
    (["--top-p", "2"], 1, "--top-p 2.0: not accepted; accepted: a number from 0 to 1"),
    (["--repeat-penalty", "-1"], 1, "--repeat-penalty -1.0: not accepted"),
    (["--num-ctx", "0"], 1, "--num-ctx 0: not accepted"),
    (["--num-predict", "-5"], 1, "--num-predict -5: not accepted"),
    (["--keepalive", "soon"], 1, "--keepalive 'soon': not a duration; accepted:"),
    (["--pebbling-strategy", "fastest"], 1, "unknown strategy 'fastest'"),
    (["--pebbling-memory-limit", "lots"], 1, "--pebbling-memory-limit must be"),
    (["--format", "yaml"], 2, "argument --format: invalid choice: 'yaml'"),
    (["--seed", "1.5"], 2, "argument --seed: invalid int value"),
    (["--temperature", "hot"], 2, "argument --temperature: invalid float value"),
])
def test_bad_run_flags_are_one_line_naming_the_flag(local, flags, code, message, capsys):
    assert cli("run", "tiny", "hi", *flags) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.rstrip().splitlines()[-1], err
    if code == 1:
        assert err.count("\n") == 1


def test_version_and_help_texts_without_markup(capsys):
    assert cli("--version") == 0
    assert capsys.readouterr().out.startswith("pebbling ")
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"run", "serve", "list", "ps", "show", "stop", "estimate", "verify", "info"} <= set(commands)
    for name, sub in commands.items():
        text = sub.format_help()
        assert "`" not in text and "``" not in text, name
