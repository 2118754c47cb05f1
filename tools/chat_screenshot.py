"""The screenshot of the chat page in docs/serve.md: ``speculant serve`` on a real model, one
question asked through the page in headless Chromium (Debian's: ``make install-browser``), the
page captured once the answer is in.

    python tools/chat_screenshot.py [--target PRESET] [--method auto] [--out docs/images/chat-page.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

QUESTION = "Write a Python function that checks whether a string is a palindrome, and explain it briefly."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--method", default="auto")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="docs/images/chat-page.png")
    args = p.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("no Chromium: make install-browser")
    server = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--target", args.target, "--method",
                               args.method, "--port", str(args.port)])
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                sys.exit("the server exited")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit("the server did not start")
            time.sleep(1)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(url + "/")
            page.wait_for_function("!document.querySelector('#model').textContent.includes('connecting')")
            page.fill("#max_tokens", str(args.max_tokens))
            page.fill("#prompt", QUESTION)
            page.click("#send")
            page.wait_for_selector('#summary dd[data-key="tokens"]', timeout=600_000)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            print(f"wrote {args.out}: {page.inner_text('#live')}")
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
