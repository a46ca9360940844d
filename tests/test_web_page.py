"""The web page at the server's root, in a real browser: headless Chromium (the distribution's package,
which .ci/run installs) driven by Playwright. The page loads with nothing from outside the server, a prompt's
answer streams in, and the layer map shows every layer resident under `none` and every layer streamed
under `minimal`; the estimate page draws its chart with the smallest budget marked. Screenshots are saved
under $PEBBLING_TEST_ARTIFACTS (else the test's temporary directory) and their folder printed.

The routes themselves (GET / by Accept, the page's files, /api/pebbling/estimate) are tested without a
browser, so they hold where none can be started; the browser test is skipped, with the reason, only there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import requests

from pyplugin.model.synth import write_gguf
from server_patch import create_app
from server_patch.local import serving
from server_patch.web import wants_html

N_LAYERS = 8
# Large enough that its tokens take a few milliseconds each on a CPU, so the page's speed plot has a shape.
SMALL = dict(arch="llama", n_layer=N_LAYERS, n_embd=512, n_head=8, n_head_kv=2, n_ff=1536, n_ctx=4096,
             weight_type="Q8_0")
MODEL = "tiny8:latest"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ENV = "PEBBLING_CHROMIUM"  # a browser to drive instead of the first of BROWSERS on PATH
BROWSER_HTML = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_gguf(root / "tiny8.gguf", **SMALL)
    with serving(create_app(models_dir=root)) as base:
        yield base


# ---------------------------------------------------------------------------------------------------
# the routes


def test_root_answers_a_browser_with_the_page_and_everyone_else_in_plain_text(url):
    for accept in (None, "*/*", "application/json", "text/plain", "text/html;q=0"):
        r = requests.get(f"{url}/", headers={} if accept is None else {"Accept": accept}, timeout=10)
        assert r.status_code == 200 and r.text == "pebbling is running", accept
        assert r.headers["content-type"].startswith("text/plain") and "Accept" in r.headers["vary"]
    assert requests.head(f"{url}/", timeout=10).status_code == 200
    page = requests.get(f"{url}/", headers={"Accept": BROWSER_HTML}, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>pebbling</title>" in page.text and 'id="layer-map"' in page.text
    # the page reaches this server only: no CDN, no inline script
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    assert "http://" not in page.text and "https://" not in page.text


def test_wants_html_reads_the_accept_header():
    assert wants_html(BROWSER_HTML) and wants_html("TEXT/HTML") and wants_html("application/xhtml+xml;q=0.5")
    assert not wants_html("*/*") and not wants_html("") and not wants_html("text/html;q=0")
    assert not wants_html("text/html;q=nonsense") and not wants_html("text/plain, application/json")


def test_the_pages_files_are_served_and_nothing_else_under_web(url):
    for name, kind in (("style.css", "text/css"), ("draw.js", "text/javascript"), ("chat.js", "text/javascript"),
                       ("estimate.js", "text/javascript")):
        r = requests.get(f"{url}/web/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert "innerHTML" not in r.text and "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
    for name in ("index.html", "../web.py", "%2e%2e%2fapp.py", "app.py"):
        assert requests.get(f"{url}/web/{name}", timeout=10).status_code == 404, name


def test_estimate_endpoint_gives_adaptives_budgets_from_the_smallest(url):
    r = requests.post(f"{url}/api/pebbling/estimate", json={"model": MODEL, "options": {"num_ctx": 1024}}, timeout=120)
    assert r.status_code == 200, r.text
    found = r.json()
    assert found["model"] == MODEL and found["n_layers"] == N_LAYERS and found["num_ctx"] == 1024
    assert "path" not in found  # responses name models, never paths
    budgets = found["budgets"]
    assert budgets[0]["resident_layers"] == 0 and budgets[-1]["resident_layers"] == N_LAYERS
    assert budgets[0]["budget_bytes"] == found["smallest_footprint_bytes"] \
        == found["strategies"]["minimal"]["estimated_peak_bytes"]
    assert budgets[-1]["budget_bytes"] == found["strategies"]["none"]["estimated_peak_bytes"]
    assert [p["budget_bytes"] for p in budgets] == sorted(p["budget_bytes"] for p in budgets)
    assert all(p["predicted_seconds_per_token"] > 0 for p in budgets)
    assert budgets[0]["streamed_bytes_per_token_estimate"] > budgets[-1]["streamed_bytes_per_token_estimate"] == 0
    # a limit: each strategy checked against it, adaptive filling it
    limit = budgets[len(budgets) // 2]["budget_bytes"]
    fitted = requests.post(f"{url}/api/pebbling/estimate", json={"model": MODEL, "options": {
        "num_ctx": 1024, "pebbling_memory_limit": limit}}, timeout=120).json()
    assert fitted["memory_limit_bytes"] == limit and fitted["strategies"]["none"]["fits"] is False
    assert fitted["strategies"]["adaptive"]["resident_layers"] == budgets[len(budgets) // 2]["resident_layers"]


@pytest.mark.parametrize("body,status,says", [
    ({"model": MODEL, "options": {"temperature": 0}}, 400, "does not shape an estimate"),
    ({"model": MODEL, "options": {"pebbling_memory_limit": "1KiB"}}, 400, "smallest footprint"),
    ({"model": MODEL, "options": {"pebbling_memory_limit": "-5"}}, 400, "pebbling_memory_limit"),
    ({"model": MODEL, "options": {"num_ctx": "many"}}, 400, "num_ctx"),
    ({"model": MODEL, "options": [1]}, 400, "must be an object"),
    ({"options": {}}, 400, "model"),
    ({"model": "no-such-model"}, 404, "not found"),
])
def test_estimate_endpoint_refuses_bad_input(url, body, status, says):
    r = requests.post(f"{url}/api/pebbling/estimate", json=body, timeout=60)
    assert r.status_code == status and says in r.json()["error"], r.text


def test_estimate_endpoint_is_in_the_openapi_document(url):
    paths = requests.get(f"{url}/openapi.json", timeout=10).json()["paths"]
    post = paths["/api/pebbling/estimate"]["post"]
    assert {"200", "400", "404"} <= set(post["responses"]) and "422" not in post["responses"]
    assert "text/html" in paths["/"]["get"]["responses"]["200"]["content"]


# ---------------------------------------------------------------------------------------------------
# in a browser


def artifacts(tmp_path: Path) -> Path:
    base = os.environ.get("PEBBLING_TEST_ARTIFACTS")
    out = Path(base) / "web_page" if base else tmp_path / "web_page"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the test extra has it)")
    executable = os.environ.get(CHROMIUM_ENV) or next(filter(None, map(shutil.which, BROWSERS)), None)
    with sync_api.sync_playwright() as playwright:
        try:  # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
            launched = playwright.chromium.launch(executable_path=executable,
                                                  args=["--no-sandbox", "--disable-dev-shm-usage"])
        except sync_api.Error as exc:
            pytest.skip(f"no browser could be started ({executable or 'no chromium on PATH'}): {exc}")
        yield launched
        launched.close()


@pytest.fixture
def page(browser, url):
    context = browser.new_context(viewport={"width": 1440, "height": 960})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"request outside the server: {r.url}")
            if not r.url.startswith(url) else None)
    page.problems = problems
    yield page
    context.close()


def ask(page, prompt: str, strategy: str, answers: int) -> None:
    """Sends `prompt` under `strategy` and waits for the answer's final report (the `answers`-th answer)."""
    page.select_option("#strategy", strategy)
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector(f"#history tbody tr:nth-child({answers})", state="attached", timeout=60_000)
    page.wait_for_selector(".streaming", state="detached", timeout=60_000)


def layer_states(page) -> list[str]:
    return page.eval_on_selector_all("#layer-map .layer", "squares => squares.map(s => s.classList[1])")


def test_the_page_streams_an_answer_and_draws_the_layers_each_strategy_keeps(page, url, tmp_path):
    shots = artifacts(tmp_path)
    page.goto(f"{url}/")
    assert page.title() == "pebbling"
    page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")
    page.select_option("#model", MODEL)
    page.wait_for_selector(f"#layer-map .layer:nth-child({N_LAYERS})")
    assert set(layer_states(page)) == {"unknown"}  # known to have 8 layers, not yet planned
    page.fill("#num-predict", "48")

    ask(page, "Why is the sky blue? <img src=x>", "none", answers=1)
    answer = page.locator(".message.assistant").nth(0)
    assert answer.inner_text().strip().upper() != "ASSISTANT"  # text arrived ...
    assert int(answer.get_attribute("data-chunks")) > 1       # ... in pieces, as it was generated
    assert page.locator("#messages img").count() == 0          # the prompt was drawn as text
    assert "<img src=x>" in page.locator(".message.user").nth(0).inner_text()
    assert layer_states(page) == ["resident"] * N_LAYERS
    assert page.get_attribute("#layer-map", "data-resident") == str(N_LAYERS)
    assert page.locator("#live-plot polyline").count() >= 1  # speed over the answer
    assert "estimated peak" in page.inner_text("#memory-bars") and "measured peak" in page.inner_text("#memory-bars")
    page.screenshot(path=shots / "none.png", full_page=True)

    ask(page, "And at sunset?", "minimal", answers=2)
    assert layer_states(page) == ["streamed"] * N_LAYERS
    assert page.get_attribute("#layer-map", "data-resident") == "0"
    rows = page.eval_on_selector_all("#history tbody tr", "rows => rows.map(r => r.innerText.split('\\t'))")
    assert [r[1] for r in rows] == ["none", "minimal"]
    assert [r[2] for r in rows] == [f"{N_LAYERS}/{N_LAYERS}", f"0/{N_LAYERS}"]
    assert page.locator(".message.assistant").count() == 2 and page.locator(".message.error").count() == 0
    page.screenshot(path=shots / "minimal.png", full_page=True)

    ask(page, "Once more.", "every", answers=3)  # every:2, N's default
    assert layer_states(page) == ["resident", "streamed"] * (N_LAYERS // 2)
    assert not page.problems, page.problems
    print(f"\nscreenshots of the web page: {shots}")


def test_the_estimate_page_charts_budget_against_predicted_speed(page, url, tmp_path):
    shots = artifacts(tmp_path)
    page.goto(f"{url}/#estimate")
    page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")
    page.select_option("#model", MODEL)
    page.wait_for_selector(f"#estimate-state:has-text('{MODEL}: ')", timeout=120_000)
    chart = page.text_content("#estimate-chart")
    assert "estimate" in chart and "smallest budget" in chart and "tok/s (predicted)" in chart
    assert page.locator("#estimate-chart .point").count() >= 2 and page.locator("#estimate-chart .curve").count() == 1
    assert page.locator("#estimate-table tbody tr").count() == 6
    budgets = requests.post(f"{url}/api/pebbling/estimate", json={"model": MODEL}, timeout=120).json()["budgets"]
    page.fill("#estimate-limit", str(budgets[len(budgets) // 2]["budget_bytes"]))  # between minimal and none
    page.click("#estimate-run")
    page.wait_for_selector("#estimate-chart .label.limit", state="attached", timeout=120_000)
    assert not page.problems, page.problems
    page.screenshot(path=shots / "estimate.png", full_page=True)
    print(f"\nscreenshot of the estimate page: {shots}")
