"""The chat page at ``GET /`` in headless Chromium: a reply streams in over /v1/stream, and Stop cancels.

The frontend is a real frontend process (``build_router`` registers the WebSocket
module) against the slow fake engine of tools/fake_engine.py, with an API key, so
the page's key field and the ``tokenmill.key64.<base64url of KEY>`` subprotocol are exercised.
Chromium comes from Debian (``apt-get install chromium``); without it the test
skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
import time

import pytest

from tools.fake_engine import KEY, fake_stack

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        msg = f"{CHROMIUM} is missing (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


PAGE_KEY = "Zm9v/YmFy+YQ=="  # (as `openssl rand -base64` makes them: "/", "+", "=" are no subprotocol characters)


@pytest.fixture(scope="module")
def frontend(tmp_path_factory, smollm_tokenizer_dir):
    with fake_stack(str(tmp_path_factory.mktemp("pageeng")), smollm_tokenizer_dir, step_delay=0.03,
                    api_keys=(KEY, PAGE_KEY)) as stack:
        yield stack


def test_chat_page_streams_and_stops(browser, frontend, tmp_path):
    engine, port = frontend
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    console_errors = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.goto(f"http://127.0.0.1:{port}/")
    assert page.locator("#api-key").is_visible()  # the server has keys
    page.fill("#api-key", PAGE_KEY)  # (sent as tokenmill.key64.<base64url>)
    page.dispatch_event("#api-key", "change")

    # a short reply runs to its end
    page.fill("#max-tokens", "12")
    page.fill("#prompt", "Hello there!")
    page.press("#prompt", "Enter")
    first = page.locator(".msg.assistant").nth(0)
    page.wait_for_function("() => !document.querySelector('.msg.assistant').classList.contains('streaming')",
                           timeout=15_000)
    assert "length" in first.locator(".meta").inner_text()
    assert "12 tokens" in first.locator(".meta").inner_text()
    assert page.locator("#status").inner_text() == "connected"

    # a long one is stopped mid-stream
    page.fill("#max-tokens", "400")
    page.fill("#prompt", "Now tell me a long story.")
    page.click("#send")
    second = page.locator(".msg.assistant").nth(1)
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant')[1].textContent.length > 20",
                           timeout=15_000)
    assert page.locator("#stop").is_enabled()
    time.sleep(0.2)
    page.screenshot(path=str(tmp_path / "chat-streaming.png"))
    rid = engine.adds[-1].request_id
    page.click("#stop")
    page.wait_for_function("() => !document.querySelectorAll('.msg.assistant')[1].classList.contains('streaming')",
                           timeout=10_000)
    meta = second.locator(".meta").inner_text()
    assert meta.startswith("stopped")
    assert int(meta.split("·")[1].split()[0]) < 400
    deadline = time.monotonic() + 5
    while rid not in engine.aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.aborts and rid not in engine.running
    assert page.locator("#send").is_enabled() and not page.locator("#stop").is_enabled()
    page.screenshot(path=str(tmp_path / "chat-stopped.png"))
    assert not console_errors, console_errors
    page.close()
