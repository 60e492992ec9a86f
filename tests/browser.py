"""Load the built book in headless Chromium with the network blocked, and check each page.

Used by ``tests/test_browser.py`` (``make test-browser``, part of ``make test``). Standard
library only: Chromium is driven through the DevTools protocol over a pipe
(``--remote-debugging-pipe``: JSON messages separated by NUL bytes on file descriptors 3 and
4), the book is served from ``_build/html`` on 127.0.0.1, and everything else is blocked
twice — every host name resolves to nothing (``--host-resolver-rules``) and every non-local
request goes to a dead proxy — so a page that needs the network shows it as a failed or
external request.

``check_page`` returns what the page did: console errors, failed and external requests, its
maths (``span.math``/``div.math`` elements and how many MathJax typeset), raw TeX left in the
visible text, images that did not decode, and widget cells (code calling ``interact(``)
without a decoded figure; a full-page screenshot is written next to the report.
"""
from __future__ import annotations

import base64
import fcntl
import functools
import http.server
import json
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["find_chromium", "Book", "Chromium", "check_page", "PAGE_CHECK_JS"]


# macOS keeps browsers in application bundles, not on PATH
MAC_BROWSERS = ("/Applications/Chromium.app/Contents/MacOS/Chromium",
                "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")


def find_chromium(system: str | None = None) -> str | None:
    """The Chromium (or Chrome) executable: ``$TURBOQUANT_CHROMIUM``, else the first of
    chromium, chromium-browser, google-chrome on PATH, else (macOS) the Chromium or Chrome
    application; ``None`` when there is none."""
    exe = os.environ.get("TURBOQUANT_CHROMIUM")
    if exe:
        return exe if shutil.which(exe) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    if (system or platform.system()) == "Darwin":
        for app in MAC_BROWSERS:
            if os.access(app, os.X_OK):
                return app
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # noqa: D102 - the test reports failures itself
        pass


class Book:
    """``_build/html`` served on 127.0.0.1 (an ephemeral port) while the context is open."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not (self.root / "index.html").is_file():
            raise ValueError(f"{self.root} holds no built book (index.html missing)")

    def __enter__(self):
        handler = functools.partial(_Quiet, directory=str(self.root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/"
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def pages(self) -> list[str]:
        """Every HTML page of the book, relative to its root (static assets excluded)."""
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*.html")
                      if not p.relative_to(self.root).parts[0].startswith("_"))


class Chromium:
    """A headless Chromium driven over ``--remote-debugging-pipe``; one page (tab) session."""

    def __init__(self, exe: str, width: int = 1200, height: int = 900, timeout: float = 60.0):
        self.timeout, self.width, self.height = timeout, width, height
        self.profile = tempfile.mkdtemp(prefix="tq-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Move the child's ends above fd 10 first, so the dup2 onto 3 and 4 cannot clobber them.
        hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)

        def child_fds():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        args = [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--proxy-server=http://127.0.0.1:9",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]
        # close_fds=False: the dup2'ed 3 and 4 must survive into the child (pass_fds would first
        # try to mark the parent's own 3 and 4 inheritable, which fails where they are not open);
        # Python opens every other descriptor non-inheritable, so nothing else leaks.
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=child_fds, close_fds=False)
        for fd in (to_child_r, from_child_w, hi_r, hi_w):
            os.close(fd)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Network", "Log"):
                self.call(f"{domain}.enable", session=True)
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)
        except BaseException as e:
            self.close()                      # never leave a browser or its profile behind
            raise RuntimeError(f"{exe} did not start as a DevTools pipe browser: {e}") from e

    def _read(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._replies[-1] = {"error": {"message": "chromium closed the pipe"}}
                    self._lock.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        self._replies[msg["id"]] = msg
                        self._lock.notify_all()
                else:
                    self._events.put(msg)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout: float | None = None):
        """Send one DevTools command and wait for its reply; ``RuntimeError`` on an error reply."""
        with self._lock:
            self._next_id += 1
            mid = self._next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._lock:
            while mid not in self._replies and -1 not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply to {method} within {timeout or self.timeout:.0f} s")
                self._lock.wait(left)
            reply = self._replies.pop(mid, None) or self._replies[-1]
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def drain(self) -> list[dict]:
        """The events received since the last call (and forget them)."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def wait_event(self, method: str, timeout: float | None = None) -> tuple[dict, list[dict]]:
        """Wait for the next ``method`` event; returns it and every event seen on the way."""
        seen, deadline = [], time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} event within {timeout or self.timeout:.0f} s")
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(ev)
            if ev.get("method") == method:
                return ev, seen

    def evaluate(self, expression: str, timeout: float | None = None):
        """The value of a JavaScript expression in the page (promises awaited)."""
        res = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                             "returnByValue": True}, session=True, timeout=timeout)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails'].get('text')} "
                               f"{res['exceptionDetails'].get('exception', {}).get('description', '')}")
        return res["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Runs in the page once it has loaded: waits for MathJax's first typeset and for every image
# to decode (lazy images are made eager first), then reports what a reader would see.
PAGE_CHECK_JS = r"""
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  await new Promise(r => setTimeout(r, 100));
  const math = [...document.querySelectorAll("span.math, div.math")];
  const typeset = math.filter(m => m.querySelector("mjx-container"));
  const main = document.querySelector("main") || document.body;
  const clone = main.cloneNode(true);
  clone.querySelectorAll("pre, code, script, style, mjx-container, textarea, .highlight")
       .forEach(e => e.remove());
  const text = clone.textContent;
  const raw = [];
  for (const pat of ["\\(", "\\[", "\\begin{", "$$"]) {
    const at = text.indexOf(pat);
    if (at >= 0) raw.push(text.slice(Math.max(0, at - 40), at + 60).replace(/\s+/g, " "));
  }
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);
  const widgets = [];
  for (const cell of document.querySelectorAll("div.cell")) {
    const src = cell.querySelector(".cell_input");
    if (!src || !/\binteract\(/.test(src.textContent)) continue;
    const figs = [...cell.querySelectorAll(".cell_output img")];
    widgets.push({ok: figs.length > 0 && figs.every(i => i.complete && i.naturalWidth > 0),
                  code: src.textContent.trim().slice(0, 80)});
  }
  // what a textbook chapter must have: captions under its figures, objectives, a summary,
  // exercises and their solutions (sphinx-exercise admonitions)
  const outImgs = [...document.querySelectorAll(".cell_output img")];
  const uncaptioned = outImgs.filter(i => { const f = i.closest("figure");
                                            return !(f && f.querySelector("figcaption")); }).length;
  const headings = [...main.querySelectorAll("h2")]   // "9.8. Summary" -> "Summary"
      .map(h => h.textContent.replace(/[#¶]/g, "").trim().replace(/^[\d.]+\s+/, ""));
  const structure = {uncaptioned: uncaptioned, headings: headings,
                     objectives: /In\s+this\s+chapter\s+you\s+will/.test(main.textContent),
                     exercises: main.querySelectorAll("div.exercise").length,
                     solutions: main.querySelectorAll("div.solution").length};
  // what scrolls sideways in the reading column: code (cells and listings) and printed
  // output (a reader at a 1,200-px window would have to scroll to see it); code folded away
  // is not measured. Result tables are HTML tables in the theme's own scrolling container.
  const sideways = [...main.querySelectorAll("pre")]
      .filter(e => e.offsetParent !== null && !e.closest("details:not([open])")
                   && e.scrollWidth > e.clientWidth + 2)
      .map(e => e.textContent.trim().slice(0, 60));
  return {title: document.title, math: math.length, typeset: typeset.length, raw_tex: raw, structure: structure,
          sideways: sideways,
          broken_images: broken, images: imgs.length, widgets: widgets,
          widget_views: document.querySelectorAll(
              'script[type="application/vnd.jupyter.widget-view+json"]').length,
          height: Math.ceil(document.documentElement.scrollHeight)};
})()
"""


def check_page(browser: Chromium, base: str, page: str, shots: Path | None = None,
               max_shot_height: int = 32000) -> dict:
    """Load ``base + page`` and report what it did (see the module docstring)."""
    browser.drain()
    browser.call("Page.navigate", {"url": base + page}, session=True)
    _, events = browser.wait_event("Page.loadEventFired")
    for attempt in range(3):                 # a redirect page (index.html) navigates again
        try:
            report = browser.evaluate(PAGE_CHECK_JS, timeout=browser.timeout)
            break
        except RuntimeError as e:
            gone = ("navigated", "context was destroyed", "Cannot find context")
            if not any(g in str(e) for g in gone) or attempt == 2:
                raise
            _, more = browser.wait_event("Page.loadEventFired")
            events += more
    report["url"] = browser.evaluate("location.href")
    events += browser.drain()
    console, failed, external = [], [], []
    requests = {}
    for ev in events:
        m, p = ev.get("method"), ev.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            console.append(f"uncaught: {d.get('text')} {d.get('exception', {}).get('description', '')}".strip())
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            console.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}".strip())
        elif m == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            requests[p.get("requestId")] = url
            if not url.startswith((base, "data:", "blob:", "about:")):
                external.append(url)
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            failed.append(f"{requests.get(p.get('requestId'), '?')}: {p.get('errorText')}")
        elif m == "Network.responseReceived" and p.get("response", {}).get("status", 200) >= 400:
            failed.append(f"{p['response'].get('url')}: HTTP {p['response']['status']}")
    report.update(page=page, console_errors=console, failed_requests=failed,
                  external_requests=sorted(set(external)))
    if shots is not None:
        # The whole page (up to max_shot_height): grow the viewport to the page, shoot, restore.
        shots.mkdir(parents=True, exist_ok=True)
        h = max(1, min(int(report["height"]), max_shot_height))
        metrics = {"width": browser.width, "deviceScaleFactor": 1, "mobile": False}
        browser.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": h}, session=True)
        browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 100)))")
        shot = browser.call("Page.captureScreenshot", {"format": "png"}, session=True, timeout=120)
        browser.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": browser.height}, session=True)
        path = shots / (page.replace("/", "__").removesuffix(".html") + ".png")
        path.write_bytes(base64.b64decode(shot["data"]))
        report["screenshot"] = str(path)
    return report
