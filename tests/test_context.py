"""Context handling as Ollama's: a prompt that does not fit num_ctx is shortened from the front (a chat
loses its oldest messages, never its system prompt or newest message), a num_ctx past what the model
allows is lowered, num_predict -2 fills the context and -1 shifts it to go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyplugin.model.synth import write_gguf
from pyplugin.serving import Engine, GenerationRequest

TINY = dict(arch="llama", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=512)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    engine = Engine(root)
    yield engine
    engine.close()


def run(engine, **fields):
    request = GenerationRequest("tiny", **fields)
    job = engine.submit(request)
    return job, *job.result()


def prompt_text(engine, job) -> str:
    return next(iter(engine._loaded.values())).model.tokenizer.decode(job.tokens)


def test_a_chat_that_does_not_fit_loses_its_oldest_messages_first(engine):
    messages = [{"role": "system", "content": "SYSTEM-KEPT"}]
    for turn in range(12):
        messages += [{"role": "user", "content": f"question-{turn} " + "words " * 20},
                     {"role": "assistant", "content": f"answer-{turn} " + "more " * 20}]
    messages.append({"role": "user", "content": "NEWEST-KEPT"})
    job, text, final = run(engine, messages=messages, options={"temperature": 0, "num_predict": 16,
                                                               "num_ctx": 256})
    kept = prompt_text(engine, job)
    assert "SYSTEM-KEPT" in kept and "NEWEST-KEPT" in kept and "answer-11" in kept
    assert "question-0" not in kept
    # The prompt fits with room for num_predict, and no more messages went than had to.
    assert len(job.tokens) <= 256 - 16 and final.prompt_eval_count == len(job.tokens)
    dropped = int(final.report["prompt_truncated"].split()[3])
    one_more_kept = [messages[0]] + messages[1 + dropped - 1:]
    longer = engine.submit(GenerationRequest("tiny", messages=one_more_kept, options={
        "temperature": 0, "num_predict": 16, "num_ctx": 4096}))
    assert len(longer.tokens) > 256 - 16
    longer.cancel()
    list(longer)  # cancelled: it ends with nothing


def test_a_prompt_that_does_not_fit_keeps_its_start_and_its_end(engine):
    words = " ".join(f"w{i}" for i in range(400))
    job, text, final = run(engine, prompt=words, raw=True, options={"temperature": 0, "num_predict": 8,
                                                                     "num_ctx": 128})
    whole = next(iter(engine._loaded.values())).model.tokenizer.encode(words)
    assert job.tokens == whole[:4] + whole[-(120 - 4):]
    assert final.report["prompt_truncated"] == "kept the first 4 and the last 116 tokens"
    assert final.eval_count == 8


def test_num_keep_sets_how_much_of_the_start_is_kept(engine):
    words = " ".join(f"w{i}" for i in range(400))
    job, *_ = run(engine, prompt=words, raw=True, options={"temperature": 0, "num_predict": 8, "num_ctx": 128,
                                                            "num_keep": 0})
    whole = next(iter(engine._loaded.values())).model.tokenizer.encode(words)
    assert job.tokens == whole[-120:]


def test_a_prompt_that_fits_is_left_alone(engine):
    job, text, final = run(engine, prompt="hello there", options={"temperature": 0, "num_predict": 2})
    assert "prompt_truncated" not in final.report


def test_num_ctx_past_the_training_context_is_lowered(engine):
    job, text, final = run(engine, prompt="hello", options={"temperature": 0, "num_predict": 2,
                                                            "num_ctx": 100000})
    assert job.options.num_ctx == 512 and final.eval_count == 2


@pytest.mark.parametrize("fields", [{"options": {"num_predict": -2}},
                                    {"options": {"num_predict": -1}, "shift": False}])
def test_num_predict_minus_two_or_shift_false_run_until_the_context_is_full(engine, fields):
    # Greedy on this random model never reaches its end token within the context, so both fill it.
    fields["options"].update(temperature=0, num_ctx=40)
    job, text, final = run(engine, prompt="hello", **fields)
    assert final.done_reason == "length" and final.report["context_shifts"] == 0
    # Every one of the 40 positions is used; the last token is sampled from the 40th position's
    # logits and needs no position of its own.
    assert final.report["cached_tokens"] + final.prompt_eval_count + final.eval_count == 40 + 1


def test_num_predict_minus_one_shifts_the_context_and_goes_on_to_ollamas_bound(engine):
    """Ollama's default num_predict -1 generates past num_ctx, the context shifted as llama.cpp's server
    shifts it, and Ollama bounds it at 10 x num_ctx tokens (so that it cannot run forever)."""
    job, text, final = run(engine, prompt="hello", options={"temperature": 0, "num_predict": -1, "num_ctx": 40})
    assert final.done_reason == "length" and final.eval_count == 400
    assert final.report["context_shifts"] >= 400 // 20
