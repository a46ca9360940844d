"""The command line: `pebbling run`, `estimate` and `verify` through pyplugin.cli.main, on a tiny
16-layer model and on the demo (written into a temporary models directory)."""

from __future__ import annotations

import io
import json

import pytest

from helpers import free_port, tiny_path
from pyplugin.cli import main
from pyplugin.commands import verify as verify_command
from pyplugin.runtime import pebbled as pebbled_module
from pyplugin.runtime import Generation

ESTIMATE_STRATEGIES = ("none", "sqrt", "adaptive", "minimal", "every:2", "every:4")
VERIFY_STRATEGIES = ("none", "sqrt", "adaptive", "minimal", "every:2")
SMALL = ["--num-ctx", "64"]


@pytest.fixture(autouse=True)
def no_server_and_no_stdin(monkeypatch):
    """`run` loads in-process here (no server answers on $PEBBLING_HOST) and reads an empty stdin."""
    monkeypatch.setenv("PEBBLING_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_path("llama", n_layer=16))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def demo(demo_dir, monkeypatch) -> str:
    monkeypatch.setenv("PEBBLING_MODELS", str(demo_dir))
    return "pebbling-demo"


def cli(*args: str) -> int:
    """main's exit code, argparse's own exits (bad usage: 2) included."""
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code


def rows(out: str, names) -> dict[str, str]:
    """The table row of each strategy, by name."""
    found = {}
    for line in out.splitlines():
        first = line.split(" ", 1)[0]
        if first in names:
            found[first] = line
    assert set(found) == set(names), out
    return found


# ---------------------------------------------------------------------------------------------------
# run


def test_run_strategy_flags_do_not_change_the_text(model, capsys):
    base = ["run", model, "hello", "--temperature", "0", "--num-predict", "6", *SMALL]
    assert cli(*base) == 0
    plain = capsys.readouterr().out
    for flags in (["--pebbling-strategy", "minimal"], ["--pebbling-strategy", "every:3"],
                  ["--pebbling-strategy", "adaptive", "--pebbling-memory-limit", "1GiB"]):
        assert cli(*base, *flags) == 0
        assert capsys.readouterr().out == plain, flags


def test_run_verbose_prints_timings_and_the_report_to_stderr(model, capsys):
    assert cli("run", model, "hello", "--temperature", "0", "--num-predict", "4", *SMALL,
               "--pebbling-strategy", "sqrt", "--verbose") == 0
    out, err = capsys.readouterr()
    assert "eval rate" not in out
    fields = dict(line.split(":", 1) for line in err.splitlines() if ":" in line)
    fields = {name: value.strip() for name, value in fields.items()}
    for name in ("total duration", "load duration", "prompt eval count", "prompt eval duration",
                 "prompt eval rate", "eval duration", "eval rate", "backend", "bytes restored", "restores"):
        assert fields.get(name), name
    assert fields["eval count"] == "4 token(s)"
    assert fields["pebbling strategy"] == "sqrt" and fields["resident layers"] == "4/16"
    assert fields["budget"] == "no limit"
    assert fields["estimated peak"].endswith("(estimate)")
    assert fields["measured peak"].split("(", 1)[1].startswith(("byte-accounted", "measured"))
    assert fields["bytes restored/token"].endswith("B")
    if "process memory" in fields:  # where /proc gives VmRSS: measured, beside the accounted peak
        assert fields["process memory"].endswith("peak (measured)") and "resident" in fields["process memory"]


def test_run_on_the_demo_says_its_weights_are_random(demo, capsys):
    assert cli("run", demo, "hi", "--num-predict", "2", *SMALL) == 0
    assert "(random weights)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# estimate


def test_estimate_lists_every_strategy_with_labelled_figures(model, capsys):
    assert cli("estimate", model, *SMALL) == 0
    out = capsys.readouterr().out
    table = rows(out, ESTIMATE_STRATEGIES)
    assert all(row.endswith("no limit") for name, row in table.items() if name != "adaptive")
    assert table["adaptive"].endswith(("no limit", "yes"))  # yes: the free GPU memory is its budget
    header = out.splitlines()[out.splitlines().index(table["none"]) - 1]
    assert "peak (estimate)" in header and "slowdown (predicted)" in header
    assert "restore bandwidth" in out and "measured in this run" in out
    assert "context position 32" in out  # num_ctx / 2, stated


def test_estimate_json_orders_minimal_below_sqrt_below_none(model, capsys):
    assert cli("estimate", model, *SMALL, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    s = result["strategies"]
    assert list(s) == list(ESTIMATE_STRATEGIES)
    peaks = {name: s[name]["estimated_peak_bytes"] for name in s}
    assert peaks["minimal"] < peaks["sqrt"] < peaks["none"]
    streamed = {name: s[name]["streamed_bytes_per_token_estimate"] for name in s}
    assert streamed["none"] == 0 < streamed["sqrt"] < streamed["minimal"]
    restored = {name: s[name]["restored_bytes_per_token_estimate"] for name in s}
    if result["restores"]:  # a GPU: the streamed bytes are copied into slots
        assert restored == streamed
        assert s["none"]["predicted_slowdown"] == 1.0 < s["minimal"]["predicted_slowdown"]
    else:  # host memory: computed in place, nothing restored, no transfer to predict (as run reports)
        assert set(restored.values()) == {0} and all(s[n]["store_calls_per_token"] == 0 for n in s)
    assert result["measured"]["restore_bytes_per_s"] > 0 and result["measured"]["layer_decode_seconds"] > 0


def test_estimate_for_a_batch_holds_its_kv_caches_and_shares_the_weights(model, capsys):
    cli("estimate", model, *SMALL, "--json")
    alone = json.loads(capsys.readouterr().out)["strategies"]["minimal"]
    assert cli("estimate", model, *SMALL, "--json", "--parallel", "4") == 0
    result = json.loads(capsys.readouterr().out)
    batch = result["strategies"]["minimal"]
    assert result["parallel"] == 4 and batch["predicted_slowdown"] is None  # not measured for a batch
    assert batch["estimated_peak_bytes"] > alone["estimated_peak_bytes"]
    assert batch["streamed_bytes_per_token_estimate"] < alone["streamed_bytes_per_token_estimate"] / 2
    assert cli("estimate", model, *SMALL, "--parallel", "0") == 1
    assert "--parallel 0" in capsys.readouterr().err


def test_estimate_marks_the_strategies_over_the_limit(model, capsys):
    cli("estimate", model, *SMALL, "--json")
    s = json.loads(capsys.readouterr().out)["strategies"]
    limit = (s["minimal"]["estimated_peak_bytes"] + s["sqrt"]["estimated_peak_bytes"]) // 2
    assert cli("estimate", model, *SMALL, "--memory-limit", str(limit)) == 0
    table = rows(capsys.readouterr().out, ESTIMATE_STRATEGIES)
    assert table["minimal"].endswith("yes") and table["adaptive"].endswith("yes")
    for name in ("none", "sqrt", "every:2"):
        assert "does not fit: needs" in table[name], table[name]


def test_estimate_limit_below_the_smallest_footprint_exits_1_naming_it(model, capsys):
    cli("estimate", model, *SMALL, "--json")
    floor = json.loads(capsys.readouterr().out)["smallest_footprint_bytes"]
    assert cli("estimate", model, *SMALL, "--memory-limit", str(floor - 1)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("pebbling: error: ") and f"{floor} bytes" in err


# ---------------------------------------------------------------------------------------------------
# verify


def test_verify_the_demo_passes_and_explains_itself(demo, capsys):
    assert cli("verify", demo, "--num-predict", "4", *SMALL) == 0
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in out and out.rstrip().splitlines()[-1].startswith("OK:")
    table = rows(out, VERIFY_STRATEGIES)
    assert table["none"].endswith("yes (reference)")
    assert all(row.endswith("yes") for name, row in table.items() if name != "none")


def test_verify_json_parses_and_streaming_lowers_the_peak(model, capsys):
    assert cli("verify", model, "--num-predict", "4", *SMALL, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    s = result["strategies"]
    assert list(s) == list(VERIFY_STRATEGIES) and result["all_tokens_equal"]
    assert all(row["tokens_equal"] and row["tokens"] == s["none"]["tokens"] for row in s.values())
    assert len(s["none"]["tokens"]) == 4
    for peak in ("estimated_peak_bytes", "measured_peak_bytes"):
        if peak == "measured_peak_bytes" and result["backend"] == "cuda":
            continue  # NVML counts whole MiB pages, too coarse for this tiny model's layers
        assert s["minimal"][peak] < s["sqrt"][peak] < s["none"][peak], peak
    assert 0 < s["adaptive"]["resident_layers"] < 16  # its default budget makes it choose
    assert s["minimal"]["decode_tokens_per_s"] > 0


def test_verify_exits_1_when_a_strategy_changes_the_tokens(model, capsys, monkeypatch):
    class Broken(Generation):
        def tokens(self, prompt):
            for token in super().tokens(prompt):
                yield token + (self.layers.plan.strategy.name == "minimal")

    monkeypatch.setattr(pebbled_module, "Generation", Broken)  # what PebbledModel.generation makes
    assert cli("verify", model, "--num-predict", "3", *SMALL) == 1
    out = capsys.readouterr().out
    assert rows(out, VERIFY_STRATEGIES)["minimal"].endswith("NO")
    assert "FAILED: minimal" in out


@pytest.fixture(scope="module")
def q8_model() -> str:
    return str(tiny_path("llama", n_layer=4, weight_type="Q8_0"))


@pytest.mark.parametrize("first", ["quantized", "f16"])
def test_verify_compare_weights_checks_the_other_form_too(q8_model, capsys, first):
    assert cli("verify", q8_model, "--num-predict", "4", *SMALL, "--pebbling-weights", first, "--compare-weights",
               "--json") == 0
    result = json.loads(capsys.readouterr().out)
    other = result["other_weights"]
    assert result["weights"] == first and other["weights"] != first
    assert other["tokens_equal"] and other["tokens"] == result["strategies"]["none"]["tokens"]
    quantized, f16 = ((result["layer_weight_bytes"], other["layer_weight_bytes"]) if first == "quantized"
                      else (other["layer_weight_bytes"], result["layer_weight_bytes"]))
    assert quantized < f16  # the test model's Q8_0 layers against their float32 expansion


def test_verify_compare_weights_fails_when_the_forms_disagree(q8_model, capsys, monkeypatch):
    real = verify_command.other_form

    def disagreeing(*args):
        row = real(*args)
        return {**row, "tokens": row["tokens"][:-1] + [row["tokens"][-1] + 1], "tokens_equal": False}

    monkeypatch.setattr(verify_command, "other_form", disagreeing)
    assert cli("verify", q8_model, "--num-predict", "3", *SMALL, "--compare-weights") == 1
    out = capsys.readouterr().out
    assert "tokens equal weights quantized: NO" in out and "FAILED: none with weights f16" in out


def test_verify_plot_writes_a_png(model, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the 'plot' extra)")
    path = tmp_path / "verify.png"
    assert cli("verify", model, "--num-predict", "2", *SMALL, "--plot", str(path)) == 0
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 1000


# ---------------------------------------------------------------------------------------------------
# bad flags: one clear line, exit 1 (pebbling's own checks) or 2 (argparse's), no traceback


@pytest.mark.parametrize("args,code,message", [
    (["run", "{model}", "hi", "--pebbling-strategy", "fastest"], 1, "unknown strategy 'fastest'; valid:"),
    (["run", "{model}", "hi", "--pebbling-strategy", "every:0"], 1, "N >= 1"),
    (["run", "{model}", "hi", "--pebbling-memory-limit", "lots"], 1, "--pebbling-memory-limit must be"),
    (["estimate", "{model}", "--memory-limit", "5 parsecs"], 1, "unknown unit"),
    (["estimate", "{model}", "--context-pos", "5000"], 1, "--context-pos 5000"),
    (["verify", "{model}", "--memory-limit=-1GiB"], 1, "must not be negative"),
    (["verify", "{model}", "--backend", "gpu"], 2, "invalid choice: 'gpu'"),
    (["estimate", "{model}", "--num-ctx", "many"], 2, "invalid int value"),
])
def test_bad_flags_give_one_clear_error(model, capsys, args, code, message):
    assert cli(*(a.format(model=model) for a in args)) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.rstrip().splitlines()[-1]
    assert "error:" in last and message in last, err
    if code == 1:
        assert err.count("\n") == 1


def test_info_says_which_backend_and_which_decode_step(capsys, monkeypatch):
    monkeypatch.setenv("PEBBLING_BACKEND", "host")
    assert cli("info") == 0
    out = capsys.readouterr().out
    assert out.startswith("backend: host") and "decode step: one native call per token, every layer" in out
    assert "weights: quantized" in out
    monkeypatch.setenv("PEBBLING_BACKEND", "stub")
    assert cli("info") == 0
    assert "decode step: the Python forward pass (the stub backend)" in capsys.readouterr().out
