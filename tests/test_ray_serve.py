"""Replicas on Ray Serve (pyplugin/serving/ray_deploy.py): a local CPU cluster, two replicas of the demo
model (pebbling-demo, which each replica writes into a cache that starts empty), conversations through the
Ollama API. Each response names its replica (x-pebbling-replica) and
reports how many prompt tokens came from the cache (pebbling.cached_tokens), which is how the tests see
where a turn ran and that it found its conversation there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from helpers import free_port
from pyplugin.commands.serve import RAY_CANNOT_START
from pyplugin.serving import Engine, PebblingError
from pyplugin.serving.affinity import ConversationTable, conversation_keys
from pyplugin.serving.ray_config import RayConfig
from pyplugin.serving.registry import CACHE_ENV, DEMO_NAME
from server_patch import create_app

ray = pytest.importorskip("ray", reason="Ray is not installed here: pip install 'pebbling[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed here: pip install 'pebbling[ray]'")

MODEL = DEMO_NAME
# An answer long enough (about 7 s on one core) to be still streaming when its client leaves or its
# replica is killed.
LONG = {"temperature": 0, "num_predict": 3000, "num_ctx": 4096}
GREEDY = {"temperature": 0, "num_predict": 6, "num_ctx": 512}
CONVERSATIONS, TURNS = 16, 3
DEFAULTS = {"pebbling_strategy": "every:2"}  # the deployment's defaults for request options


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """The served models directory: empty, the demo model is pebbling's own."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """A pebbling cache without the demo model for this module's servers and clusters (which inherit it),
    so that replicas write it as their first requests arrive, concurrently."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def cluster(models_dir):
    """The application on a 2-CPU local cluster: its base URL. (A cluster takes seconds to start and its
    tests tens of seconds of both cores: they are marked `ci`, left to `make test-ci`.)"""
    from pyplugin.serving.ray_deploy import build_app

    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # no shared memory, no ports, a sandbox: say so rather than fail every test
        pytest.skip(f"a local Ray cluster cannot start here: {exc}")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"models": str(models_dir), "num_replicas": 2, "options": DEFAULTS}), name="pebbling",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def direct(models_dir):
    """One server without Ray, for the answers to compare with."""
    engine = Engine(models_dir)
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as client:
        yield client
    engine.close()


def chat(client, messages, **headers) -> tuple[str, dict, str | None]:
    r = client.post("/api/chat", json={"model": MODEL, "messages": messages, "stream": False, "options": GREEDY},
                    headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["message"]["content"], body, r.headers.get("x-pebbling-replica")


def converse(base: str, n: int) -> list[dict]:
    """A conversation of TURNS turns; what each turn sent and got."""
    turns, messages = [], [{"role": "system", "content": f"You are assistant number {n}."}]
    with httpx.Client(base_url=base, timeout=120) as client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"conversation {n}, turn {turn}: tell me about {n * 7 + turn}"})
            text, body, replica = chat(client, messages)
            assert body["pebbling"]["strategy"] == "every:2"  # the deployment's default
            turns.append({"messages": list(messages), "text": text, "replica": replica,
                          "cached": body["pebbling"]["cached_tokens"],
                          "prompt": body["pebbling"]["cached_tokens"] + body["prompt_eval_count"]})
            messages.append({"role": "assistant", "content": text})
    return turns


def replica_actor(replica: str):
    return ray.get_actor(f"SERVE_REPLICA::pebbling#pebbling#{replica}", namespace="serve")


# ---------------------------------------------------------------------------------------------------
# the keys, without a cluster


def test_a_later_turn_shares_the_earlier_turns_longest_key():
    first = [{"role": "user", "content": "hello"}]
    later = first + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
    k1 = conversation_keys("/api/chat", json.dumps({"model": "m", "messages": first}).encode())
    k2 = conversation_keys("/api/chat", json.dumps({"model": "m", "messages": later}).encode())
    other_model = conversation_keys("/api/chat", json.dumps({"model": "n", "messages": later}).encode())
    assert len(k1) == 1 and len(k2) == 3 and k2[0] == k1[0] and not set(other_model) & set(k2)
    table = ConversationTable()
    table.record(k1, "A")
    table.record(conversation_keys("/api/chat", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "something else"}]}).encode()), "B")
    assert table.owner(k2) == "A" and table.owner(other_model) is None
    table.forget("A")
    assert table.owner(k2) is None


def test_a_growing_prompt_and_a_session_header_are_followed():
    p1 = "Once upon a time, in a land far away, there lived a"
    keys1 = conversation_keys("/api/generate", json.dumps({"model": "m", "prompt": p1}).encode())
    keys2 = conversation_keys("/api/generate", json.dumps({"model": "m", "prompt": p1 + " king. And then"}).encode())
    assert keys1 and keys2[:len(keys1)] == keys1
    s1 = conversation_keys("/api/generate", json.dumps({"model": "m", "prompt": "a"}).encode(), "s1")
    assert s1 == conversation_keys("/api/chat", json.dumps({"model": "m", "messages": []}).encode(), "s1")
    assert conversation_keys("/api/tags", b"") == [] and conversation_keys("/api/chat", b"{not json") == []


def test_the_docs_config_file_is_one_serve_and_the_deployment_accept():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    readme = (Path(__file__).resolve().parent.parent / "docs" / "ray.md").read_text()
    text = readme.split("# pebbling-ray.yaml\n", 1)[1].split("```", 1)[0]
    config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    app = config.applications[0]
    options = RayConfig.from_args(app.args)
    assert app.import_path == "pyplugin.serving.ray_deploy:build_app" and options.num_replicas == 4
    assert options.replica()["threads"] == 4 and options.replica()["options"] == {"pebbling_strategy": "adaptive"}
    with pytest.raises(PebblingError, match="unknown pebbling Ray option.*replicas"):
        RayConfig.from_args({"replicas": 2})


def test_autoscaling_holds_replicas_to_the_requests_they_decode_together_under_the_queue_bound(monkeypatch):
    auto = {"min_replicas": 1, "max_replicas": 3}
    scaled = RayConfig.from_args({"num_parallel": 6, "autoscaling": auto}).scaling()
    assert scaled == {"max_ongoing_requests": 512, "autoscaling_config": {**auto, "target_ongoing_requests": 6}}
    monkeypatch.setenv("PEBBLING_NUM_PARALLEL", "3")  # what the replicas' engines would decode together
    assert RayConfig.from_args({"autoscaling": {}}).scaling()["autoscaling_config"] == {"target_ongoing_requests": 3}
    # The queue bound is the signal's ceiling: a replica is sent no more, and the target stays below it.
    assert RayConfig.from_args({"max_queue": 2, "autoscaling": {}}).scaling() == {
        "max_ongoing_requests": 2, "autoscaling_config": {"target_ongoing_requests": 2}}
    own = RayConfig.from_args({"autoscaling": {"target_ongoing_requests": 1.5}}).scaling()["autoscaling_config"]
    assert own == {"target_ongoing_requests": 1.5}
    for target in (513, 0, "4", True):
        with pytest.raises(PebblingError, match=r"target_ongoing_requests is .*at most max_queue \(512\)"):
            RayConfig.from_args({"autoscaling": {"target_ongoing_requests": target}})
    assert RayConfig.from_args({"num_replicas": 3, "max_queue": 16}).scaling() == {
        "max_ongoing_requests": 16, "num_replicas": 3}
    with pytest.raises(PebblingError, match="max_queue is 0; give a whole number of at least 1"):
        RayConfig.from_args({"max_queue": 0})


def test_the_application_takes_its_scaling_from_the_config():
    from pyplugin.serving.ray_deploy import build_app

    front = build_app({"max_queue": 8, "autoscaling": {"max_replicas": 3, "target_ongoing_requests": 2}})._bound_deployment
    replicas = front.init_args[0]._bound_deployment
    assert replicas.max_ongoing_requests == 8 and front.max_ongoing_requests == 8 * 3  # every replica full
    scaling = replicas._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 2)
    fixed = build_app({"num_replicas": 2, "max_queue": 8})._bound_deployment
    assert fixed.init_args[0]._bound_deployment.num_replicas == 2 and fixed.max_ongoing_requests == 16


# ---------------------------------------------------------------------------------------------------
# the command line (before the module's cluster starts: this one starts a cluster of its own)


@pytest.mark.ci
def test_pebbling_serve_ray_answers_through_its_replicas(models_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "pyplugin.cli", "serve", "--ray", "--replicas", "2",
                               "--port", str(port), "--models", str(models_dir)], stdout=log, stderr=log,
                              start_new_session=True)
    try:
        deadline, answer = time.monotonic() + 120, None
        # Until the application is deployed, Serve's proxy answers 404 itself (no replica header).
        while (answer is None or "x-pebbling-replica" not in answer.headers) and time.monotonic() < deadline \
                and server.poll() is None:
            try:
                answer = httpx.post(f"http://127.0.0.1:{port}/api/generate", timeout=30, json={
                    "model": MODEL, "prompt": "hello", "stream": False, "options": GREEDY})
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        said = (tmp_path / "serve.log").read_text()
        if answer is None and RAY_CANNOT_START in said:  # the command's own error (test below)
            pytest.skip(said[said.index(RAY_CANNOT_START):].splitlines()[0])
        assert answer is not None, said[-3000:]
        assert answer.status_code == 200 and answer.json()["done"] and answer.headers["x-pebbling-replica"]
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_replicas_without_ray_is_refused(capsys):
    from pyplugin.cli import main

    assert main(["serve", "--replicas", "2"]) == 1
    assert "--replicas and --gpus-per-replica go with --ray" in capsys.readouterr().err


@pytest.mark.parametrize("address", [None, "10.0.0.9:6379"])
def test_a_ray_that_cannot_start_is_said_to_be_so(address, monkeypatch, capsys):
    from pyplugin.cli import main

    def refuse(**_):
        raise ConnectionError("no shared memory")

    monkeypatch.setattr(ray, "init", refuse)
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["serve", "--ray"]) == 1
    said = capsys.readouterr().err
    where = f"join the Ray cluster at $RAY_ADDRESS ({address})" if address else "start a Ray cluster here"
    assert f"{RAY_CANNOT_START}: cannot {where}: ConnectionError: no shared memory; serve without --ray" in said
    assert "internal error" not in said


# ---------------------------------------------------------------------------------------------------
# the cluster


@pytest.mark.ci
def test_each_conversation_stays_on_one_replica_and_answers_as_one_server_does(cluster, direct):
    with ThreadPoolExecutor(8) as pool:
        conversations = list(pool.map(lambda n: converse(cluster, n), range(CONVERSATIONS)))
    used = set()
    for turns in conversations:
        replicas = {t["replica"] for t in turns}
        assert len(replicas) == 1 and None not in replicas, replicas
        used |= replicas
        for before, turn in zip(turns, turns[1:]):
            # The conversation so far came from the replica's cache (parked on its host tier or not).
            assert turn["cached"] >= before["prompt"], (before, turn)
        for turn in turns:  # the direct server runs every layer resident (its default strategy)
            assert chat(direct, turn["messages"])[0] == turn["text"]
    assert len(used) == 2, "both replicas served conversations"


@pytest.mark.ci
def test_a_generate_conversation_follows_its_context_to_its_replica(cluster):
    def generate_conversation(n: int) -> list[tuple[str, int, int]]:
        turns, context = [], None
        with httpx.Client(base_url=cluster, timeout=60) as client:
            for turn in range(TURNS):
                r = client.post("/api/generate", json={
                    "model": MODEL, "prompt": f"story {n}, part {turn}", "context": context,
                    "stream": turn % 2 == 1, "options": GREEDY})
                final = [json.loads(line) for line in r.text.splitlines() if line][-1]
                context = final["context"]
                turns.append((r.headers["x-pebbling-replica"], final["pebbling"]["cached_tokens"],
                              final["pebbling"]["cached_tokens"] + final["prompt_eval_count"]))
        return turns

    with ThreadPoolExecutor(8) as pool:
        conversations = list(pool.map(generate_conversation, range(8)))
    for turns in conversations:
        assert len({replica for replica, _, _ in turns}) == 1, turns
        for (_, _, prompt_before), (_, cached, _) in zip(turns, turns[1:]):
            assert cached >= prompt_before, turns  # the last turn's whole prompt, from this replica's cache


@pytest.mark.ci
def test_ps_and_metrics_answer_for_every_replica_or_the_one_named(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=cluster, timeout=60) as client:
        ps = client.get("/api/ps").json()["models"]
        replicas = {m["replica"] for m in ps}
        assert len(replicas) == 2 and {m["name"] for m in ps} == {f"{MODEL}:latest"}  # each loaded it
        metrics = client.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(metrics.text)}  # one valid exposition
        assert metrics.text.count("# TYPE pebbling_generated_tokens_total counter") == 1
        generated = [s for s in families["pebbling_generated_tokens"].samples if s.name.endswith("_total")]
        assert {s.labels["replica"] for s in generated} == replicas
        assert all(s.labels["model"] == MODEL and s.value > 0 for s in generated)
        one = sorted(replicas)[0]
        alone = client.get("/api/ps", headers={"X-Pebbling-Replica": one}).json()["models"]
        assert [m["replica"] for m in alone] == [one]
        own = client.get("/metrics", headers={"X-Pebbling-Replica": one}).text
        assert f'replica="{one}"' in own and not any(f'replica="{r}"' in own for r in replicas - {one})
        missing = client.get("/api/ps", headers={"X-Pebbling-Replica": "nope"})
        assert missing.status_code == 404 and one in missing.json()["error"]


@pytest.mark.ci
def test_the_front_refuses_a_body_past_the_apps_limit(cluster):
    r = httpx.post(f"{cluster}/api/chat", content=b"x" * (9 << 20), timeout=60)
    assert r.status_code == 413 and "8 MiB" in r.json()["error"]


@pytest.mark.ci
def test_an_autoscaled_application_answers_under_its_route_prefix(cluster, models_dir):
    from pyplugin.serving.ray_deploy import build_app

    serve.run(build_app({"models": str(models_dir), "num_cpus": 0, "options": DEFAULTS,
                         "autoscaling": {"min_replicas": 1, "max_replicas": 2}}), name="auto", route_prefix="/auto")
    try:
        with httpx.Client(base_url=f"{cluster}/auto", timeout=60) as client:
            messages = [{"role": "user", "content": "a conversation below a route prefix"}]
            text, body, replica = chat(client, messages)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and again"}]
            _, again, same = chat(client, messages)
            assert same == replica and again["pebbling"]["cached_tokens"] > 0
            assert [m["replica"] for m in client.get("/api/ps").json()["models"]] == [replica]
        running = serve.status().applications["auto"].deployments["pebbling"].replica_states
        assert running.get("RUNNING") == 1  # min_replicas while idle
    finally:
        serve.delete("auto")


@pytest.mark.ci
def test_the_session_header_keeps_requests_together_and_a_requests_options_win(cluster):
    seen = set()
    with httpx.Client(base_url=cluster, timeout=60) as client:
        for i in range(6):
            r = client.post("/api/generate", headers={"X-Pebbling-Session": "user-42"}, json={
                "model": MODEL, "prompt": f"unrelated question {i}", "stream": False,
                "options": {**GREEDY, "pebbling_strategy": "minimal"}})
            assert r.status_code == 200 and r.json()["pebbling"]["strategy"] == "minimal"
            seen.add(r.headers["x-pebbling-replica"])
    assert len(seen) == 1


def active_requests(client, replica: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics", headers={"X-Pebbling-Replica": replica}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["pebbling_requests_active"].samples)


@pytest.mark.ci
def test_a_client_that_goes_away_stops_its_generation_on_the_replica(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        with client.stream("POST", "/api/generate", json={
                "model": MODEL, "prompt": "Go on and on.", "options": LONG}) as r:
            replica = r.headers["x-pebbling-replica"]
            lines = r.iter_lines()
            for _ in range(3):
                assert not json.loads(next(lines))["done"]
            assert active_requests(client, replica) == 1
        # Well before the answer's 3000 tokens would have been written.
        deadline = time.monotonic() + 1
        while active_requests(client, replica) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert active_requests(client, replica) == 0


@pytest.mark.ci
def test_killing_a_replica_fails_its_requests_in_flight_and_moves_its_conversations(cluster):
    session = {"X-Pebbling-Session": "doomed"}  # everything below goes to one replica while it lives
    with httpx.Client(base_url=cluster, timeout=120) as client:
        messages = [{"role": "user", "content": "a conversation that will lose its replica"}]
        text, body, victim = chat(client, messages, **session)
        first_prompt = body["pebbling"]["cached_tokens"] + body["prompt_eval_count"]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "still there?"}]
        lines: list[dict] = []

        def stream():
            with client.stream("POST", "/api/generate", headers=session, json={
                    "model": MODEL, "prompt": "Tell me everything.", "options": LONG}) as r:
                lines.append({"replica": r.headers.get("x-pebbling-replica")})
                for line in r.iter_lines():
                    if line:
                        lines.append(json.loads(line))

        whole: list[httpx.Response] = []

        def unstreamed():  # its answer would come at the end, in one piece
            whole.append(httpx.post(f"{cluster}/api/generate", headers=session, timeout=120, json={
                "model": MODEL, "prompt": "Tell me everything at once.", "stream": False, "options": LONG}))

        readers = [threading.Thread(target=stream), threading.Thread(target=unstreamed)]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 60
        while (len(lines) < 3 or active_requests(client, victim) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines[0]["replica"] == victim and active_requests(client, victim) == 2
        ray.kill(replica_actor(victim), no_restart=False)
        for reader in readers:
            reader.join(timeout=120)
            assert not reader.is_alive()
        assert "error" in lines[-1] and victim in lines[-1]["error"], lines[-1]
        assert not any(line.get("done") for line in lines[1:]), "the killed replica's answer did not finish"
        assert whole[0].status_code == 503 and "stopped before answering" in whole[0].json()["error"], whole[0].text

        # The conversation's next turn runs on the other replica, prefilled anew (at most a template's
        # opening shared with other conversations there comes from its cache).
        text, body, replica = chat(client, messages, **session)
        assert replica != victim and body["pebbling"]["cached_tokens"] < first_prompt
        for i in range(6):  # and every later request succeeds
            assert chat(client, [{"role": "user", "content": f"after the kill {i}"}])[2] != victim
