"""Property test over the whole HTTP API: whatever a client sends, the server answers with a status its
OpenAPI document lists, in JSON, never a 5xx, and still serves a correct request afterwards.

Requests come from hypothesis: about half are near-valid generations on a real loaded model (every
option drawn from its valid range or just outside it, a few tokens each; Go template bodies with huge and
nested ranges, deep nesting, huge literals and recursion; keep_alive at and past its edges; crafted GGUF
files whose shapes do not fit their types), the rest anything at all (wrong types, huge and non-finite
numbers, odd strings, unknown fields and paths). The server is its own process, as `pebbling serve` runs,
so that its resident memory is measured alone: at the end it must be within 64 MiB of where it was after
its first generation. `make fuzz` sends PEBBLING_FUZZ_EXAMPLES=10000 and prints the figures; `make test`
sends a few hundred.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import craft, pebbling_serve, rss_bytes
from pyplugin.model.synth import write_gguf
from registry import serving_registry

EXAMPLES = int(os.environ.get("PEBBLING_FUZZ_EXAMPLES", "300"))
TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx=128)
POSTS = ("/api/generate", "/api/chat", "/api/show", "/v1/chat/completions", "/v1/completions", "/api/embed",
         "/api/embeddings", "/v1/embeddings")
RSS_SLACK = 64 * 2**20
# Files whose header lies about a tensor's shape (tests/test_gguf_shapes.py), one cut short, one not GGUF.
CRAFTED = {"zero-dimension": ("blk.0.attn_q.weight", None, (64, 0)),
           "q8_0-33-columns": ("blk.0.attn_q.weight", 8, (33, 64)),
           "q8_0-17-element-vector": ("blk.0.attn_norm.weight", 8, (17,))}
# Model management and the Responses API; pulls go to a registry on loopback that has no models.
MANAGEMENT = ("/api/pull", "/api/create", "/api/copy", "/api/push", "/v1/responses", "/api/blobs/sha256:" + "0" * 64)
MODELS = ("tiny", "tiny:latest", "tiny", "tiny", "tiny", "absent", *CRAFTED, "truncated", "not-gguf")
GETS = ("/", "/api/version", "/api/tags", "/api/ps", "/v1/models", "/api/nothing", "/v1/../api/tags")

# Strings a careless client or an attacker sends.
odd_text = st.one_of(
    st.text(max_size=40), st.sampled_from(["", " ", "a\ud800b", "\udfff", "every:²", "every:٢", "every:" + "9" * 300,
                                           "../../etc/passwd", "/etc/shadow", "tiny:latest", "tiny", "pebbling-demo",
                                           "registry.ollama.ai/library/tiny:latest", "{{ .Prompt }}", "\x00", "1e400",
                                           "6GiB", "-1", "NaN", "<|im_start|>", "x" * 2000]))
# Go template bodies: ranges small to huge and nested, deep ifs, huge literals, recursion, broken syntax.
range_counts = st.sampled_from([0, 1, 7, 1000, 10**6, 10**6 + 1, 10**8, 2**63, 10**30, -1])
template_parts = st.one_of(
    st.sampled_from(["{{ .Prompt }}", "{{ .System }}", "{{range .Messages}}{{.Content}}{{end}}", "{{", "}}",
                     "{{end}}", "{{range}}", "{{if}}", "{{break}}", "{{.Nothing.Deeper}}", "{{len 3}}",
                     '{{printf "%999999999d" 1}}', '{{printf "%.999999999f" 1.0}}', "{{1e400}}",
                     '{{define "r"}}{{template "r"}}{{end}}{{template "r"}}', '{{template "absent"}}',
                     '{{$x := "ab"}}{{range 64}}{{$x = print $x $x}}{{end}}{{$x}}', "{{slice .Prompt 5 1}}",
                     "{{index .Messages 99}}", "{{ json .Tools }}", "{{ .Response }}"]),
    range_counts.map(lambda n: f"{{{{range {n}}}}}{{{{.}}}}{{{{end}}}}"),
    st.tuples(range_counts, range_counts).map(lambda nm: f"{{{{range {nm[0]}}}}}{{{{range {nm[1]}}}}}{{{{end}}}}"
                                                         "{{end}}"),
    st.integers(1, 400).map(lambda depth: "{{if true}}" * depth + "x" + "{{end}}" * depth),
    st.sampled_from([10, 10**4, 10**6]).map(lambda n: '{{"' + "x" * n + '"}}'),
    st.sampled_from([10**5, 10**6]).map(lambda n: "y" * n))
templates = st.lists(template_parts, min_size=1, max_size=3).map("".join)
# keep_alive at and past its edges: Go durations, seconds, forever, past Go's longest duration, nonsense.
keep_alives = st.one_of(
    st.sampled_from([0, -1, 1, "0", "-1", "0s", "5m", "1h30m", "300ms", "3000000h", "9999999999h", "1e10",
                     "5 minutes", "forever", "", "m5", "-5m", 1e10, 9.3e9, 1e308, -1e308, 2**63, -(2**63), 0.5,
                     None, True, [], {}]),
    st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=-2**70, max_value=2**70))
numbers = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30, 0.5, 1e308]))
json_values = st.recursive(st.none() | st.booleans() | numbers | odd_text,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
                           max_leaves=12)

# Near-valid options: each drawn from a valid value or a wrong one.
option_values = {
    "temperature": st.one_of(st.floats(0, 2), numbers), "top_k": st.one_of(st.integers(0, 100), numbers),
    "top_p": st.one_of(st.floats(0, 1), numbers), "min_p": st.floats(0, 1), "seed": st.integers(-1, 2**40),
    "num_predict": st.integers(-2, 3), "num_ctx": st.one_of(st.integers(1, 128), st.integers(129, 2**40)),
    "num_batch": st.integers(-1, 64), "repeat_penalty": st.one_of(st.floats(0.5, 2), numbers),
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=3)),
    "pebbling_strategy": st.one_of(st.sampled_from(["none", "sqrt", "adaptive", "minimal", "every:1", "every:3"]),
                                   odd_text),
    "pebbling_memory_limit": st.one_of(st.sampled_from(["64MiB", "1GiB", 10**9, "1KiB"]), numbers, odd_text),
    "pebbling_enabled": st.one_of(st.booleans(), json_values), "pebbling_weights": st.sampled_from(
        ["quantized", "f16", "q4", 1]),
}
valid_option_values = {
    "temperature": st.floats(0, 2), "top_k": st.integers(0, 100), "top_p": st.floats(0, 1), "min_p": st.floats(0, 1),
    "seed": st.integers(-1, 2**40), "num_ctx": st.integers(16, 128), "num_batch": st.integers(1, 64),
    "repeat_penalty": st.floats(0.5, 2), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "pebbling_strategy": st.sampled_from(["none", "sqrt", "adaptive", "minimal", "every:1", "every:3"]),
    "pebbling_memory_limit": st.sampled_from(["64MiB", "1GiB", 10**9]), "pebbling_enabled": st.booleans(),
    "pebbling_weights": st.sampled_from(["quantized", "f16"]),
}


def _few_tokens(o: dict) -> dict:
    return {**o, "num_predict": o["num_predict"] if o.get("num_predict", -1) in range(0, 4) else 2}


# Half of the generations valid in every option, half with each option valid or not.
options = st.one_of(
    st.fixed_dictionaries({"num_predict": st.integers(1, 3)}, optional=valid_option_values),
    st.fixed_dictionaries({}, optional=option_values).map(_few_tokens))


@st.composite
def near_valid(draw) -> tuple[str, str, dict]:
    """A generation for the real model, with every field drawn from around its valid values."""
    path = draw(st.sampled_from(POSTS[:2] + POSTS[3:]))
    model = draw(st.sampled_from(MODELS))
    text = draw(st.one_of(st.text(min_size=1, max_size=30), odd_text))
    if "embed" in path:
        inputs = draw(st.one_of(st.just(text), st.lists(st.one_of(st.text(max_size=20), odd_text), max_size=3)))
        key = "prompt" if path == "/api/embeddings" else "input"
        return "model", path, {"model": model, key: inputs, "options": draw(options),
                               **({"dimensions": draw(st.integers(-1, 80))} if draw(st.booleans()) else {})}
    body: dict = {"model": model, "stream": draw(st.booleans())}
    if draw(st.integers(0, 3)) == 0:
        body["keep_alive"] = draw(keep_alives)
    if path == "/api/generate":
        body.update(prompt=text, raw=draw(st.booleans()), options=draw(options))
        if draw(st.integers(0, 2)) == 0:
            body["template"] = draw(templates)
    elif path == "/api/chat":
        body.update(messages=[{"role": draw(st.sampled_from(["user", "system", "assistant", "tool", "x"])),
                               "content": text}], options=draw(options))
        if draw(st.integers(0, 3)) == 0:
            body["template"] = draw(templates)
    elif path == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": draw(st.one_of(st.just(text), json_values))}],
                    max_tokens=draw(st.integers(1, 3)), temperature=draw(st.floats(0, 2)),
                    pebbling_strategy=draw(option_values["pebbling_strategy"]))
    else:
        body.update(prompt=text, max_tokens=draw(st.integers(1, 3)))
    return "model", path, body


@st.composite
def anything(draw) -> tuple[str, str, object]:
    """Any JSON at any route, or not JSON at all."""
    if draw(st.integers(0, 4)) == 0:
        return "GET", draw(st.sampled_from(GETS)), None
    path = draw(st.sampled_from(POSTS + MANAGEMENT))
    body = draw(st.one_of(json_values, st.dictionaries(
        st.sampled_from(["model", "prompt", "messages", "options", "stream", "keep_alive", "context", "template",
                         "system", "raw", "format", "images", "max_tokens", "n", "stop", "tools"]), json_values,
        max_size=6).map(lambda d: {"model": "tiny", **d})))
    if draw(st.integers(0, 9)) == 0:
        return "POST", path, draw(st.sampled_from(["{", "not json", "\xff\xfe", "[]" * 1000, '{"model": "t' + "i" * 50]))
    return "POST", path, body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`pebbling serve` in its own process over a models directory holding the tiny model and the crafted
    files, pulling from a registry on loopback that has no models; yields its URL, the statuses its OpenAPI
    document lists, and its process id."""
    root = tmp_path_factory.mktemp("models")
    base = write_gguf(root / "tiny.gguf", **TINY)
    for name, (tensor, qtype, ne) in CRAFTED.items():
        craft(base, root / f"{name}.gguf", tensor, qtype, ne)
    (root / "truncated.gguf").write_bytes(base.read_bytes()[:base.stat().st_size // 2])
    (root / "not-gguf.gguf").write_bytes(b"this is not a GGUF file\n" * 100)
    with serving_registry() as registry, pebbling_serve(root, {
            "OLLAMA_MODELS": str(tmp_path_factory.mktemp("ollama")), "PEBBLING_REGISTRY": registry.url}) as served:
        yield served


def send(url: str, kind: str, path: str, body) -> requests.Response:
    if kind == "GET":
        return requests.get(url + path, timeout=120)
    data = body if isinstance(body, str) else json.dumps(body, allow_nan=True)
    return requests.post(url + path, data=data.encode("utf-8", "surrogatepass"), timeout=120)


def test_no_request_gets_a_5xx_or_an_undocumented_status(server):
    url, documented, pid = server
    greedy = {"model": "tiny", "prompt": "Hello", "stream": False, "options": {"temperature": 0, "num_predict": 2}}
    assert send(url, "model", "/api/generate", greedy).status_code == 200
    rss_start = rss_bytes(pid)
    statuses: Counter = Counter()
    upstream: Counter = Counter()  # the documented 5xx: a push (501), a pull from an unreachable registry (502)
    kinds: Counter = Counter()  # True: a near-valid generation for the loaded model

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.booleans().flatmap(lambda aimed: near_valid() if aimed else anything()))
    def one(request):
        kind, path, body = request
        method = "GET" if kind == "GET" else "POST"
        r = send(url, kind, path, body)
        statuses[r.status_code] += 1
        kinds[kind == "model"] += 1
        # A pull of a name with a registry host of its own goes to that host: unreachable here, a 502; a push
        # is not implemented, a 501.
        expected_5xx = {"/api/pull": 502, "/api/push": 501}
        assert r.status_code < 500 or expected_5xx.get(path) == r.status_code, (path, body, r.status_code, r.text[:300])
        if r.status_code >= 500:
            upstream[r.status_code] += 1
        if path in documented and r.status_code != 405:
            assert str(r.status_code) in documented[path].get(method, {str(r.status_code)}), (path, r.status_code)
        if r.status_code != 200 or path in ("/",):
            return
        if r.headers.get("content-type", "").startswith("application/x-ndjson"):
            lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            assert lines and (lines[-1].get("done") or "error" in lines[-1] or lines[-1].get("status") == "success")
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            last = r.text.rstrip().rsplit("\n", 1)[-1]
            assert last == "data: [DONE]" or path == "/v1/responses" and last.startswith("data: "), last
        else:
            r.json()

    one()
    total = sum(statuses.values())
    r = send(url, "model", "/api/generate", greedy)
    assert r.status_code == 200 and r.json()["eval_count"] == 2  # still serving
    rss_end = rss_bytes(pid)
    print(f"\nfuzz: {total} requests, {kinds[True]} of them generations aimed at the models; statuses "
          f"{dict(sorted(statuses.items()))}; 5xx other than push's 501 and an unreachable registry's 502: "
          f"{sum(n for s, n in statuses.items() if s >= 500) - sum(upstream.values())}; server RSS "
          f"(measured, VmRSS) {rss_start / 2**20:.1f} MiB after its first generation, {rss_end / 2**20:.1f} MiB "
          f"at the end ({(rss_end - rss_start) / 2**20:+.1f} MiB)")
    assert rss_end - rss_start < RSS_SLACK, f"the server grew {(rss_end - rss_start) / 2**20:.1f} MiB"
    # hypothesis draws differ between its versions (derandomized, yet not a fair coin): 36% aimed at the models
    # on one GPU image, 2026-11; 30% is the floor that keeps the generation path well exercised
    assert total > 0.9 * EXAMPLES and kinds[True] > 0.3 * total
