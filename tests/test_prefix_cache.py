"""A conversation keeps its cache: a request whose prompt starts with the tokens the last request left in
the model's KV entries prefills only the rest, and produces what a full prefill produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyplugin.model.synth import write_gguf
from pyplugin.serving import Engine, GenerationRequest

TINY = dict(arch="qwen2", n_layer=3, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ctx=1024)
GREEDY = {"temperature": 0, "num_predict": 6, "num_ctx": 512}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    return root


def chat(engine, messages, keep_alive=None, **options):
    job = engine.submit(GenerationRequest("tiny", messages=messages, options={**GREEDY, **options},
                                          keep_alive=keep_alive))
    text, final = job.result()
    return job, text, final


@pytest.mark.parametrize("strategy", ["none", "minimal", "every:2"])
def test_a_five_turn_chat_prefills_only_each_turns_new_tokens(models_dir, strategy):
    cached, fresh = Engine(models_dir), Engine(models_dir)
    try:
        messages = [{"role": "system", "content": "You are terse."}]
        for turn in range(5):
            messages.append({"role": "user", "content": f"turn {turn}: tell me about number {turn * 7}"})
            job, text, final = chat(cached, messages, pebbling_strategy=strategy)
            # The same turn on an engine that has seen nothing before: the whole prompt prefilled.
            fresh_job, fresh_text, fresh_final = chat(fresh, messages, keep_alive=0, pebbling_strategy=strategy)
            assert fresh_final.report["cached_tokens"] == 0 and fresh_final.prompt_eval_count == len(job.tokens)
            assert (text, final.context) == (fresh_text, fresh_final.context)
            reused = final.report["cached_tokens"]
            assert final.prompt_eval_count == len(job.tokens) - reused
            if turn:
                # The history up to the last answer is in the cache (the answer's re-rendering may end
                # differently from the tokens sampled, at worst from the end-of-turn marker on).
                assert reused >= previous_prompt
            previous_prompt = len(job.tokens)
            messages.append({"role": "assistant", "content": text})
    finally:
        cached.close()
        fresh.close()


def test_generate_with_context_continues_without_a_second_bos(models_dir):
    engine = Engine(models_dir)
    try:
        first = engine.submit(GenerationRequest("tiny", prompt="Once upon", raw=True, options=GREEDY))
        _, f1 = first.result()
        second = engine.submit(GenerationRequest("tiny", prompt=" a time", raw=True, context=f1.context,
                                                 options=GREEDY))
        _, f2 = second.result()
        tokenizer = next(iter(engine._loaded.values())).model.tokenizer
        assert second.tokens[:len(f1.context)] == f1.context
        assert tokenizer.bos_id is None or tokenizer.bos_id not in second.tokens[len(f1.context):]
        assert f2.report["cached_tokens"] == len(f1.context) - 1  # all but the last sampled token
        assert f2.prompt_eval_count == len(second.tokens) - f2.report["cached_tokens"]
    finally:
        engine.close()


def test_another_request_between_turns_costs_the_cache_not_the_answer(models_dir):
    engine, fresh = Engine(models_dir), Engine(models_dir)
    try:
        messages = [{"role": "user", "content": "first question"}]
        _, text, _ = chat(engine, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
        chat(engine, [{"role": "user", "content": "something else entirely"}])   # takes the cache
        engine.submit(GenerationRequest("tiny", embed=["an embedding"], options=GREEDY)).result()
        job, text2, final = chat(engine, messages)
        assert final.report["cached_tokens"] == 0 and final.prompt_eval_count == len(job.tokens)
        assert text2 == chat(fresh, messages)[1]
    finally:
        engine.close()
        fresh.close()


def test_a_different_num_ctx_starts_over(models_dir):
    engine = Engine(models_dir)
    try:
        messages = [{"role": "user", "content": "hello"}]
        _, text, _ = chat(engine, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        _, _, final = chat(engine, messages, num_ctx=256)
        assert final.report["cached_tokens"] == 0
    finally:
        engine.close()


def test_a_conversation_parked_under_another_kv_type_starts_over(models_dir):
    """KV entries are of one type: a request of another type makes them again (the conversation they held
    is parked), and that conversation's next turn, back in its own type, is prefilled afresh rather than
    written into entries of the other type; its answer is a fresh engine's."""
    engine, fresh = Engine(models_dir, num_parallel=1), Engine(models_dir, num_parallel=1)
    try:
        first = [{"role": "user", "content": "first conversation, first question"}]
        _, answer, _ = chat(engine, first)
        _, _, other = chat(engine, [{"role": "user", "content": "another one"}], pebbling_kv_type="f32")
        assert other.report["kv_type"] == "f32"
        first += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        job, text, final = chat(engine, first)
        assert final.report["kv_type"] == "f16" and final.report["cached_tokens"] == 0
        assert final.prompt_eval_count == len(job.tokens)
        assert text == chat(fresh, first)[1]
    finally:
        engine.close()
        fresh.close()


def test_openai_usage_counts_the_whole_prompt_and_says_what_was_cached(models_dir):
    from server_patch import create_app
    from server_patch.local import serving
    import requests

    body = {"model": "tiny", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": "count the whole prompt"}]}
    with serving(create_app(models_dir=models_dir)) as url:
        first = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        body["messages"] += [first["choices"][0]["message"], {"role": "user", "content": "again"}]
        second = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    with serving(create_app(models_dir=models_dir)) as url:
        alone = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"] == alone["choices"][0]["message"]


@pytest.mark.parametrize("strategy", ["none", "minimal"])
@pytest.mark.parametrize("weights", ["quantized", "f16"])
def test_the_cached_prefix_gives_the_logits_of_a_full_prefill(strategy, weights):
    """What reuse promises: the first logits of a turn equal a full prefill's up to the rounding of a
    prompt split differently into chunks (as the chunked-prefill test allows)."""
    import numpy as np
    from helpers import tiny_model
    from pyplugin.runtime import PebbledModel
    from pyplugin.runtime.options import Options
    from pyplugin.runtime.plan import PebblingOptions

    options, pebbling = Options(temperature=0, num_predict=5, num_ctx=96), PebblingOptions.from_options(
        {"pebbling_strategy": strategy})
    first = [5, 17, 42, 8, 99, 3, 61, 7, 250, 12, 33, 71, 4, 150]
    pebbled = PebbledModel(tiny_model("qwen2", weights=weights), backend="host")
    gen = pebbled.generation(options, pebbling, len(first))
    answer = list(gen.tokens(first))
    pebbled.keep_cache(gen)
    second = first + answer + [9, 28, 77, 140, 6]
    cached = pebbled.cached_prefix(second, options.num_ctx)
    assert cached == len(first) + len(answer) - 1  # all but the last answer token ran through the layers
    resumed = pebbled.generation(options, pebbling, len(second))
    resumed.pos = cached
    logits = resumed.prefill(second[cached:])
    alone = PebbledModel(tiny_model("qwen2", weights=weights), backend="host")
    full = alone.generation(options, pebbling, len(second)).prefill(second)
    # The answer's cached K and V were written by decode steps (the fused matvec and the decode attention,
    # float32 sums in their own order); a full prefill computes them with the prompt kernels, in another
    # order. From quantized bytes the two also round the activations differently. Through the layers of
    # a random model the float32 difference grows to about 3e-5 of the largest logit with dense weights
    # (measured: 2.7e-5, with numpy's prompt attention and the library's alike) and 3e-4 quantized.
    rel = 1e-4 if weights == "f16" else 1e-3
    np.testing.assert_allclose(logits, full, rtol=rel, atol=rel * np.abs(full).max())


def test_a_displaced_conversation_is_parked_on_the_host_and_comes_back(models_dir):
    """One sequence: another conversation takes it, the first one's cache goes to the host tier, and its
    next turn brings it back instead of prefilling its history again."""
    parked, undisturbed = Engine(models_dir, num_parallel=1), Engine(models_dir, num_parallel=1)
    try:
        first = [{"role": "user", "content": "first conversation, first question"}]
        _, answer, _ = chat(parked, first)
        chat(parked, [{"role": "user", "content": "another conversation entirely"}])  # takes the sequence
        first += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        job, text, final = chat(parked, first)
        restored, cached = final.report["cache_restored_tokens"], final.report["cached_tokens"]
        assert restored == cached > 20 and final.prompt_eval_count == len(job.tokens) - cached
        assert len(parked.running()) == 1
        # The same turns with nothing between them (the cache never left): the same tokens, bit for bit.
        assert chat(undisturbed, first[:1])[1] == answer
        _, alone_text, alone = chat(undisturbed, first)
        assert (alone_text, alone.report["cached_tokens"], alone.report["cache_restored_tokens"]) == (text, cached, 0)
    finally:
        parked.close()
        undisturbed.close()


def test_without_room_on_the_host_a_displaced_conversation_starts_over(models_dir):
    engine = Engine(models_dir, num_parallel=1, parked_kv_bytes=1)
    try:
        first = [{"role": "user", "content": "first conversation, first question"}]
        job1, answer, _ = chat(engine, first)
        chat(engine, [{"role": "user", "content": "another conversation entirely"}])
        first += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        _, _, final = chat(engine, first)
        assert final.report["cache_restored_tokens"] == 0
        assert final.report["cached_tokens"] < len(job1.tokens) // 2  # at most the template's opening
    finally:
        engine.close()
