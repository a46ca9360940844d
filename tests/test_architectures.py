"""qwen3, gemma2, gemma3 and the llama variants (Mistral-Nemo's head size, a sliding window, Granite's
scales) against a float64 forward pass written here from the GGUF's tensors; KV-cache decode equal to
recomputing (across the sliding window's edge, in prefill chunks smaller and larger than the window);
every strategy's tokens equal to `none` on every backend; the window's KV saving in the estimate and in
the store's accounted peak; files asking for what pebbling does not compute refused by name.
"""

from __future__ import annotations


import numpy as np
import pytest

from helpers import store_backend_params, tiny_path
from reference import reference_logits
from pyplugin.errors import ModelError
from pyplugin.model import load_model
from pyplugin.runtime import Generation, PebbledModel
from pyplugin.store.abi import aligned
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions

SHAPE = dict(n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_ctx=128, n_merges=150)
CASES = {
    "qwen3": dict(arch="qwen3", vocab="qwen3", n_layer=2, key_length=32),
    "gemma3": dict(arch="gemma3", vocab="gemma", n_layer=4, key_length=32, sliding_window=5, swa_pattern=3,
                   rope_theta=1e6, rope_linear_factor=2.0),
    "gemma2": dict(arch="gemma2", vocab="gemma", n_layer=2, key_length=16, sliding_window=6, attn_softcap=2.0,
                   final_softcap=3.0),
    "mistral-nemo": dict(arch="llama", vocab="llama3", n_layer=2, key_length=32, n_head=4, sliding_window=6),
    "granite-scales": dict(arch="llama", vocab="llama3", n_layer=2, tied_output=True, rope_freqs=True,
                           metadata={"llama.embedding_scale": 2.0, "llama.residual_scale": 0.5,
                                     "llama.logit_scale": 4.0, "llama.attention.scale": 0.2}),
}
PROMPT_LEN, DECODED = 13, 6


def path_of(case: str, **extra):
    spec = {**SHAPE, **CASES[case], **extra}
    return tiny_path(spec.pop("arch"), **spec)


def prompt(n: int = PROMPT_LEN) -> list[int]:
    return [(7 * i + 3) % 250 + 1 for i in range(n)]


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------------
# the forward pass


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_batch", [4, 16])  # prefill chunks shorter and longer than the windows
def test_prefill_and_decode_match_the_float64_reference(case, num_batch):
    path = path_of(case)
    model = load_model(path, weights="f16", progress=False)
    tokens = prompt(PROMPT_LEN + DECODED)
    ref = reference_logits(path, tokens)
    # float32 caches to the reference's float32 rounding; f16 caches (the default) within fp16's rounding
    # of K and V (2^-11 relative each), 1e-3 of the logits' norm
    for kv_type, tolerance in (("f32", 1e-4), ("f16", 1e-3)):
        gen = Generation(model, Options(temperature=0, num_ctx=64, num_batch=num_batch, kv_type=kv_type))
        logits = gen.prefill(tokens[:PROMPT_LEN])
        assert rel(logits, ref[PROMPT_LEN - 1]) < tolerance
        for n, token in enumerate(tokens[PROMPT_LEN:]):  # the KV cache, across the window's edge
            assert rel(gen.decode_one(token), ref[PROMPT_LEN + n]) < tolerance, (case, kv_type, n)


def test_the_window_matters():
    """The reference is not blind to the window: without it the logits past the window differ."""
    tokens = prompt(PROMPT_LEN)
    windowed = reference_logits(path_of("gemma3"), tokens)
    full = reference_logits(path_of("gemma3", sliding_window=1024), tokens)
    assert rel(windowed[:5], full[:5]) < 1e-12
    assert rel(windowed[-1], full[-1]) > 1e-3


def test_configs_read_as_llama_cpp_reads_them():
    g3 = load_model(path_of("gemma3"), progress=False).config
    assert g3.swa_layers == (0, 1, 3) and g3.sliding_window == 5      # pattern 3: every third layer global
    assert g3.for_layer(0).rope_theta == 10000.0 and g3.for_layer(0).rope_freq_scale == 1.0
    assert g3.for_layer(2).rope_theta == 1e6 and g3.for_layer(2).rope_freq_scale == 0.5
    assert g3.head_dim == 32 and g3.attn_scale == pytest.approx(32 ** -0.5)
    assert g3.embd_scale == pytest.approx(8.0) and g3.activation == "gelu"
    g2 = load_model(path_of("gemma2"), progress=False).config
    assert g2.swa_layers == (0,) and (g2.attn_softcap, g2.final_softcap) == (2.0, 3.0)
    q3 = load_model(path_of("qwen3"), progress=False)
    assert q3.config.head_dim == 32 and q3.layers[0].q_norm.shape == (32,) and q3.layers[0].bq is None
    nemo = load_model(path_of("mistral-nemo"), progress=False).config
    assert nemo.head_dim == 32 != nemo.n_embd // nemo.n_head and nemo.swa_layers == (0, 1)


# ---------------------------------------------------------------------------------------------------
# strategies, backends, weight forms, the decode step


@pytest.mark.parametrize("backend", store_backend_params())
@pytest.mark.parametrize("case", ["qwen3", "gemma3", "gemma2", "mistral-nemo"])
def test_every_strategy_gives_the_tokens_of_none(backend, case):
    options = Options(temperature=0, num_predict=8, num_ctx=48, num_batch=4)
    tokens = prompt(9)
    for weights in ("quantized", "f16"):
        model = load_model(path_of(case, weight_type="Q8_0"), weights=weights, progress=False)
        expected = list(Generation(model, options).tokens(tokens))
        assert len(expected) == 8
        pebbled = PebbledModel(model, backend=backend)
        try:
            for strategy in ("none", "sqrt", "minimal", "every:2", "adaptive"):
                pebbling = PebblingOptions.from_options({"pebbling_strategy": strategy})
                got = list(pebbled.generation(options, pebbling, len(tokens)).tokens(tokens))
                assert got == expected, (case, weights, strategy)
        finally:
            pebbled.close()


def test_the_decoder_refuses_qk_norms_with_biases_by_name():
    """No architecture has both, and their order would be a guess: the decoder refuses such a layer."""
    from dataclasses import replace

    from pyplugin.errors import InvalidArgumentError
    from pyplugin.model import KVCache
    from pyplugin.store import backend_named
    qwen3 = load_model(path_of("qwen3"), progress=False)
    for name in ("host", "stub"):
        kernels = backend_named(name).kernels
        layers = qwen3.resident_layers(kernels)
        layers[0] = replace(layers[0], bq=np.zeros(qwen3.config.n_head * qwen3.config.head_dim, np.float32))
        kv = KVCache.allocate(qwen3.config, 16)
        with pytest.raises(InvalidArgumentError, match="layer 0: Q/K norms together with Q/K biases"):
            kernels.decoder(qwen3.config, layers, [[pair] for pair in zip(kv.k, kv.v)], qwen3.outer_weights(kernels), 16)


# ---------------------------------------------------------------------------------------------------
# the sliding window's KV saving


def test_sliding_layers_keep_only_their_window():
    options = Options(temperature=0, num_predict=4, num_ctx=96, num_batch=8)
    windowed = load_model(path_of("gemma3"), progress=False)
    full = load_model(path_of("gemma3", sliding_window=0), progress=False)
    cfg = windowed.config
    kv_token = cfg.kv_bytes_per_token(2)  # f16 caches, the default
    saved = len(cfg.swa_layers) * 2 * (aligned(options.num_ctx * kv_token // 2) - aligned(cfg.sliding_window * kv_token // 2))
    plans, peaks = {}, {}
    for name, model in (("windowed", windowed), ("full", full)):
        pebbled = PebbledModel(model, backend="stub")
        try:
            pebbling = PebblingOptions.from_options({"pebbling_strategy": "none"})
            plans[name] = pebbled.plan(options, pebbling)
            gen = pebbled.generation(options, pebbling, 9)
            list(gen.tokens(prompt(9)))
            peaks[name] = gen.report()["measured_peak_bytes"]
        finally:
            pebbled.close()
    m = plans["windowed"].memory
    assert [m.kv_bytes(i) for i in range(cfg.n_layer)] == [  # each cache placed at a multiple of 256 bytes
        2 * aligned((cfg.sliding_window if i in cfg.swa_layers else options.num_ctx) * kv_token // 2)
        for i in range(cfg.n_layer)]
    estimate_saving = plans["full"].estimated_peak_bytes - plans["windowed"].estimated_peak_bytes
    assert estimate_saving == saved
    # the store accounts each entry's own bytes, unpadded
    assert peaks["full"] - peaks["windowed"] == len(cfg.swa_layers) * (options.num_ctx - cfg.sliding_window) * kv_token


def test_a_32k_context_keeps_512_positions_on_five_layers_of_six():
    path = path_of("gemma3", n_layer=6, sliding_window=512, swa_pattern=None, n_ctx=32768)
    cfg = load_model(path, progress=False).config
    assert [cfg.kv_rows(i, 32768) for i in range(6)] == [512] * 5 + [32768]


# ---------------------------------------------------------------------------------------------------
# what is refused


@pytest.mark.parametrize("key, value", [("llama.attention.clamp_kqv", 8.0), ("qwen3.expert_count", 8),
                                        ("llama.final_logit_softcapping", 30.0), ("qwen3.embedding_scale", 2.0)])
def test_a_key_that_changes_the_math_is_refused_by_name(key, value):
    arch = key.split(".")[0]
    case = "qwen3" if arch == "qwen3" else "mistral-nemo"
    with pytest.raises(ModelError, match=key.replace(".", r"\.")):
        load_model(path_of(case, metadata={key: value}), progress=False)


def test_a_harmless_key_is_accepted():
    load_model(path_of("gemma3", metadata={"gemma3.mm.tokens_per_image": 256}), progress=False)


# ---------------------------------------------------------------------------------------------------
# a 262144-token vocabulary, and the header reader that makes it cheap


def test_a_262k_sentencepiece_vocabulary_loads_fast_and_lean(tmp_path):
    import time
    import tracemalloc

    from pyplugin.model.synth import write_gguf
    path = write_gguf(tmp_path / "gemma262k.gguf", arch="gemma3", vocab="gemma", vocab_size=262144, n_layer=1,
                      n_embd=64, n_head=2, n_head_kv=1, n_ff=64, sliding_window=16,
                      tensor_types={"token_embd": "Q8_0"})
    start = time.perf_counter()
    model = load_model(path, progress=False)
    seconds = time.perf_counter() - start
    tracemalloc.start()  # a second load, traced (tracing slows it several times)
    try:
        load_model(path, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.tokenizer.n_vocab == 262144
    # gguf-py's reader took 12 s and ~600 MB of resident memory here; the header reader and the
    # tokenizer take ~1.3 s and ~66 MB at their peak, most of it the token strings themselves.
    assert seconds < 6 and peak < 150 * 2**20, (seconds, peak)
    tok = model.tokenizer
    ids = tok.encode("<start_of_turn>user\nZebra ∑<end_of_turn>", add_bos=False)
    assert ids[0] == 5 and ids[-1] == 6  # <start_of_turn>, <end_of_turn>: whole tokens, as specials
    assert tok.decode(ids, special=True) == "<start_of_turn>user\nZebra ∑<end_of_turn>"
    assert 6 in tok.eog_ids  # <end_of_turn> ends generation


def test_the_header_reader_reads_what_gguf_py_reads():
    from gguf import GGUFReader

    from pyplugin.model.gguf_file import GGUFFile
    path = path_of("gemma3", weight_type="Q8_0", metadata={"gemma3.mm.tokens_per_image": 256})
    reader = GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    with GGUFFile(path) as f:
        assert f.metadata == expected
        assert {n: (t.qtype, t.shape, t.offset, t.nbytes) for n, t in f.tensors.items()} == {
            t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset),
                     int(t.n_bytes)) for t in reader.tensors}


# ---------------------------------------------------------------------------------------------------
# through the server, from an Ollama-layout store, with each model's own template


def test_models_in_an_ollama_store_chat_through_the_server(tmp_path, monkeypatch):
    import hashlib
    import json

    import requests

    from pyplugin.model.synth import write_gguf
    from server_patch import create_app
    from server_patch.local import serving

    names = {"qwen3:tiny": ("qwen3", "qwen3"), "gemma3:tiny": ("gemma3", "gemma"), "gemma2:tiny": ("gemma2", "gemma")}
    (tmp_path / "blobs").mkdir()
    for name, (arch, vocab) in names.items():
        spec = {**SHAPE, **{k: v for k, v in CASES[arch].items() if k not in ("arch", "vocab")}}
        data = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, vocab=vocab, **spec).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (tmp_path / "blobs" / f"sha256-{digest}").write_bytes(data)
        model, tag = name.split(":")
        manifest = tmp_path / "manifests" / "registry.ollama.ai" / "library" / model / tag
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                    "digest": f"sha256:{digest}", "size": len(data)}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    with serving(create_app(models_dir=tmp_path / "none")) as url:
        listed = {m["name"] for m in requests.get(f"{url}/api/tags", timeout=30).json()["models"]}
        assert set(names) <= listed
        for name, (arch, _) in names.items():
            model = load_model(tmp_path / f"{arch}.gguf", progress=False)
            expected = model.tokenizer.encode(model.chat_prompt(messages))
            body = {"model": name, "messages": messages, "stream": False,
                    "options": {"temperature": 0, "num_predict": 5, "num_ctx": 96}}
            r = requests.post(f"{url}/api/chat", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["prompt_eval_count"] == len(expected)   # the GGUF's own template, rendered
            assert answer["message"]["role"] == "assistant" and answer["eval_count"] >= 1
            if arch.startswith("gemma"):
                assert "<start_of_turn>model\n" in model.chat_prompt(messages)
                [end] = model.tokenizer.encode("<end_of_turn>", add_bos=False)
                assert end in model.tokenizer.eog_ids   # a turn's end stops generation
            if arch == "qwen3":  # think: false writes Qwen 3's empty thinking block
                off = requests.post(f"{url}/api/chat", json={**body, "think": False}, timeout=120).json()
                block = model.tokenizer.encode("<think>\n\n</think>\n\n", add_bos=False)
                whole = off["prompt_eval_count"] + off["pebbling"]["cached_tokens"]  # the prompt cache held some
                assert whole == len(expected) + len(block)
                on = requests.post(f"{url}/api/chat", json={**body, "think": True}, timeout=120)
                assert on.status_code == 200, on.text  # on: a <think> part comes apart (test_thinking.py)


def test_estimate_and_verify_on_a_sliding_window_model(capsys):
    import json

    from pyplugin.cli import main
    path = str(path_of("gemma3"))
    assert main(["estimate", path, "--num-ctx", "64", "--num-batch", "8", "--backend", "stub", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    cfg = load_model(path, progress=False).config
    kv_token = cfg.kv_bytes_per_token(2)  # f16 caches, the default
    assert r["sliding_layers"] == 3 and r["sliding_window"] == 5
    assert r["kv_cache_bytes_without_windows"] - r["kv_cache_bytes"] == 3 * (64 - 5) * kv_token
    assert main(["estimate", path, "--num-ctx", "64", "--num-batch", "8", "--backend", "stub"]) == 0
    assert "3 of 4 layers attend over a window of 5 positions" in capsys.readouterr().out
    assert main(["verify", path, "--num-predict", "8", "--num-ctx", "64", "--backend", "stub"]) == 0
    assert "OK: all" in capsys.readouterr().out


def test_the_27b_gemmas_scale_queries_by_n_embd_over_n_head():
    """llama.cpp (after gemma_pytorch): the 27B models' query_pre_attn_scalar is n_embd / n_head, which
    differs from their head size; their layer counts (46 for gemma2, 62 for gemma3) say which they are."""
    cfg = load_model(path_of("gemma2", n_layer=46, n_head=2, n_head_kv=1, n_ff=32), progress=False).config
    assert cfg.head_dim == 16 and cfg.attn_scale == pytest.approx((64 / 2) ** -0.5)


def test_llama3_rope_scaling_needs_its_factors():
    ok = path_of("granite-scales", metadata={"llama.rope.scaling.type": "llama3"})
    assert load_model(ok, progress=False).config.rope_freq_factors is not None
    with pytest.raises(ModelError, match="rope scaling 'llama3'.*rope_freqs"):
        load_model(path_of("mistral-nemo", metadata={"llama.rope.scaling.type": "llama3"}), progress=False)
    # YaRN is computed (tests/test_rope_yarn.py); one of its constants other than llama.cpp's is refused by name
    with pytest.raises(ModelError, match="'qwen3.rope.scaling.yarn_beta_fast' is 16.0; pebbling computes YaRN with"):
        load_model(path_of("qwen3", metadata={"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
                                              "qwen3.rope.scaling.yarn_beta_fast": 16.0}), progress=False)


def test_qwen3s_own_template_drops_old_thinking_and_switches_it_off():
    model = load_model(path_of("qwen3"), progress=False)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
                {"role": "user", "content": "Again"}]
    prompt = model.chat_prompt(messages)
    assert "hmm" not in prompt and "<|im_start|>assistant\nHello!<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert model.chat_prompt(messages, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
