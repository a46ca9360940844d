"""Loading GGUF files: dequantized tensors, config, sizes, and one clear ModelError per bad file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from helpers import ARCHS, TYPES, rewrite_gguf, tiny_model, tiny_path, tiny_spec
from pyplugin.cli import main as cli_main
from pyplugin.errors import ModelError
from pyplugin.model import load_model
from pyplugin.model.synth import quantize, write_gguf


def _ours(model, name):
    """Our array for a GGUF tensor name, re-fusing what the loader split."""
    if not name.startswith("blk."):
        field = {"token_embd.weight": "token_embd", "output.weight": "output",
                 "output_norm.weight": "output_norm"}[name]
        return getattr(model.outer, field)
    _, i, tensor = name.split(".", 2)
    lw = model.layers[int(i)]
    fused = {"attn_qkv.weight": (lw.wq, lw.wk, lw.wv),
             "ffn_up.weight": (lw.w_gate, lw.w_up) if model.config.arch == "phi3" else (lw.w_up,)}
    if tensor in fused:
        return np.concatenate(fused[tensor])
    field = {"attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
             "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
             "ffn_gate.weight": "w_gate", "ffn_down.weight": "w_down", "attn_q.bias": "bq",
             "attn_k.bias": "bk", "attn_v.bias": "bv"}[tensor]
    return getattr(lw, field)


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_dequantized_tensors_equal_gguf_dequantize(arch, wtype):
    """Every type in every architecture's layout (phi3's fused matrices split, qwen2's biases): each case
    is a tiny file loaded once, 0.1 to 0.6 s on the stub, so all of them are kept rather than a subset."""
    path = tiny_path(arch, weight_type=wtype)
    model = tiny_model(arch, weight_type=wtype)
    reader = GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {wtype}
    for t in reader.tensors:
        ours = _ours(model, t.name)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, dequantize(t.data, t.tensor_type), err_msg=t.name)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_synth_k_quantizers_write_blocks_gguf_reads_back(qtype):
    x = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    back = dequantize(quantize(x, GGMLQuantizationType[qtype]), GGMLQuantizationType[qtype])
    assert np.corrcoef(x.ravel(), back.ravel())[0, 1] > 0.99


def test_config_comes_from_the_metadata():
    cfg = tiny_model("llama", rope_theta=500000.0, rope_linear_factor=8.0).config
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == \
        ("llama", 2, 64, 4, 2, 16)
    assert (cfg.n_ff, cfg.n_ctx_train, cfg.rope_mode, cfg.rope_dims) == (128, 256, "normal", 16)
    assert cfg.rope_theta == 500000.0 and cfg.rope_freq_scale == pytest.approx(1 / 8)
    assert tiny_model("qwen2").config.rope_mode == tiny_model("phi3").config.rope_mode == "neox"


def test_phi3_fused_tensors_are_split_into_views():
    lw = tiny_model("phi3").layers[0]
    assert lw.wq.base is not None and lw.wq.base is lw.wk.base is lw.wv.base
    assert lw.w_gate.base is lw.w_up.base
    assert lw.wq.flags.c_contiguous and lw.w_up.flags.c_contiguous


def test_host_bytes_are_the_weights_as_loaded():
    expanded = tiny_model("llama", weight_type="Q8_0")                       # float32 on the host
    quantized = tiny_model("llama", weights="quantized", weight_type="Q8_0")  # the file's bytes
    file_tensors = sum(int(t.n_bytes) for t in GGUFReader(tiny_path("llama", weight_type="Q8_0")).tensors)
    outer = expanded.outer
    assert expanded.host_bytes == (sum(lw.nbytes for lw in expanded.layers) + outer.token_embd.nbytes
                                   + outer.output_norm.nbytes + outer.output.nbytes)
    assert quantized.host_bytes == file_tensors                               # norms are F32 in the file too
    assert quantized.host_bytes < expanded.host_bytes / 3                     # Q8_0 is ~1/4 of float32
    assert expanded.config.kv_bytes_per_token(4) == 2 * 2 * 16 * 4            # K+V, 2 KV heads of 16, f32


def test_tied_output_reuses_the_embedding():
    model = tiny_model("llama", tied_output=True)
    assert model.outer.output is model.outer.token_embd


def test_metadata_labels_random_weights():
    model = tiny_model("llama")
    assert model.random_weights and "random weights" in model.name
    assert "tokenizer.ggml.tokens" not in model.metadata  # big arrays are not kept twice


# ---------------------------------------------------------------------------------------------------
# bad files: one ModelError naming the file


def _raises_naming(path, match):
    with pytest.raises(ModelError, match=match) as info:
        load_model(path)
    assert str(path) in str(info.value)
    return info.value


def test_missing_file(tmp_path):
    _raises_naming(tmp_path / "absent.gguf", "no such file")


def test_directory(tmp_path):
    _raises_naming(tmp_path, "directory")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text")
    _raises_naming(path, "not a GGUF file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _raises_naming(path, "empty")


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_file(tmp_path, keep):
    data = tiny_path("llama").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    _raises_naming(path, "truncated")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises_naming(path, "architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, phi3, gemma2, gemma3")


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ1_S", "TQ1_0", "TQ2_0"])
def test_a_tensor_of_a_type_without_kernels_is_refused_at_load_naming_it_and_what_is_computed(qtype):
    """One matrix of a type pebbling does not compute (the IQ2/IQ1 grids, the ternary types; synth writes
    the IQs as random bytes, having no quantizer for them) among Q8_0 ones: the file is refused up front,
    the message naming that tensor, its type and every type pebbling computes, the new ones included."""
    path = tiny_path("llama", weight_type="Q8_0", tensor_types={"blk.1.ffn_down": qtype}, n_embd=256, n_ff=256)
    assert {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}["blk.1.ffn_down.weight"] == qtype
    err = _raises_naming(path, rf"tensor blk\.1\.ffn_down\.weight has type {qtype}, which is not supported; "
                               r"supported types: ")
    listed = str(err).rpartition("supported types: ")[2].split(", ")
    assert sorted(listed) == sorted(TYPES) and {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"} <= set(listed)


def test_unsupported_rope_scaling(tmp_path):
    path = rewrite_gguf(tiny_path("llama"), tmp_path / "longrope.gguf", strings={"llama.rope.scaling.type": "longrope"})
    _raises_naming(path, "rope scaling 'longrope' is not supported; supported: none, linear, yarn")


def test_missing_metadata_key(tmp_path):
    path = rewrite_gguf(tiny_path("llama"), tmp_path / "nokey.gguf", drop={"llama.block_count"})
    _raises_naming(path, "missing metadata key 'llama.block_count'")


def test_missing_tensor(tmp_path):
    path = rewrite_gguf(tiny_path("qwen2"), tmp_path / "notensor.gguf", drop={"blk.1.ffn_down.weight"})
    _raises_naming(path, "missing tensor 'blk.1.ffn_down.weight'")


def test_cli_reports_a_bad_file_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert cli_main(["run", str(path), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pebbling: error: ") and str(path) in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# host memory while loading

# VmHWM, the peak resident set of this process's memory map (ru_maxrss would carry the parent's
# peak over fork and exec).
_MEASURE = """
import json, sys
from pyplugin.model import load_model

def peak():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

before = peak()
model = load_model(sys.argv[1], weights=sys.argv[2], progress=False)
print(json.dumps({"peak_growth": peak() - before, "weights": model.host_bytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("wtype", ["F32", "F16", "Q4_K"])
@pytest.mark.parametrize("form", ["f16", "quantized"])
def test_loading_peak_memory_stays_under_1_3x_the_loaded_weights(wtype, form):
    # ~60 MB of float32 weights; a fresh process so VmHWM sees only this load.
    path = tiny_path("llama", weight_type=wtype, n_layer=4, n_embd=512, n_ff=1536, n_head=8,
                     n_head_kv=8)
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), form], capture_output=True,
                         text=True, check=True)
    figures = json.loads(out.stdout)
    figures["file_tensors"] = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    if form == "f16":
        assert figures["weights"] > 50e6  # float32
        assert figures["peak_growth"] < 1.3 * figures["weights"], figures
    else:  # the file's bytes: the matrices as stored, vectors (float32 in the file too) as they are
        assert figures["weights"] == figures["file_tensors"]
        # Q4_K's 8 MB are near what the tokenizer and Python's objects cost whatever the weights: those
        # get a fixed 8 MiB here; a dequantizing load of the same file would add some 50 MB.
        assert figures["peak_growth"] < 1.3 * figures["weights"] + 8 * 2**20, figures


@pytest.mark.parametrize("arch, overrides", [("llama", dict(weight_type="Q4_K", n_embd=256)),
                                             ("qwen2", dict(weight_type="Q8_0", vocab="chatml")),
                                             ("phi3", dict(vocab="spm", weight_type="F16"))])
def test_our_header_parser_reads_what_gguf_reads(arch, overrides):
    """GGUFFile parses the header itself (gguf's reader takes seconds on a large vocabulary): every
    metadata value, and every tensor's type, shape, offset and size, as gguf's GGUFReader gives them."""
    from pyplugin.model import GGUFFile

    path = tiny_path(arch, **overrides)
    reader = GGUFReader(path)
    with GGUFFile(path) as f:
        want = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        assert f.metadata == want
        assert len(f.tensors) == len(reader.tensors)
        for t in reader.tensors:
            got = f.tensors[t.name]
            assert (got.qtype, got.shape, got.offset, got.nbytes) == (
                t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))


def test_quantized_matrices_are_views_of_the_file_and_their_pages_can_be_given_back():
    """Loading `quantized` copies no matrix: each is a view of the file's memory map; once the store
    holds a copy, drop_file_pages gives its pages back and the bytes read the same from the file."""
    from pyplugin.model import QuantWeight
    from pyplugin.model.gguf_file import drop_file_pages

    path = tiny_path("llama", weight_type="Q8_0")
    model = load_model(path, weights="quantized", progress=False)
    w = model.layers[0].wq
    assert isinstance(w, QuantWeight) and not w.data.flags.owndata and not w.data.flags.writeable
    before = w.data.copy()
    reader = GGUFReader(path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    np.testing.assert_array_equal(before.reshape(-1), np.asarray(raw.data).reshape(-1).view(np.uint8))
    drop_file_pages(w.data)
    np.testing.assert_array_equal(w.data, before)
    drop_file_pages(before)  # not a view of a file: left alone


def test_a_file_of_holes_has_the_layout_of_the_written_one_on_almost_no_disk(tmp_path):
    """synth's `holes`: a real model's size and layout with its data left as holes of a sparse file (zeros), so
    that `benchmarks/memory.py estimate` can read a shape larger than the machine (gpt-oss-120b, 65 GB)."""
    spec = dict(n_layer=2, weight_type="Q8_0", tensor_types={"ffn_down": "MXFP4"}, random_blocks=True)
    written = write_gguf(tmp_path / "written.gguf", tiny_spec("qwen2", **spec))
    holes = write_gguf(tmp_path / "holes.gguf", tiny_spec("qwen2", holes=True, **spec))
    assert written.stat().st_size == holes.stat().st_size
    a, b = GGUFReader(written), GGUFReader(holes)
    assert [(t.name, t.data_offset, t.n_bytes) for t in a.tensors] == [(t.name, t.data_offset, t.n_bytes) for t in b.tensors]
    assert all(not np.asarray(t.data).any() for t in b.tensors) and any(np.asarray(t.data).any() for t in a.tensors)
    assert holes.stat().st_blocks * 512 < written.stat().st_size // 4  # (a file system without holes stores zeros)
    model = load_model(holes, progress=False)
    assert model.config.n_layer == 2 and model.layers[1].w_down.qtype == GGMLQuantizationType.MXFP4
