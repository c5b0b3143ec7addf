"""A real browser for tests: Debian's chromium-headless-shell (`make tools` installs it), driven over the
Chrome DevTools Protocol with aiohttp's websocket client, on loopback only. It opens a page as a user
would (the Ray dashboard's token as the cookie its login form sets), waits until the page shows what it
must, and saves a screenshot."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

CHROMIUM = "chromium-headless-shell"
# The cookie the dashboard's login form sets (ray/_private/authentication/authentication_constants.py).
RAY_TOKEN_COOKIE = "ray-authentication-token"


class Browser:
    """One headless Chromium and its DevTools websocket. Calls are answered in order; events are dropped."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.calls = 0

    async def call(self, method: str, session: str | None = None, **params) -> dict:
        self.calls += 1
        message = {"id": self.calls, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        await self.ws.send_json(message)
        while True:
            reply = await self.ws.receive_json()
            if reply.get("id") == self.calls:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})

    async def show(
        self,
        url: str,
        expect: list[str],
        screenshot: Path,
        cookies: dict[str, str] | None = None,
        timeout_s: float = 120,
        size: tuple[int, int] = (1400, 900),
        fields: dict[str, str] | None = None,
    ) -> str:
        """Open `url` in a new tab, wait until its text holds every string of `expect`, save a PNG of it to
        `screenshot`; returns the page's text. Fails with the text it saw when `expect` never all showed.
        `fields`: text fields to fill in as a user would, by their label (the dashboard's "Page Size")."""
        target = (await self.call("Target.createTarget", url="about:blank"))["targetId"]
        session = (await self.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
        for name, value in (cookies or {}).items():
            await self.call("Network.setCookie", session, name=name, value=value, url=url)
        width, height = size
        await self.call(
            "Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
            mobile=False,
        )  # fmt: skip
        await self.call("Page.navigate", session, url=url)
        loop = asyncio.get_running_loop()
        deadline, text, unfilled = loop.time() + timeout_s, "", dict(fields or {})
        while unfilled or not all(e in text for e in expect):
            assert loop.time() < deadline, (
                f"{url} never showed {[e for e in expect if e not in text]} (unfilled: {unfilled}):\n{text}"
            )
            await asyncio.sleep(1)
            for label, value in list(unfilled.items()):
                filled = await self.call("Runtime.evaluate", session, expression=_FILL % (json.dumps(label),
                                         json.dumps(value)), returnByValue=True)  # fmt: skip
                if filled["result"].get("value"):
                    del unfilled[label]
            evaluated = await self.call(
                "Runtime.evaluate", session, expression="document.body ? document.body.innerText : ''",
                returnByValue=True,
            )  # fmt: skip
            text = evaluated["result"].get("value", "")
        await asyncio.sleep(1)  # the last rows' layout
        shot = await self.call("Page.captureScreenshot", session, format="png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        await self.call("Target.closeTarget", targetId=target)
        return text


# Types `value` into the input labelled `label` as React sees typing: through the input's own value setter,
# then an input event (a plain assignment is overwritten by React's state at the next render).
_FILL = """((label, value) => {
  const found = [...document.querySelectorAll('label')].find(l => l.textContent.trim() === label);
  const input = found && document.getElementById(found.htmlFor);
  if (!input) return false;
  Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(input, value);
  input.dispatchEvent(new Event('input', {bubbles: true}));
  return true;
})(%s, %s)"""


@contextlib.asynccontextmanager
async def browser(work: Path) -> AsyncIterator[Browser]:
    """A headless Chromium with its profile under `work`, stopped (by pid) on the way out."""
    binary = shutil.which(CHROMIUM)
    assert binary, f"{CHROMIUM} is missing: `make tools` installs Debian's chromium-headless-shell"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "chromium.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            # --no-sandbox: Chromium's sandbox refuses to run as root, which tests here are.
            [binary, "--no-sandbox", "--disable-gpu", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={work / 'profile'}", "about:blank"],
            # Its own process group: Debian's launcher is a shell script that does not exec the browser.
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        endpoint = None
        for _ in range(120):
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            if found := re.search(r"DevTools listening on (ws://\S+)", log.read_text(errors="replace")):
                endpoint = found.group(1)
                break
            await asyncio.sleep(0.5)
        assert endpoint, f"Chromium printed no DevTools endpoint:\n{log.read_text(errors='replace')[-3000:]}"
        async with aiohttp.ClientSession() as http, http.ws_connect(endpoint, max_msg_size=0) as ws:
            yield Browser(ws)
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the browser's process group (the launcher, the browser and its helpers), then SIGKILL what
    is left of it after 15 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        process.poll()  # reaps the launcher: a zombie still counts as a member of the group
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
