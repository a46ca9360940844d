"""The command line as Ollama's users use it (issue 47), through the installed `pebbling` command:
one models directory for the server and every command (the ./models that `make serve` fills is found by
`estimate`, `verify` and `run` as by `serve`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from helpers import free_port
from pyplugin.model.synth import write_gguf

TINY = dict(arch="llama", n_layer=4, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=4096)
PEBBLING = Path(sys.executable).with_name("pebbling")  # the console script the package installs


def pebbling(*args: str, cwd: Path, env: dict[str, str], input: str | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess:
    assert PEBBLING.is_file(), f"the pebbling command is not installed beside {sys.executable}"
    return subprocess.run([str(PEBBLING), *args], cwd=cwd, env=env, input=input, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def project(tmp_path) -> Path:
    """A directory as `make serve` leaves it: ./models holding smollm2:135m (a tiny stand-in)."""
    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    write_gguf(root / "models" / "smollm2:135m.gguf", **TINY)
    return root


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's environment with nothing set for pebbling: no $PEBBLING_MODELS, a home of its own, an empty
    Ollama store, and no server where the commands would look for one."""
    env = {k: v for k, v in os.environ.items() if k not in ("PEBBLING_MODELS", "PEBBLING_HOST")}
    (tmp_path / "home").mkdir()
    (tmp_path / "ollama").mkdir()
    env.update(HOME=str(tmp_path / "home"), OLLAMA_MODELS=str(tmp_path / "ollama"),
               PEBBLING_HOST=f"127.0.0.1:{free_port()}")
    return env


# ---------------------------------------------------------------------------------------------------
# one models directory


@pytest.mark.parametrize("command", [["estimate", "smollm2:135m"],
                                     ["verify", "smollm2:135m", "--num-predict", "2"],
                                     ["run", "smollm2:135m", "hello", "--num-predict", "3", "--temperature", "0"]])
def test_offline_commands_find_the_model_make_serve_serves(command, project, user_env):
    done = pebbling(*command, cwd=project, env=user_env)
    assert done.returncode == 0, done.stderr
    assert "not found" not in done.stderr and done.stdout.strip()


def test_serve_without_models_serves_the_directory_the_commands_read(project, user_env):
    port = free_port()
    env = {**user_env, "PEBBLING_HOST": f"127.0.0.1:{port}"}
    with open(project / "serve.log", "w+") as log:
        server = subprocess.Popen([str(PEBBLING), "serve", "--log-level", "warning"], cwd=project, env=env,
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    tags = requests.get(f"{url}/api/tags", timeout=5).json()["models"]
                    break
                except requests.ConnectionError:
                    assert server.poll() is None and time.monotonic() < deadline, log.read()
                    time.sleep(0.2)
            assert "smollm2:135m" in {m["name"] for m in tags}
            # run goes to that server, which serves the same file
            done = pebbling("run", "smollm2:135m", "hello", "--num-predict", "3", "--temperature", "0",
                            cwd=project, env=env)
            assert done.returncode == 0, done.stderr
            assert [m["name"] for m in requests.get(f"{url}/api/ps", timeout=30).json()["models"]] == ["smollm2:135m"]
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_pebbling_models_wins_and_elsewhere_the_cache_is_the_models_directory(project, user_env, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    done = pebbling("estimate", "smollm2:135m", cwd=project, env={**user_env, "PEBBLING_MODELS": str(other)})
    assert done.returncode == 1 and f"not in {other}" in done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = pebbling("estimate", "smollm2:135m", cwd=elsewhere, env=user_env)
    cache = Path(user_env["HOME"]) / ".cache" / "pebbling" / "models"
    assert done.returncode == 1 and f"not in {cache}" in done.stderr
    cache.mkdir(parents=True)
    (project / "models" / "smollm2:135m.gguf").rename(cache / "smollm2:135m.gguf")
    done = pebbling("estimate", "smollm2:135m", cwd=elsewhere, env=user_env)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------------
# create -f Modelfile, show --modelfile, cp, rm, push: against a server


TEMPLATE = '''{{- if .System }}<|system|>{{ .System }}<|end|>{{ end }}
{{- range .Messages }}<|{{ .Role }}|>{{ .Content }}<|end|>
{{ end }}<|assistant|>'''
EVERY_INSTRUCTION = f'''# a Modelfile with every instruction pebbling takes
FROM ./weights/base.gguf
parameter temperature 0.2
PARAMETER num_predict 3
PARAMETER stop "<|end|>"
PARAMETER stop    """###"""
PARAMETER pebbling_strategy minimal
TEMPLATE """{TEMPLATE}"""
system """You are Mario.
  Answer "briefly"."""
MESSAGE user Who are you?
MESSAGE assistant "It's-a me!"
License MIT
LICENSE """Be kind."""
'''


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ollama")


@pytest.fixture(scope="module")
def server_models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    write_gguf(root / "tiny.gguf", **TINY)
    return root


@pytest.fixture(scope="module")
def server(store, server_models):
    from server_patch import create_app
    from server_patch.local import serving

    patch = pytest.MonkeyPatch()
    patch.setenv("OLLAMA_MODELS", str(store))
    with serving(create_app(models_dir=server_models)) as url:
        yield url
    patch.undo()


@pytest.fixture
def env(server, store) -> dict[str, str]:
    return {**os.environ, "PEBBLING_HOST": server, "OLLAMA_MODELS": str(store)}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The GGUF file a Modelfile names, in a directory of its own beside the Modelfile."""
    root = tmp_path_factory.mktemp("modelfiles")
    (root / "weights").mkdir()
    write_gguf(root / "weights" / "base.gguf", **{**TINY, "seed": 47})
    return root / "weights" / "base.gguf"


def show(url: str, name: str) -> dict:
    answer = requests.post(f"{url}/api/show", json={"model": name}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def names(url: str) -> set[str]:
    return {m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}


def model_blob(store: Path, name: str) -> str:
    from pyplugin.serving import ollama_store

    found = ollama_store.resolve(name, store)
    assert found is not None, name
    return found.digest


def sha256_of(path: Path) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def created(name: str, text: str, where: Path, env: dict[str, str], *, cwd: Path | None = None) -> None:
    (where / f"{name}.Modelfile").write_text(text)
    done = pebbling("create", name, "-f", str(where / f"{name}.Modelfile"), cwd=cwd or where, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "success"


def test_create_takes_every_instruction_from_the_file_beside_the_modelfile(server, store, base, env, tmp_path):
    # run from elsewhere: FROM's relative path is the Modelfile's directory's, as in Ollama
    created("mario", EVERY_INSTRUCTION, base.parent.parent, env, cwd=tmp_path)
    assert "mario:latest" in names(server)
    assert model_blob(store, "mario") == sha256_of(base)  # the file was uploaded as a blob
    shown = show(server, "mario")
    assert shown["template"] == TEMPLATE and shown["system"] == 'You are Mario.\n  Answer "briefly".'
    assert shown["parameters"].splitlines() == ["temperature     0.2", "num_predict     3", 'stop            "<|end|>"',
                                                'stop            "###"', 'pebbling_strategy "minimal"']
    assert shown["license"] == "MIT\nBe kind."
    reply = requests.post(f"{server}/api/chat", json={"model": "mario", "stream": False,
                                                      "messages": [{"role": "user", "content": "Hi"}]}, timeout=60).json()
    assert reply["eval_count"] <= 3 and reply["pebbling"]["strategy"] == "minimal"  # the parameters apply


def test_show_modelfile_creates_the_same_model_again(server, store, base, env, tmp_path):
    created("mario", EVERY_INSTRUCTION, base.parent.parent, env)
    printed = pebbling("show", "mario", "--modelfile", cwd=tmp_path, env=env)
    assert printed.returncode == 0, printed.stderr
    modelfile = printed.stdout
    assert "FROM mario:latest" not in modelfile.replace("# FROM mario:latest", "")  # not itself
    assert f"\nFROM {sha256_of(base)}\n" in modelfile  # its blob, never a path
    created("luigi", modelfile, tmp_path, env)
    first, second = show(server, "mario"), show(server, "luigi")
    for field in ("template", "system", "parameters", "license", "capabilities"):
        assert second[field] == first[field], field
    assert model_blob(store, "luigi") == model_blob(store, "mario")
    again = pebbling("show", "luigi", "--modelfile", cwd=tmp_path, env=env).stdout
    assert again == modelfile.replace("# FROM mario:latest", "# FROM luigi:latest")  # messages too, in order
    assert "MESSAGE user Who are you?" in again or 'MESSAGE user "Who are you?"' in again


def test_a_gguf_s_own_jinja_template_stays_out_of_the_modelfile(server, store, server_models, env, tmp_path):
    shown = show(server, "tiny")
    assert "{%" in shown["template"]  # the GGUF's chat template is Jinja
    modelfile = pebbling("show", "tiny", "--modelfile", cwd=tmp_path, env=env).stdout
    assert "TEMPLATE" not in modelfile and "{%" not in modelfile
    assert "\nFROM tiny:latest\n" in modelfile  # a file of the models directory, by its name
    created("tiny-again", modelfile + 'SYSTEM "Be brief."\n', tmp_path, env)
    again = show(server, "tiny-again")
    assert again["template"] == shown["template"] and again["system"] == "Be brief."
    assert model_blob(store, "tiny-again") == sha256_of(server_models / "tiny.gguf")


def test_from_a_blob_or_a_model(server, store, base, env, tmp_path):
    created("mario", EVERY_INSTRUCTION, base.parent.parent, env)
    created("by-blob", f"FROM {sha256_of(base)}\nSYSTEM Hi.\n", tmp_path, env)
    assert model_blob(store, "by-blob") == sha256_of(base) and show(server, "by-blob")["system"] == "Hi."
    created("by-model", "FROM mario\nSYSTEM It's-a Luigi.\n", tmp_path, env)
    derived = show(server, "by-model")
    assert derived["system"] == "It's-a Luigi." and derived["template"] == TEMPLATE  # the rest is mario's
    assert derived["parameters"] == show(server, "mario")["parameters"]
    (tmp_path / "missing.Modelfile").write_text("FROM sha256:" + "0" * 64 + "\n")
    done = pebbling("create", "nothing", "-f", str(tmp_path / "missing.Modelfile"), cwd=tmp_path, env=env)
    assert done.returncode == 1 and "the server has no such blob" in done.stderr
    (tmp_path / "unknown.Modelfile").write_text("FROM no-such-model\n")
    done = pebbling("create", "nothing", "-f", str(tmp_path / "unknown.Modelfile"), cwd=tmp_path, env=env)
    assert done.returncode == 1 and "'no-such-model' not found" in done.stderr
    assert "nothing:latest" not in names(server)


@pytest.mark.parametrize("text, says", [
    ("FROM ./weights/base.gguf\nADAPTER ./lora.gguf\n", "line 2: ADAPTER (a LoRA adapter) is not supported"),
    ("FROM ./weights/base.gguf\nQUANTIZE q4_0\n", "line 2: 'QUANTIZE' is not an instruction"),
    ("FROM ./weights/base.gguf\nPARAMETER top_k many\n", "line 2: PARAMETER top_k 'many': accepted: an integer"),
    ("FROM ./weights/base.gguf\nPARAMETER flash 1\n", "PARAMETER 'flash' is not a parameter pebbling knows"),
    ("FROM ./weights/base.gguf\nMESSAGE robot beep\n", "MESSAGE role 'robot'"),
    ('FROM ./weights/base.gguf\nSYSTEM """never closed\n', "never closed"),
    ("SYSTEM hi\n", "needs one FROM line"),
    ("FROM ./weights/none.gguf\n", "FROM ./weights/none.gguf: no such file"),
])
def test_a_modelfile_pebbling_cannot_take_is_one_line_naming_what(text, says, server, base, env):
    (base.parent.parent / "bad.Modelfile").write_text(text)
    done = pebbling("create", "bad", "-f", str(base.parent.parent / "bad.Modelfile"), cwd=base.parent, env=env)
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "bad:latest" not in names(server)


def test_cp_then_rm(server, base, env, tmp_path):
    created("mario", EVERY_INSTRUCTION, base.parent.parent, env)
    done = pebbling("cp", "mario", "team/mario:v2", cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout == "copied 'mario' to 'team/mario:v2'\n", done.stderr
    assert show(server, "team/mario:v2")["system"] == show(server, "mario")["system"]
    pebbling("cp", "mario", "mario-b", cwd=tmp_path, env=env)
    # a loaded model is unloaded before it is deleted, as ollama rm does: it leaves /api/ps. (mario-b is mario's
    # file: ps names it as whichever name loaded it first, mario where another test did.)
    loaded = requests.post(f"{server}/api/generate", json={"model": "mario-b", "prompt": "hi", "stream": False,
                                                           "options": {"num_predict": 1}}, timeout=120)
    assert loaded.status_code == 200, loaded.text

    def running() -> set[str]:
        return {m["name"] for m in requests.get(f"{server}/api/ps", timeout=30).json()["models"]}

    assert running() & {"mario-b:latest", "mario:latest"}
    done = pebbling("rm", "team/mario:v2", "mario-b", cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout == "deleted 'team/mario:v2'\ndeleted 'mario-b'\n", done.stderr
    assert not {"team/mario:v2", "mario-b:latest"} & names(server) and "mario:latest" in names(server)
    assert not running() & {"mario-b:latest", "mario:latest"}
    done = pebbling("rm", "mario-b", cwd=tmp_path, env=env)
    assert done.returncode == 1 and "'mario-b' not found" in done.stderr
    done = pebbling("cp", "no-such", "other", cwd=tmp_path, env=env)
    assert done.returncode == 1 and "'no-such' not found" in done.stderr


def test_push_says_plainly_it_is_not_supported(env, tmp_path):
    done = pebbling("push", "mario", cwd=tmp_path, env=env)
    assert done.returncode == 1 and "push is not supported" in done.stderr and "ollama push mario" in done.stderr


def test_without_a_server_the_commands_say_where_they_looked(user_env, tmp_path):
    (tmp_path / "Modelfile").write_text("FROM tiny\n")
    for command in (["create", "x"], ["cp", "a", "b"], ["rm", "a"]):
        done = pebbling(*command, cwd=tmp_path, env=user_env)
        assert done.returncode == 1 and "could not reach pebbling serve" in done.stderr, command


def test_the_command_table_lists_every_subcommand_and_no_other():
    """README's layout once listed a `chat` subcommand that did not exist; docs/cli.md's table is the list."""
    import re

    from pyplugin.cli import build_parser

    parser = build_parser()
    subcommands = {name for action in parser._subparsers._group_actions for name in action.choices}
    table = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text().split("\n\n")
    rows = next(block for block in table if block.startswith("| command |")).splitlines()[2:]
    listed = {m.group(1) for row in rows for m in re.finditer(r"`([a-z][a-z-]*)[^`]*`", row.split("|")[1])}
    assert listed == subcommands


# ---------------------------------------------------------------------------------------------------
# the Modelfile's text


def test_every_option_pebbling_takes_is_a_parameter_a_modelfile_sets():
    from pyplugin.runtime import options
    from pyplugin.serving.modelfile_text import PARAMETERS

    assert set(options._CHECKS) | options.PLACEMENT | set(options.NEUTRAL) | options.PEBBLING == PARAMETERS


@pytest.mark.parametrize("text", ["plain", 'say "hi"', "\n", "two\nlines", "  spaced  ", '"quoted"', 'ends in "',
                                  '"""', "", "a line\nending in \"\nand more", "tab\tinside"])
def test_a_value_written_reads_back_as_it_was(text):
    from pyplugin.serving.modelfile_text import parse, quoted

    for prefer in ('"""', '"'):
        value = quoted(text, prefer)
        assert value is not None
        read = parse(f"FROM x\nSYSTEM {value}\nMESSAGE user {value}\nPARAMETER stop {value}\nLICENSE {value}\n")
        assert read.system == text and read.messages == [{"role": "user", "content": text}]
        assert read.parameters == {"stop": [text]} and read.licenses == [text]
