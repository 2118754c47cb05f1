"""The chat page at ``/``, in a real headless browser (Debian's Chromium, driven by Playwright):
it loads from the package's static files, names the model and the method, streams an answer that
is plain greedy decoding's text, colours the accepted draft tokens apart from the target's, shows
tokens/s and tau live and the server's figures at the end; with speculation switched off no token
is a draft's. The model is a tiny random one with a draft that agrees with it often."""

from __future__ import annotations

import shutil

import httpx
import pytest

from speculant import SpeculativeDecoder

from serve_helpers import CHAT_TEMPLATE, RunningServer
from tiny import tiny_llama, tiny_model_dir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (make install-browser installs Debian's)")
QUESTION = "w3 w4 w5 w3 w4"
TOKENS = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("page")
    target = tiny_model_dir(root / "target", seed=0)
    draft = tiny_model_dir(root / "draft", seed=1, base=tiny_llama(0, scale=4.0), noise=0.1)
    dec = SpeculativeDecoder(str(target), str(draft), method="sd", dtype="float32", pacing=False)
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    want = dec.generate([{"role": "user", "content": QUESTION}], TOKENS).text
    server = RunningServer(dec)
    yield server, want
    server.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _ask(page, speculate: bool = True) -> None:
    page.fill("#max_tokens", str(TOKENS))
    if not speculate:
        page.uncheck("#speculate")
    page.fill("#prompt", QUESTION)
    page.click("#send")
    page.wait_for_selector('#summary dd[data-key="tokens"]', timeout=60_000)


def test_the_page_streams_plain_decodings_answer_with_drafts_coloured(served, browser, tmp_path):
    server, want = served
    assert httpx.get(server.url + "/static/chat.js").status_code == 200
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelector('#model').textContent.includes('sd')")
    _ask(page)
    answer = page.locator(".msg").nth(1).locator(".body")
    assert answer.inner_text() == want
    drafts = page.locator(".msg .body .draft").count()
    assert drafts > 0 and page.locator(".msg .body .target").count() > 0
    assert "tok/s" in page.inner_text("#live") and "τ" in page.inner_text("#live")
    assert int(page.inner_text('#summary dd[data-key="tokens"]')) == TOKENS
    assert float(page.inner_text('#summary dd[data-key="τ (server)"]')) > 1.0
    page.screenshot(path=str(tmp_path / "chat.png"))
    page.close()


def test_with_speculation_off_no_token_is_a_drafts(served, browser):
    server, want = served
    page = browser.new_page()
    page.goto(server.url + "/")
    _ask(page, speculate=False)
    assert page.locator(".msg").nth(1).locator(".body").inner_text() == want
    assert page.locator(".msg .body .draft").count() == 0
    assert float(page.inner_text('#summary dd[data-key="τ (server)"]')) == 1.0
    page.close()


def test_an_error_is_shown_and_the_page_goes_on(served, browser):
    server, _ = served
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#temperature", "7")  # out of range: the server's 400 names it
    page.fill("#prompt", QUESTION)
    page.click("#send")
    page.wait_for_selector(".msg.error", timeout=30_000)
    assert "temperature" in page.inner_text(".msg.error")
    assert page.is_enabled("#send")
    page.close()
