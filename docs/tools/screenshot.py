"""Browser check of the documentation site: build it, serve it locally, and take headless Chromium
screenshots of the pages that most often go wrong (the home page, the losses API page with its
formulas, examples and parameter tables, and the benchmark page with its chart).

    python docs/tools/screenshot.py [--out DIR] [--site DIR] [--width 1280] [--height 1900]
        [--chromium PATH] [PAGE ...]

``--site DIR`` reuses a site already built (``mkdocs build --strict -d DIR``); without it the site
is built into a temporary directory first. A PAGE is a path below the site root, optionally with
a ``#fragment`` to scroll to (default: the three pages above). One PNG per page is written to
``--out`` (default ``/tmp/shots``); open them in any image viewer. Needs a Chromium or Chrome
binary (Debian: ``apt-get install chromium``); no network access is used or needed: the site is
served from 127.0.0.1 and every asset is local.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (
    "",  # the home page
    "api/losses/#pmlfunc.losses.multi_similarity",
    "benchmarks/cpu/",
)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_browser(given: str | None) -> str:
    for name in (given,) if given else BROWSERS:
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit(
        "no Chromium found: install one (Debian: apt-get install chromium) or pass --chromium PATH"
    )


def build(site: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, check=True
    )


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def shot_name(page: str) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "-", page.split("#", 1)[0]).strip("-")
    if "#" in page:
        name += "--" + re.sub(r"[^A-Za-z0-9]+", "-", page.split("#", 1)[1].split(".")[-1])
    return (name or "home") + ".png"


def _pipe_fds(read_end: int, write_end: int) -> None:
    """In the browser's process: its DevTools pipe on descriptors 3 (in) and 4 (out)."""
    read_end, write_end = os.dup(read_end), os.dup(write_end)  # out of the way of 3 and 4
    os.dup2(read_end, 3)
    os.dup2(write_end, 4)


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    JSON messages separated by NUL bytes on file descriptors 3 and 4); no extra package needed.
    The command-line ``--screenshot`` cannot scroll to a ``#fragment`` reliably, this can."""

    def __init__(self, binary: str, width: int, height: int) -> None:
        self.width, self.height, self._id = width, height, 0
        self._profile = tempfile.TemporaryDirectory()
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        self._proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",  # needed as root (containers, CI)
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=functools.partial(_pipe_fds, to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, wait_event: str | None = None, **params):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        result, seen_event = None, wait_event is None
        deadline = time.monotonic() + 60
        while result is None or not seen_event:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method}: no answer from the browser")
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result = reply.get("result", {})
            elif reply.get("method") == wait_event:
                seen_event = True
        return result

    def screenshot(self, url: str, out: Path) -> None:
        # From a blank page each time: a new #fragment of the same page would be a same-document
        # navigation, which fires no load event.
        for address in ("about:blank", url):
            self.call("Page.navigate", session=True, wait_event="Page.loadEventFired", url=address)
        fragment = url.split("#", 1)[1] if "#" in url else ""
        script = (
            "document.fonts.ready.then(() => {"
            f"  const el = document.getElementById({json.dumps(fragment)});"
            # "instant": the theme's CSS asks for smooth scrolling, which a screenshot would catch
            # half-way; the fixed navigation bar would hide the heading.
            "  const bar = document.querySelector('.navbar.fixed-top');"
            "  const top = (bar ? bar.offsetHeight : 0) + 16;"
            "  if (el) window.scrollTo({top: el.getBoundingClientRect().top + window.scrollY - top,"
            "                          behavior: 'instant'});"
            "  return new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));"
            "})"
        )
        self.call("Runtime.evaluate", session=True, expression=script, awaitPromise=True)
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        out.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError, TimeoutError):
            pass
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pages", nargs="*", default=list(PAGES), help="paths below the site root")
    p.add_argument("--out", type=Path, default=Path("/tmp/shots"))
    p.add_argument("--site", type=Path, default=None, help="an already built site")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1900)
    p.add_argument("--chromium", default=None, help="the browser binary")
    args = p.parse_args(argv)
    browser = find_browser(args.chromium)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site or Path(tmp) / "site"
        if args.site is None:
            build(site)
        server, base = serve(site)
        written = []
        chrome = Browser(browser, args.width, args.height)
        try:
            for page in args.pages:
                out = args.out / shot_name(page)
                chrome.screenshot(base + page, out)
                print(out)
                written.append(out)
        finally:
            chrome.close()
            server.shutdown()
    return written


if __name__ == "__main__":
    main()
