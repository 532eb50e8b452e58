"""The playground page at ``/`` in a real browser: Playwright for Python driving Debian's chromium (Playwright's own
browser download is not reachable here; ``.ci/browser-deps`` installs both). Missing dependencies fail the test:
they are part of the default suite.

One server (``python -m serve`` with an API key, on the shipped model, with tests/test_serve.py's engine flags so
the compiled programs come from the run's compilation cache) serves the page and the API.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from dllm_jax.assets import DEFAULT_MODEL_PATH
from conftest import TEST_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
API_KEY = "playground-key-42"
MAX_RUNNING, CONTEXT, PREFILL_TOKENS = 4, 512, 64  # as tests/test_serve.py: the same device programs
SHAPE_BUCKETS = {"rows": [2 * MAX_RUNNING], "pages": [CONTEXT // 32], "prefill_rows": [1],
                 "prefill_blocks": [PREFILL_TOKENS // 32]}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serve.launch import ServerProcess

    log_path = tmp_path_factory.mktemp("playground_log") / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=TEST_XLA_FLAGS, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=REPO)
    args = ["--model-path", DEFAULT_MODEL_PATH, "--max-running-requests", str(MAX_RUNNING), "--context-length",
            str(CONTEXT), "--max-prefill-tokens", str(PREFILL_TOKENS), "--shape-buckets", json.dumps(SHAPE_BUCKETS),
            "--no-warmup", "--api-key", API_KEY, "--log-level", "warning", "--no-access-log"]
    with ServerProcess(args, env=env, cwd=REPO, log_path=str(log_path)) as proc:
        yield proc.base
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _stream_frames(client, body) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _pick_prompt(client) -> str:
    """A held-out prompt whose answer has a block that takes several denoise steps (so the page gets provisional
    frames with masked positions; the shipped model often commits a whole block in one forward)."""
    from dllm_jax.train.tasks import heldout_set

    for ex in heldout_set(40):
        body = {"messages": [{"role": "user", "content": ex.prompt}], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "stream_provisional": True}
        for frame in _stream_frames(client, body):
            block = frame["choices"][0]["delta"].get("dllm_block") if frame.get("choices") else None
            if block and block["provisional"] and any(block["masked"]):
                return ex.prompt
    pytest.fail("no held-out prompt takes more than one step per block")


def _answer(client, messages) -> str:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# Records, in the page itself, every rendering of the live block that shows a masked placeholder.
OBSERVER = """() => {
  window.__seen = {masked: 0, provisionalWithMask: 0, maxMasked: 0};
  const grid = document.getElementById('block');
  new MutationObserver(() => {
    const masked = grid.querySelectorAll('.cell.masked').length;
    if (masked) {
      window.__seen.masked += 1;
      window.__seen.maxMasked = Math.max(window.__seen.maxMasked, masked);
      if (grid.dataset.state === 'provisional') window.__seen.provisionalWithMask += 1;
    }
  }).observe(grid, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_playground_in_a_real_browser(server, client):
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: run .ci/browser-deps (apt-get install chromium)"
    from playwright.sync_api import sync_playwright  # a missing package fails here: run .ci/browser-deps

    # the page and its files need no key; the API does
    assert httpx.get(server + "/").status_code == 200
    assert httpx.get(server + "/static/playground.js").status_code == 200
    assert httpx.get(server + "/v1/models").status_code == 401
    for path in ("/static/..%2Fapp.py", "/static/..%2F..%2Fpyproject.toml", "/static/nope.js"):
        assert httpx.get(server + path).status_code == 404, path  # nothing outside serve/static

    prompt = _pick_prompt(client)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            posted = []
            page.on("request", lambda r: posted.append(r.post_data) if r.url.endswith("/v1/chat/completions")
                    else None)
            page.goto(server + "/")
            # the server has a key: the page asks for it (once), then shows the model and the algorithm
            page.wait_for_selector("#key-dialog[open]", timeout=10_000)
            page.fill("#api-key", API_KEY)
            page.click("#key-form button[type=submit]")
            # (a selector, not wait_for_function: its polling evaluates strings, which the page's CSP forbids)
            page.locator("#info-algorithm", has_text=re.compile(r"^LowConfidence")).wait_for(timeout=10_000)
            assert page.text_content("#info-block") == "32"
            assert page.text_content("#info-model") == os.path.basename(DEFAULT_MODEL_PATH)
            page.evaluate(OBSERVER)

            page.fill("#max-tokens", str(MAX_TOKENS))
            page.fill("#temperature", "0")
            page.fill("#prompt", prompt)
            page.click("#send")
            page.wait_for_selector("#status[data-state=done]", timeout=30_000)
            shown = page.locator("#transcript li.assistant").last.text_content()
            seen = page.evaluate("window.__seen")
            frames = int(page.text_content("#stat-frames"))
            tpf = float(page.text_content("#stat-tpf"))

            # a second turn: the key is not asked again, and the page sends the whole conversation
            second = "Count down 5 steps from 20."
            page.fill("#prompt", second)
            page.click("#send")
            page.wait_for_selector("#transcript li.assistant:nth-of-type(2)[data-state=done]", timeout=30_000)
            shown2 = page.locator("#transcript li.assistant").last.text_content()
            assert not page.is_visible("#key-dialog")
            assert not errors, errors
        finally:
            browser.close()

    # what the page showed is the API's answer to the same request (sent without streaming)
    body = json.loads(posted[0])
    assert body["stream"] is True and body["stream_provisional"] is True
    assert body["messages"] == [{"role": "user", "content": prompt}] and body["max_tokens"] == MAX_TOKENS
    expected = _answer(client, body["messages"])
    assert shown == expected and expected.strip()
    # at least one provisional frame with a placeholder was rendered
    assert seen["provisionalWithMask"] >= 1 and seen["maxMasked"] >= 1, seen
    body2 = json.loads(posted[-1])
    assert body2["messages"] == [{"role": "user", "content": prompt}, {"role": "assistant", "content": shown},
                                 {"role": "user", "content": second}]
    assert shown2 == _answer(client, body2["messages"])
    # the first turn's statistics: its provisional frames counted, several tokens per forward (the shipped model
    # is trained on single-turn prompts only, so the second turn's answer may be short)
    assert frames >= 1 and tpf > 1, (frames, tpf)
