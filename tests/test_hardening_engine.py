"""The engine's side of the third hardening round (issue 44): two cached chats prefilled together in one
pass answer as each does alone (a pass of one row per sequence is never read as one sequence's chunk)."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import requests

from helpers import store_backend_params, tiny_model, tiny_path
from pyplugin.runtime import PebbledModel
from pyplugin.runtime.batch import prefill_batch, prefills_together
from pyplugin.runtime.generation import Generation
from pyplugin.runtime.options import Options
from pyplugin.runtime.plan import PebblingOptions
from pyplugin.runtime.store_layers import StoreLayers
from pyplugin.serving import Engine, batching
from server_patch import create_app
from server_patch.local import serving

GREEDY = {"temperature": 0, "num_predict": 4}


def chat(url, model, content, **body):
    messages = [{"role": "user", "content": content}] if content is not None else []
    return requests.post(f"{url}/api/chat", json={"model": model, "stream": False, "options": GREEDY,
                                                  "messages": messages, **body}, timeout=60)


@pytest.fixture
def slow_tokens(monkeypatch):
    """Every token takes 10 ms to sample and none ends the generation, so that requests overlap for sure."""
    real = Generation.sample

    def sample(self, logits, history):
        time.sleep(0.01)
        logits = np.array(logits, dtype=np.float32)
        logits[list(self.model.tokenizer.eog_ids)] = -np.inf
        return real(self, logits, history)

    monkeypatch.setattr(Generation, "sample", sample)


# ---------------------------------------------------------------------------------------------------
# two cached prompts prefilled together: B sequences of one row each, not one sequence's chunk of B rows


@pytest.mark.parametrize("backend", store_backend_params(("host", "stub")))
def test_two_sequences_of_one_new_row_each_prefill_together_as_each_alone(backend):
    """Each prompt but its last token is in its sequence's cache (a conversation going on), so the pass
    holds one row of each: the attention is the one call for a token each, never a prompt chunk's."""
    model = tiny_model("qwen2", weights="quantized", n_layer=3, weight_type="Q8_0")
    options = Options(temperature=0, num_predict=4, num_ctx=64)
    pebbling = PebblingOptions.from_options({"pebbling_strategy": "minimal"})
    prompts = [[5, 17, 42, 8], [61, 7, 250, 12, 33]]
    pebbled = PebbledModel(model, backend=backend)
    source = StoreLayers(pebbled, pebbled.plan(options, pebbling, n_seqs=2), options, pebbling)
    gens = [Generation(model, options, layers=source.sequence(s)) for s in range(2)]
    for g, p in zip(gens, prompts):
        g.start(p[:-1])
    chunks = [g.begin(p, len(p) - 1) for g, p in zip(gens, prompts)]
    assert [len(c) for c in chunks] == [1, 1]
    assert prefills_together(source, gens) == (backend == "host")  # the engine takes this pass on the host
    got = prefill_batch(source, gens, chunks)
    for g, p, row in zip(gens, prompts, got):
        solo = PebbledModel(model, backend=backend).generation(options, pebbling, len(p))
        solo.start(p[:-1])
        np.testing.assert_array_equal(row, solo.prefill(p[-1:]))
        assert g.pos == len(p)


def queued(engine, n: int) -> None:
    """Waits until the one loaded model has n requests queued or running."""
    deadline = time.monotonic() + 10
    while engine.running()[0].active < n and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("backend", store_backend_params(("host",)))
def test_two_cached_chats_at_once_both_answer(tmp_path, backend, slow_tokens, monkeypatch):
    """Two chats whose prompts are cached, queued together behind a request of another plan, start in one
    prefill pass of a row each and answer what each answered alone (a 500 'too many values to unpack' once)."""
    shutil.copy(tiny_path("qwen2", n_layer=3, weight_type="Q8_0"), tmp_path / "tiny.gguf")
    passes = []
    real = batching.prefill_batch

    def counted(source, generations, chunks):
        passes.append([len(c) for c in chunks])
        return real(source, generations, chunks)

    monkeypatch.setattr(batching, "prefill_batch", counted)
    engine = Engine(tmp_path, backend=backend, num_parallel=4)
    try:
        with serving(create_app(engine)) as url:
            for _ in range(2):  # the second round runs from each conversation's cache, alone
                alone = {text: chat(url, "tiny", text).json() for text in ("Alpha one", "Beta two")}
            assert all(r["pebbling"]["cached_tokens"] > 0 for r in alone.values())
            blocker = threading.Thread(target=requests.post, args=(f"{url}/api/generate",), kwargs={"json": {
                "model": "tiny", "prompt": "wait", "raw": True, "stream": False,
                "options": {**GREEDY, "num_predict": 60, "pebbling_strategy": "none"}}, "timeout": 60})
            blocker.start()
            queued(engine, 1)  # first in the model's queue, so its plan runs first
            pair, replies = [], {}
            for text in alone:
                pair.append(threading.Thread(target=lambda t=text: replies.setdefault(t, chat(url, "tiny", t))))
                pair[-1].start()
            queued(engine, 3)
            assert blocker.is_alive(), "the pair was not queued while the other plan's request ran"
            for thread in [blocker, *pair]:
                thread.join(60)
    finally:
        engine.close()
    assert passes == [[1, 1]] and len(replies) == 2  # the two started together, a row each
    for text, reply in replies.items():
        assert reply.status_code == 200, reply.text[:300]
        assert reply.json()["message"]["content"] == alone[text]["message"]["content"]
