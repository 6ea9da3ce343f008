"""A minimal Chrome DevTools Protocol client for tests: headless Chromium driven over
``--remote-debugging-pipe`` (commands on fd 3, replies on fd 4, each message a JSON text
followed by a NUL byte), standard library only.

    with Browser("/usr/bin/chromium", profile_dir) as browser:
        page = browser.open("file:///.../report.html", width=1280, height=900)
        page.evaluate("document.title")
        page.screenshot(path)            # PNG of the full page
        page.pdf(path)                   # Page.printToPDF (print CSS)
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from dflash_audit.limits import limit_s

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


class CDPError(RuntimeError):
    """A protocol error reply, a browser that exited, or a timeout."""


class Browser:
    """A headless Chromium process and its DevTools pipe."""

    def __init__(self, executable: str, profile_dir: Path, timeout_s: float = 60.0):
        self.timeout_s = limit_s(timeout_s)  # seconds on a quiet machine, scaled with the load
        cmd_r, cmd_w = os.pipe()  # we write commands, the browser reads fd 3
        out_r, out_w = os.pipe()  # the browser writes replies on fd 4
        hi_r, hi_w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, out_w))

        def on_fds_3_and_4():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen(
            [executable, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
             "about:blank"], pass_fds=(3, 4), preexec_fn=on_fds_3_and_4,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (cmd_r, out_w, hi_r, hi_w):
            os.close(fd)
        self._w, self._r = os.fdopen(cmd_w, "wb", buffering=0), os.fdopen(out_r, "rb", 0)
        self._buf, self._next_id, self.events = b"", 0, []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the browser (Browser.close, then terminate if it lingers)."""
        try:
            self.send("Browser.close", timeout_s=limit_s(10))
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(timeout=limit_s(10))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=limit_s(10))

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise CDPError("timed out waiting for the browser")
            chunk = self._r.read(65536)
            if not chunk:
                raise CDPError(f"the browser exited (code {self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float | None = None) -> dict:
        """Send one command and return its ``result`` (events seen meanwhile are kept)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout_s: float | None = None) -> dict:
        """The next event ``method`` of ``session`` (already received ones first)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method and ev.get("sessionId") == session:
                    return self.events.pop(i)["params"]
            self.events.append(self._read_message(deadline))

    def open(self, url: str, width: int, height: int) -> Page:
        """A new page of ``width`` x ``height`` CSS pixels, loaded with ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})
        page.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", session)
        return page


class Page:
    """One attached page (a CDP session)."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression (promises awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise CDPError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Write a PNG of the whole page (beyond the viewport) to ``path``."""
        data = self.send("Page.captureScreenshot", {"format": "png",
                                                    "captureBeyondViewport": True})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def pdf(self, path: Path) -> Path:
        """Print the page to PDF (A4, print CSS) at ``path``."""
        data = self.send("Page.printToPDF", {"paperWidth": 8.27, "paperHeight": 11.69,
                                             "printBackground": True})["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)
