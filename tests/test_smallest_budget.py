"""One answer to "the smallest budget that works": `estimate`, `run` and the server each plan from the
memory model of the request they are asked about, and give the same floor for the same request; an
`estimate` for any prompt says which prompts its limit holds, and `run` agrees; and `estimate` predicts
no restores where the backend makes none (host memory: streamed layers are computed in place)."""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
import requests

from helpers import free_port, tiny_path
from pyplugin.cli import main
from pyplugin.commands.common import chat_tokens, load_pebbled
from server_patch import create_app
from server_patch.local import serving

PROMPT = "Why is the sky blue?"
FLAGS = ["--num-ctx", "256", "--num-batch", "64"]
FLOOR = re.compile(r"smallest footprint for (.*?): [0-9.]+ [KMG]?i?B \((\d+) bytes, strategy minimal\)")


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_path("llama", n_layer=8))


@pytest.fixture(scope="module")
def prompt_tokens(model) -> int:
    loaded = load_pebbled(model)
    try:
        return len(chat_tokens(loaded.model, PROMPT))
    finally:
        loaded.pebbled.close()


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("PEBBLING_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code


def floor_in(text: str) -> tuple[str, int]:
    found = FLOOR.search(text)
    assert found, text
    return found.group(1), int(found.group(2))


def test_estimate_run_and_the_server_name_one_floor_for_one_request(model, prompt_tokens, tmp_path, capsys):
    assert cli("run", model, PROMPT, *FLAGS, "--num-predict", "4", "--pebbling-memory-limit", "1") == 1
    run_for, run_floor = floor_in(capsys.readouterr().err)
    assert run_for == f"a prompt of {prompt_tokens} tokens, generating up to 4 at num_ctx 256"

    assert cli("estimate", model, *FLAGS, "--prompt-tokens", str(prompt_tokens), "--num-predict", "4",
               "--memory-limit", "1") == 1
    assert floor_in(capsys.readouterr().err) == (run_for, run_floor)

    shutil.copy(model, tmp_path / "tiny.gguf")
    with serving(create_app(models_dir=tmp_path)) as url:
        r = requests.post(f"{url}/api/chat", timeout=120, json={
            "model": "tiny", "stream": False, "messages": [{"role": "user", "content": PROMPT}],
            "options": {"num_ctx": 256, "num_batch": 64, "num_predict": 4, "pebbling_memory_limit": 1}})
    assert r.status_code == 400
    assert floor_in(r.json()["error"]) == (run_for, run_floor)

    # And a budget of exactly that floor is one that works.
    assert cli("run", model, PROMPT, *FLAGS, "--num-predict", "4", "--pebbling-memory-limit", str(run_floor),
               "--temperature", "0") == 0


def test_estimate_for_any_prompt_says_which_prompts_its_limit_holds(model, prompt_tokens, capsys):
    cli("estimate", model, *FLAGS, "--json")
    any_prompt = json.loads(capsys.readouterr().out)
    assert any_prompt["smallest_footprint_for"].startswith("any prompt (prefill chunks of num_batch 64")
    cli("estimate", model, *FLAGS, "--json", "--prompt-tokens", str(prompt_tokens))
    short = json.loads(capsys.readouterr().out)["smallest_footprint_bytes"]
    assert short < any_prompt["smallest_footprint_bytes"]

    limit = (short + any_prompt["smallest_footprint_bytes"]) // 2  # holds this prompt, not every prompt
    assert cli("estimate", model, *FLAGS, "--memory-limit", str(limit)) == 1
    err = capsys.readouterr().err
    longest = int(re.search(r"prompt is at most (\d+) tokens", err).group(1))
    assert longest >= prompt_tokens and f"--prompt-tokens {longest}" in err
    # run agrees: a request with that prompt length fits the limit, one token longer does not.
    assert cli("estimate", model, *FLAGS, "--prompt-tokens", str(longest), "--memory-limit", str(limit),
               "--json") == 0
    capsys.readouterr()
    assert cli("estimate", model, *FLAGS, "--prompt-tokens", str(longest + 1), "--memory-limit", str(limit)) == 1
    capsys.readouterr()
    assert cli("run", model, PROMPT, *FLAGS, "--pebbling-memory-limit", str(limit), "--temperature", "0",
               "--num-predict", "2") == 0


def test_estimate_predicts_the_restores_run_reports(model, capsys):
    cli("estimate", model, *FLAGS, "--json", "--prompt-tokens", "8", "--context-pos", "16")
    estimated = json.loads(capsys.readouterr().out)
    minimal = estimated["strategies"]["minimal"]
    assert cli("run", model, PROMPT, *FLAGS, "--pebbling-strategy", "minimal", "--num-predict", "4",
               "--temperature", "0", "--verbose") == 0
    report = dict(line.split(":", 1) for line in capsys.readouterr().err.splitlines() if ":" in line)
    restored = report["bytes restored"].strip()
    if estimated["restores"]:
        assert minimal["restored_bytes_per_token_estimate"] > 0 and restored != "0 B (0 bytes)"
    else:  # host memory: nothing restored, by the estimate and by the run
        assert minimal["restored_bytes_per_token_estimate"] == 0 and minimal["store_calls_per_token"] == 0
        assert minimal["streamed_bytes_per_token_estimate"] > 0
        assert minimal["predicted_slowdown"] == 1.0
        assert restored == "0 B (0 bytes)"
