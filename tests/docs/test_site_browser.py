"""The built site in a real browser: Debian's headless Chromium (selenium + chromium-driver, as
the circuit page's browser tests drive it). The site is served from this machine
(127.0.0.1: the search index is fetched by a web worker, which a file:// page may not start) and
the home page, a concept page, an API page and a notebook page must render with no console error
and no request to anywhere but that server; the offline search must find an API name.

Skipped, with the reason, where selenium, chromium, chromedriver or mkdocs is missing."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from browser import browser_missing, console_errors, headless_chromium, requests
from docs_site import build_site, mkdocs_missing

_MISSING = browser_missing() or mkdocs_missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=f"cannot open the site: {_MISSING}"),
    pytest.mark.slow,  # builds the whole site and drives a browser
]

PAGES = {
    "home": ("index.html", "Reversed Attention for TransformerLens"),
    "concept": ("concepts/patching.html", "Attention patching"),
    "api": ("api/ra_lens.html", "reversed_attention"),
    "notebook": ("notebooks/01_quickstart.html", "Reversed Attention maps for one prompt"),
}


#: Every path the local server was asked for (requests from the search's web worker do not
#: appear in the page's DevTools log, so the server's own record shows where the index came from).
SERVED: list[str] = []


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # no access log on stderr
        pass

    def do_GET(self) -> None:
        SERVED.append(self.path)
        super().do_GET()


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built once and served on 127.0.0.1 (a free port) for the module."""
    site = build_site(tmp_path_factory.mktemp("site"))
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    # offline=False: DevTools' offline mode would cut 127.0.0.1 too; every request is checked
    # against the local origin instead, so none may leave the machine.
    with headless_chromium(offline=False) as d:
        yield d


def _open(driver: Any, url: str) -> list[str]:
    """Open `url`, wait for the page to load, and return every URL it requested."""
    driver.get("about:blank")
    driver.get_log("performance")
    driver.get_log("browser")
    driver.get(url)
    driver.execute_script("return document.readyState")
    return [asked for asked, _ in requests(driver)]


def _outside(urls: list[str], origin: str) -> list[str]:
    return [u for u in urls if not u.startswith((origin, "data:", "blob:", "about:"))]


@pytest.mark.parametrize("kind", list(PAGES))
def test_page_renders_offline_without_errors(driver: Any, origin: str, kind: str) -> None:
    path, text = PAGES[kind]
    asked = _open(driver, origin + path)
    assert asked[0] == origin + path
    assert _outside(asked, origin) == [], f"{path} asked beyond this machine"
    assert console_errors(driver) == []
    assert text in driver.find_element("css selector", "article").text
    # Material's own script ran (it marks the document), and the page's stylesheet applied
    assert driver.execute_script("return document.documentElement.classList.contains('js')")
    if kind == "notebook":  # rendered with its executed outputs: a figure and printed text
        assert driver.find_elements("css selector", ".jp-OutputArea-output img")
        assert driver.find_elements("css selector", ".jp-OutputArea-output pre")


def test_search_finds_an_api_name_offline(driver: Any, origin: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    _open(driver, origin + "index.html")
    box = driver.find_element("css selector", "input.md-search__input")
    box.click()  # the search box in the header (a 1400-pixel window shows it)
    box.send_keys("attention_patch_hooks")
    WebDriverWait(driver, 30).until(
        lambda d: d.find_elements("css selector", ".md-search-result__item")
    )
    hits = driver.find_elements("css selector", ".md-search-result__item a")
    assert any("api/ra_lens.html" in (h.get_attribute("href") or "") for h in hits)
    assert _outside([asked for asked, _ in requests(driver)], origin) == []
    assert any(path.endswith("search/search_index.json") for path in SERVED)
    assert console_errors(driver) == []
