"""What one request may cost the server, and who may hold a connection: each a reproducer that once took
gigabytes, stopped every model from unloading, answered 500, or held a connection for good; answered now
with a 400 (or a closed connection) while the server keeps serving."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
import requests

from helpers import rss_bytes
from pyplugin.model.synth import write_gguf
from pyplugin.serving import Engine, GenerationRequest
from pyplugin.serving.jobs import FOREVER, MAX_KEEP_ALIVE, parse_keep_alive
from server_patch import create_app
from server_patch.local import serving


TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=256)
GREEDY = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny.gguf", **TINY)
    write_gguf(root / "other.gguf", **TINY)
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    app = create_app(models_dir=models_dir)
    with serving(app, header_timeout=0.5, body_timeout=0.5) as url:
        yield url, app.state.engine


@pytest.fixture
def url(server):
    return server[0]


def generate(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/api/generate", timeout=60,
                         json={"model": "tiny", "prompt": "hi", "stream": False, "options": GREEDY, **body})


def error_of(r: requests.Response, status: int, *needles: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()["error"]
    message = body["message"] if isinstance(body, dict) else body
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------------------------------------------
# templates: bounded work, off the event loop


def test_a_range_over_a_huge_integer_is_refused_at_once_without_building_it(url):
    before = rss_bytes()
    start = time.perf_counter()
    r = generate(url, template="{{range 100000000}}{{end}}")
    seconds = time.perf_counter() - start
    error_of(r, 400, "range over 100000000 items", "1000000")
    assert seconds < 2.0 and rss_bytes() - before < 64 << 20
    r = generate(url, template="{{range 100000000}}{{if ge . 2}}{{break}}{{end}}{{.}}{{end}} {{.Prompt}}")
    assert r.status_code == 200, r.text  # a range that breaks early is run, counted as it goes


def test_nested_ranges_stop_at_the_iteration_limit(url):
    start = time.perf_counter()
    r = generate(url, template="{{range 2000}}{{range 2000}}{{end}}{{end}}")
    error_of(r, 400, "iterations this rendering has left (at most 1000000 in all)")
    r = generate(url, template="{{range 2000}}{{range 2000}}{{if false}}{{break}}{{end}}{{end}}{{end}}")
    error_of(r, 400, "ranges ran more than 1000000 iterations")  # may break: counted as it runs
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("template,needle", [
    ("{{if 1}}" * 3000 + "x" + "{{end}}" * 3000, "nested more than 100 deep"),
    ("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", "parentheses are nested more than 100 deep"),
    ("{{if 1}}{{else if 1}}" * 3000 + "{{end}}", "nested more than 100 deep"),
    ("{{1e400}}", "out of range"),
    ("{{" + "9" * 5000 + "}}", "out of range"),
    ('{{printf "%0999999999d" 1}}', "width and precision"),
    ('{{$x := "ab"}}{{range 40}}{{$x = print $x $x}}{{end}}{{$x}}', "more than a rendering may write"),
    ('{{printf "%c" 99999999999}}', "printf"),
])
def test_templates_past_a_limit_are_a_400_naming_it(url, template, needle):
    error_of(generate(url, template=template), 400, needle)


def test_get_root_stays_quick_while_templates_render_at_their_limit(url):
    # Each renders about as many iterations as a rendering may (999,999), with output; four at once.
    template = "{{range 999}}{{range 1000}}{{if eq . 999}}{{break}}{{end}}{{end}}{{.}}{{end}}{{.Prompt}}"
    statuses, latencies, done = [], [], threading.Event()

    def render():
        r = generate(url, template=template)
        statuses.append(r.status_code if r.status_code == 200 else r.json()["error"])

    def probe():
        with requests.Session() as s:
            while not done.is_set():
                start = time.perf_counter()
                assert s.get(f"{url}/", timeout=10).status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    renders = [threading.Thread(target=render) for _ in range(4)]
    for t in renders:
        t.start()
    for t in renders:
        t.join()
    done.set()
    prober.join()
    # Together they may pass the time a rendering is allowed: then they are stopped, and say so.
    assert len(statuses) == 4 and all(s == 200 or "took more than 5 s" in s for s in statuses), statuses
    print(f"\nGET / while 4 templates rendered: {len(latencies)} requests, median "
          f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms")
    assert len(latencies) >= 5 and max(latencies) < 1.0


# ---------------------------------------------------------------------------------------------------
# keep_alive


@pytest.mark.parametrize("value", [1e10, 1e308, float("inf"), "1e10", "3000000h", "9999999999999s",
                                   MAX_KEEP_ALIVE * 1.01])
def test_keep_alive_past_gos_longest_duration_is_forever(value):
    assert parse_keep_alive(value) == FOREVER


@pytest.mark.parametrize("value,seconds", [(0, 0.0), (300, 300.0), ("1h", 3600.0), (-1, FOREVER), ("-5m", FOREVER),
                                           (9e9, 9e9)])
def test_keep_alive_within_range_is_kept(value, seconds):
    assert parse_keep_alive(value) == seconds


def loaded(url: str) -> set[str]:
    return {m["name"] for m in requests.get(f"{url}/api/ps", timeout=10).json()["models"]}


@pytest.mark.parametrize("huge", ["1e10", "1e308", '"3000000h"'])
def test_after_a_huge_keep_alive_another_model_still_unloads_on_its_timer(url, huge):
    raw = '{"model":"tiny","prompt":"hi","stream":false,"options":{"num_predict":1},"keep_alive":' + huge + '}'
    assert requests.post(f"{url}/api/generate", data=raw, timeout=60).status_code == 200
    assert generate(url, model="other", keep_alive="1s").status_code == 200
    assert "other:latest" in loaded(url)
    deadline = time.monotonic() + 10
    while "other:latest" in loaded(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loaded(url) == {"tiny:latest"}
    ps = requests.get(f"{url}/api/ps", timeout=10).json()["models"]
    assert ps[0]["expires_at"].startswith("9999")  # kept for good
    assert generate(url, keep_alive=0).status_code == 200 and not loaded(url)


def test_the_reaper_survives_an_exception_and_unloads_later(models_dir, monkeypatch, caplog):
    engine = Engine(models_dir, backend="stub")
    try:
        real, failures = engine._unload, []

        def flaky(entry):
            if not failures:
                failures.append(entry)
                raise RuntimeError("injected")
            real(entry)

        monkeypatch.setattr(engine, "_unload", flaky)
        job = engine.submit(GenerationRequest(model="tiny", prompt="hi", options=GREEDY, keep_alive=0.2))
        list(job)
        deadline = time.monotonic() + 10
        while engine.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and not engine.running()
        assert "reaper failed" in caplog.text
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------
# request bodies


@pytest.mark.parametrize("prompt", ["\\ud800", "ok"])
def test_json_nested_5000_deep_is_a_400_whether_or_not_it_has_a_lone_surrogate(url, prompt):
    raw = '{"model":"tiny","prompt":"' + prompt + '","x":' + "[" * 5000 + "]" * 5000 + "}"
    error_of(requests.post(f"{url}/api/generate", data=raw, timeout=30), 400, "more than 256 deep")
    raw = '{"model":"tiny","messages":[{"role":"user","content":"\\udc00' + "[" * 5000 + '"}],' \
          '"stream":false,"options":{"num_predict":1}}'
    assert requests.post(f"{url}/api/chat", data=raw, timeout=30).status_code == 200  # brackets in a string


def test_a_recursive_format_is_a_400_without_the_parsers_internals(url):
    fmt = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    message = error_of(generate(url, format=fmt, options={"num_predict": 8}), 400, "format")
    assert "\n" not in message and "<state>" not in message and "Parser" not in message


def test_v1_completions_without_max_tokens_writes_at_most_16_tokens_a_choice(url):
    r = requests.post(f"{url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "Once", "n": 3, "seed": 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3 and 0 < r.json()["usage"]["completion_tokens"] <= 48
    r = requests.post(f"{url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "Once", "max_tokens": 20, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] in range(17, 21) or r.json()["choices"][0]["finish_reason"] == "stop"


def test_the_openapi_document_lists_what_the_routes_answer(url):
    doc = requests.get(f"{url}/openapi.json", timeout=10).json()["paths"]
    assert {"400", "404"} <= set(doc["/v1/models/{model}"]["get"]["responses"])
    assert "application/x-ndjson" in doc["/api/generate"]["post"]["responses"]["200"]["content"]
    assert requests.get(f"{url}/v1/models/nope", timeout=10).status_code == 404


# ---------------------------------------------------------------------------------------------------
# Host and Origin


@pytest.mark.parametrize("host", ["LOCALHOST", "localhost.", "", "Localhost.:11435", "[::1]:80", "127.0.0.1",
                                  "app.localhost", "0.0.0.0:1"])
def test_loopback_hosts_are_accepted_however_written(url, host):
    assert requests.get(f"{url}/api/version", headers={"Host": host}, timeout=10).status_code == 200


@pytest.mark.parametrize("host", ["localhost:80@evil.com", "evil.com", "localhost.evil.com", "localhost/x",
                                  "192.168.1.10", "printer.local", "localhost:99999999", "127.0.0.1 evil"])
def test_other_hosts_are_refused(url, host):
    error_of(requests.get(f"{url}/api/version", headers={"Host": host}, timeout=10), 403, "not a loopback name")


@pytest.mark.parametrize("origin,status", [("http://[::1]:8080", 200), ("HTTP://LOCALHOST:3000", 200),
                                           ("http://1:8080", 403), ("http://localhost:80@evil.com", 403),
                                           ("http://localhost:3000/path", 403), ("null", 403)])
def test_origins_are_parsed_and_matched_literally_but_for_the_wildcard(url, origin, status):
    r = requests.get(f"{url}/api/version", headers={"Origin": origin}, timeout=10)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.headers["access-control-allow-origin"] == origin


def test_an_allowed_ipv6_origin_is_taken_literally(models_dir, monkeypatch):
    monkeypatch.setenv("PEBBLING_ORIGINS", "http://[::1]:8080")
    with serving(create_app(models_dir=models_dir)) as url:
        ok = requests.get(f"{url}/api/version", headers={"Origin": "http://[::1]:8080"}, timeout=10)
        assert ok.status_code == 200
        assert requests.get(f"{url}/api/version", headers={"Origin": "http://1:8080"}, timeout=10).status_code == 403


# ---------------------------------------------------------------------------------------------------
# connections


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `sock` (it sends nothing first); fails past `seconds`."""
    sock.settimeout(seconds)
    start = time.perf_counter()
    assert sock.recv(4096) == b""
    return time.perf_counter() - start


def open_to(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                  b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"mo"])
def test_a_slow_request_is_closed_after_its_read_timeout(url, sent):
    with open_to(url) as sock:
        sock.sendall(sent)
        assert closed_within(sock, 5) < 3
    assert requests.get(f"{url}/", timeout=10).status_code == 200


def test_a_slow_client_that_keeps_sending_is_closed_too(url):
    with open_to(url) as sock:
        start = time.perf_counter()
        with pytest.raises(OSError):
            for _ in range(100):  # a header byte every 0.1 s: each arrives, the whole never does
                sock.sendall(b"X")
                time.sleep(0.1)
            pytest.fail("the connection was still open after 10 s")
        assert time.perf_counter() - start < 5


def test_a_kept_alive_connection_serves_request_after_request(url):
    with requests.Session() as s:
        for _ in range(3):
            assert s.get(f"{url}/", timeout=10).status_code == 200
            time.sleep(0.3)  # within uvicorn's keep-alive, while the read timeout is 0.5 s


def test_connections_past_the_cap_are_answered_503(models_dir):
    with serving(create_app(models_dir=models_dir), max_connections=3) as url:
        held = [open_to(url) for _ in range(3)]
        try:
            time.sleep(0.2)
            with open_to(url) as extra:
                extra.settimeout(5)
                answer = extra.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"PEBBLING_MAX_CONNECTIONS" in answer
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        assert requests.get(f"{url}/", timeout=10).status_code == 200
