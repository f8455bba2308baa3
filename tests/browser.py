"""Headless Chromium for the circuit page's browser tests, its first-paint benchmark and the README
screenshot: Debian's `chromium` driven through `chromium-driver` by selenium (`pip install
selenium`; `apt-get install chromium chromium-driver`).

The browser starts with a fresh profile and without the background services that would reach
the network on their own (updates, sync, QUIC probes), so any request logged while a page is open
comes from the page. `browser_missing()` says why no browser can start (tests skip with it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Flags that work headless, as root, without a GPU and without background network traffic.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _paths() -> tuple[str | None, str | None]:
    browser = next((p for p in map(shutil.which, _BROWSERS) if p), None)
    return browser, shutil.which("chromedriver")


def browser_missing() -> str | None:
    """Why headless Chromium cannot be driven here, or None when it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium, part of the dev extra)"
    browser, driver = _paths()
    if browser is None:
        return "no chromium browser on PATH (apt-get install chromium)"
    if driver is None:
        return "no chromedriver on PATH (apt-get install chromium-driver)"
    return None


@contextlib.contextmanager
def headless_chromium(
    width: int = 1400, height: int = 900, *, offline: bool = True
) -> Iterator[Any]:
    """A selenium Chrome driver on headless Chromium, window `width` x `height` pixels, console
    and network events logged (`requests`, `console_errors`); with `offline` the network is
    switched off through the DevTools protocol, as a user without one would open the page.
    Quit (and its profile folder removed) on leaving the block."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    reason = browser_missing()
    if reason is not None:
        raise RuntimeError(reason)
    browser, driver_path = _paths()
    profile = tempfile.mkdtemp(prefix="ra_lens_chromium_")
    options = webdriver.ChromeOptions()
    options.binary_location = str(browser)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    # Both paths given: selenium never looks for (or downloads) a driver of its own.
    driver = webdriver.Chrome(options=options, service=Service(str(driver_path)))
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        if offline:
            driver.execute_cdp_cmd(
                "Network.emulateNetworkConditions",
                {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
            )
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver: Any, path: str | Path) -> str:
    """Open a local page; the logs are emptied first, so `requests` and `console_errors` after it
    see only this page. Returns its file URL."""
    driver.get("about:blank")  # leave the start page, whose own loads would fill the log
    driver.get_log("performance")
    driver.get_log("browser")
    url = Path(path).resolve().as_uri()
    driver.get(url)
    return url


def requests(driver: Any) -> list[tuple[str, str]]:
    """(URL, URL of the document that asked) of every request since the last call (DevTools
    `Network.requestWillBeSent`), in order."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            params = message["params"]
            urls.append((params["request"]["url"], params.get("documentURL", "")))
    return urls


def console_errors(driver: Any) -> list[str]:
    """Console messages of level SEVERE (errors, uncaught exceptions) since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
