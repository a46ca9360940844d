"""`benchmarks/speed.py matvec` at a tiny size on the host library: every Llama-3-8B matrix is timed at each
vector count, in a process per library with --libs (its GPU figures come from a GPU run; here the logic)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pyplugin.store import probe
from pyplugin.store.native import load_library

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib import speed_matvec as bench  # noqa: E402

pytestmark = pytest.mark.skipif(not probe("host").usable, reason="the host library is not built here (make host)")
TINY = ["--backend", "host", "--scale", "0.002", "--repeats", "1", "--vectors", "1,2"]


def test_each_matrix_at_each_vector_count(tmp_path, capsys):
    assert bench.main(TINY + ["--json", str(tmp_path / "m.json")]) == 0
    (result,) = json.loads((tmp_path / "m.json").read_text())
    assert [(r["type"], r["cols"], r["vectors"]) for r in result["rows"]] == [
        (t, cols, nv) for t, _, cols, _ in bench.SHAPES for nv in (1, 2)]
    assert all(r["us"] > 0 and r["GBps"] > 0 for r in result["rows"]) and result["copy_GBps"] > 0
    assert all(r["kernel_us"] is None and r["kernel_how"].startswith("no GPU") for r in result["rows"])
    assert "token_kernel_ms" not in result
    out = capsys.readouterr().out
    assert "Q6_K" in out and "kernels alone: no GPU" in out


def test_libs_run_each_library_in_its_own_process_and_a_bad_one_is_reported(tmp_path, capsys):
    _, path = load_library("host")
    assert bench.main(TINY + ["--libs", f"{path},{tmp_path / 'absent.so'}", "--json", str(tmp_path / "m.json")]) == 0
    results = json.loads((tmp_path / "m.json").read_text())
    assert [r["library"] for r in results] == [str(Path(path).resolve())]
    assert "absent.so: exit" in capsys.readouterr().err


def test_best_is_the_first_library_unless_another_is_clearly_faster():
    def result(name: str, us: float) -> dict:
        rows = [{"tensor": t, "vectors": nv, "us": us * (8 if nv == 8 else 1)} for _, _, _, t in bench.SHAPES
                for nv in (1, 8)]
        return {"library": name, "rows": rows}

    first, close, faster = result("a", 10.0), result("b", 9.8), result("c", 9.0)
    assert bench.token_seconds(first, 1) == pytest.approx(sum(bench.PER_TOKEN.values()) * 10e-6)
    assert bench.best([first, close])["library"] == "a"      # 2% is within the noise
    assert bench.best([first, close, faster])["library"] == "c"
    assert bench.best([faster, first])["library"] == "c"
    # where every item's kernels were timed alone (a CUDA graph), those decide, not the calls from Python
    for r, kernel_us in ((first, 5.0), (close, 2.0), (faster, 9.0)):
        for row in r["rows"]:
            row["kernel_us"] = kernel_us * (8 if row["vectors"] == 8 else 1)
        r["token_kernel_ms"] = {}
    assert bench.best([first, close, faster])["library"] == "b"
    del close["token_kernel_ms"]  # one item without them: the calls decide for all
    assert bench.best([first, close, faster])["library"] == "c"


class _FakeCupy:
    """Just what graph_seconds asks of CuPy: a stream that captures, events a fixed time apart."""

    def __init__(self, refuse: bool = False):
        self.log, self.refuse = [], refuse
        fake = self

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self):
                if fake.refuse:
                    raise RuntimeError("operation not permitted when stream is capturing")
                fake.log.append("begin")

            def end_capture(self):
                fake.log.append("end")
                return Graph()

        class Graph:
            def launch(self, stream=None):
                fake.log.append("launch")

        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        self.cuda = type("cuda", (), {"Stream": Stream, "Event": Event,
                                      "get_elapsed_time": staticmethod(lambda start, end: 2.0)})


def test_a_call_s_kernels_are_timed_alone_by_replaying_a_captured_round():
    cp = _FakeCupy()
    backend = type("B", (), {"arrays_on_device": True, "xp": cp})()
    rounds = []
    seconds, how = bench.graph_seconds(backend, lambda: rounds.append(list(cp.log)), calls=4, repeats=3)
    assert seconds == pytest.approx(2.0e-3 / 4) and "CUDA graph" in how
    assert rounds == [[], ["begin"]]  # once to set up, outside the capture; once captured
    assert cp.log == ["begin", "end"] + ["launch"] * 4  # replayed: one warm, then `repeats` timed
    refused = _FakeCupy(refuse=True)
    backend.xp = refused
    seconds, how = bench.graph_seconds(backend, lambda: None, calls=4, repeats=3)
    assert seconds is None and how.startswith("not captured (RuntimeError")


def test_an_item_is_a_library_or_settings_of_the_default_librarys_switches():
    lib = bench.item_env("build/variants/libpebble_cuda_x.so")
    assert Path(lib["PEBBLING_LIB"]).is_absolute() and lib["BENCH_MATVEC_ITEM"] == "build/variants/libpebble_cuda_x.so"
    settings = bench.item_env("PEBBLING_CUDA_PERSIST=0+PEBBLING_CUDA_STACK=0")
    assert settings == {"PEBBLING_CUDA_PERSIST": "0", "PEBBLING_CUDA_STACK": "0",
                        "BENCH_MATVEC_ITEM": "PEBBLING_CUDA_PERSIST=0+PEBBLING_CUDA_STACK=0"}
    both = bench.item_env("build/variants/few.so+PEBBLING_CUDA_PERSIST=0")
    assert Path(both["PEBBLING_LIB"]).name == "few.so" and both["PEBBLING_CUDA_PERSIST"] == "0"


def test_an_item_whose_products_differ_or_leave_outputs_unwritten_is_named():
    def item(name, digest, unwritten=0):
        return {"library": name, "rows": [{"type": "Q4_K", "rows": 8, "cols": 256, "vectors": 1, "outputs": digest,
                                           "unwritten": unwritten}]}
    same = [item("a.so", "0123"), item("PEBBLING_CUDA_PERSIST=0", "0123")]
    assert bench.output_differences(same) == [] and "bit for bit" in bench.outputs_text(same)
    found = bench.output_differences([item("a.so", "0123"), item("b.so", "4567"), item("c.so", "0123", unwritten=3)])
    assert found == ["#2 Q4_K 8x256 at 1 vector(s): products differ from #1's",
                     "#3 Q4_K 8x256 at 1 vector(s): 3 outputs unwritten"]
