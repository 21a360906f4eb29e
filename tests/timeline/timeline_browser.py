"""Headless Debian chromium driven over the Chrome DevTools Protocol (websocket-client), for
the timeline page's browser tests. `ensure_chromium()` installs chromium with apt-get when it
is missing and we are root (what CI does; tests/timeline/setup_browser_tests.sh does the same
by hand); otherwise it returns None and the reason, and the tests skip with it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio"]


def find_chromium() -> Optional[str]:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def ensure_chromium() -> tuple[Optional[str], str]:
    """(path, "") when chromium is (or now is) installed, else (None, why not)."""
    path = find_chromium()
    if path:
        return path, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "chromium is missing and cannot be installed here (not root, or no apt)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return None, "apt-get install chromium failed: " + done.stderr[-300:]
    path = find_chromium()
    return (path, "") if path else (None, "chromium installed but not found on PATH")


class Browser:
    """One headless chromium with one page; every console message and uncaught exception
    lands in `console` / `exceptions`."""

    def __init__(self, executable: str, width: int = 1400, height: int = 900) -> None:
        import websocket  # websocket-client (dev extra)

        self.profile = tempfile.mkdtemp(prefix="tw-chromium-")
        self.proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._port()
        target = self._page_target(port)
        self.ws = websocket.create_connection(target, timeout=60, suppress_origin=True)
        self._id = 0
        self.console: list[dict] = []
        self.exceptions: list[dict] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def _port(self, timeout: float = 30) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    @staticmethod
    def _page_target(port: int) -> str:
        for _ in range(100):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise RuntimeError("chromium has no page target")

    def send(self, method: str, params: Optional[dict] = None, timeout: float = 60) -> dict:
        self._id += 1
        my_id = self._id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)
        raise TimeoutError(method)

    def _event(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled":
            self.console.append({"type": params.get("type"), "text": " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", []))})
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append({"type": entry.get("level"), "text": entry.get("text", "")})
        elif method == "Runtime.exceptionThrown":
            self.exceptions.append(params.get("exceptionDetails", {}))
        elif method == "Page.loadEventFired":
            self._loaded = True

    def open(self, url: str, timeout: float = 60) -> float:
        """Navigate and wait for the load event; returns the seconds it took."""
        self._loaded = False
        started = time.monotonic()
        self.send("Page.navigate", {"url": url})
        while not self._loaded:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{url} did not load in {timeout}s")
            self._event(json.loads(self.ws.recv()))
        return time.monotonic() - started

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def mouse_move(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions so far."""
        found = [m["text"] for m in self.console if m["type"] in ("error", "assert")]
        return found + [str(e.get("exception", {}).get("description") or e.get("text"))
                        for e in self.exceptions]

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
