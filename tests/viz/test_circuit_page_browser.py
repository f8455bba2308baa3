"""The circuit page in a real browser: Debian's headless Chromium, driven by selenium through
chromium-driver, with the network switched off. One page and one browser for the module.

Skipped, with the reason, where selenium, chromium or chromedriver is missing (`.ci/run` installs
them). First paint is measured by benchmarks/bench_circuit_page.py, never timed here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from browser import (
    browser_missing,
    console_errors,
    headless_chromium,
    open_page,
    requests,
)
from helpers import page_setup

from ra_lens import reversed_attention

_MISSING = browser_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"no headless browser: {_MISSING}")


@pytest.fixture(scope="module")
def setup() -> Any:
    return page_setup()


@pytest.fixture(scope="module")
def browser(setup: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The page written to a file and open in headless Chromium (network off); yields
    (driver, the page's file URL, the URLs requested while it loaded)."""
    s = setup
    path = tmp_path_factory.mktemp("page") / "circuit.html"
    s.scores.to_html(
        path, curve=s.curve, circuit=s.circuit, faithfulness=s.faithfulness, model=s.model,
        clean=s.clean, metric=s.metric,
    )  # fmt: skip
    with headless_chromium() as driver:
        url = open_page(driver, path)
        driver.execute_script("return window.raLens.stops")  # the script ran to its end
        yield driver, url, requests(driver)


def _drawn(driver: Any) -> int:
    """Distinct edges drawn (a key/value edge of a grouped-query model draws one path per query
    head of its group)."""
    return driver.execute_script(
        "return new Set(Array.from(document.querySelectorAll('#graph-svg path.edge'),"
        " p => p.dataset.e)).size"
    )


def _click_node(driver: Any, name: str) -> None:
    node = driver.find_element("css selector", f'#graph-svg g.node[data-name="{name}"]')
    driver.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", node)
    node.click()  # a real mouse click, at the node's place on the screen


def test_loads_offline_without_errors_or_requests(browser: Any) -> None:
    driver, url, logged = browser
    ours = [asked for asked, document in logged if document == url]
    assert ours == [url], f"the page asked for more than itself: {ours}"
    # nor did anything else in the browser reach out while it was open
    assert not [
        asked for asked, _ in logged if asked.split(":")[0] in ("http", "https", "ws", "wss")
    ]
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert console_errors(driver) == []
    assert driver.execute_script("return typeof window.raLensFirstPaint") == "number"


def test_head_nodes_and_size_control_are_in_the_dom(setup: Any, browser: Any) -> None:
    driver = browser[0]
    graph = setup.scores.graph
    names = driver.execute_script(
        "return Array.from(document.querySelectorAll('#graph-svg g.node'), g => g.dataset.name)"
    )
    assert names == graph.writers + ["logits"]
    shown = driver.execute_script(
        "return Array.from(document.querySelectorAll('#graph-svg g.node.on'), g => g.dataset.name)"
    )
    assert shown == setup.circuit.nodes  # the page opens on the chosen circuit
    size = driver.find_element("id", "size")
    assert size.get_attribute("type") == "range" and int(size.get_attribute("max")) == 10


def test_drawn_edges_follow_the_size_control(setup: Any, browser: Any) -> None:
    driver = browser[0]
    scores, graph = setup.scores, setup.scores.graph
    expected = [
        scores.top(int(k * graph.n_edges_ungrouped), units="ungrouped").n_edges
        for k in setup.curve.sizes
    ]
    start = sum(n <= setup.circuit.n_edges for n in expected)
    expected.insert(start, setup.circuit.n_edges)
    assert int(driver.find_element("id", "size").get_attribute("value")) == start
    seen = []
    for i in range(len(expected)):
        driver.execute_script(
            "const s = document.getElementById('size'); s.value = arguments[0];"
            "s.dispatchEvent(new Event('input'))",
            i,
        )
        shown = int(driver.find_element("id", "count-edges").text.replace(",", ""))
        current = driver.find_elements("css selector", "#curve circle.current")
        seen.append((_drawn(driver), shown, len(current)))
    assert seen == [(n, n, 1) for n in expected]
    assert expected[-1] == graph.n_edges and console_errors(driver) == []


def test_clicking_a_head_shows_its_pattern_and_ra_on_the_chosen_pair(
    setup: Any, browser: Any
) -> None:
    driver = browser[0]
    graph = setup.scores.graph
    data = driver.execute_script(
        "return JSON.parse(document.getElementById('ra-lens-data').textContent)"
    )
    driver.execute_script("window.raLens.setStop(arguments[0])", data["walks"]["abs"][-1])  # 100 %
    name = f"a{graph.n_layers - 1}.h1"
    layer, head = graph.n_layers - 1, 1
    pair = 2
    driver.execute_script(
        "const p = document.getElementById('pair'); p.value = arguments[0];"
        "p.dispatchEvent(new Event('change'))",
        pair,
    )
    _click_node(driver, name)
    details = driver.find_element("id", "details")
    assert details.find_element("tag name", "h3").text.startswith(name)
    ra = reversed_attention(setup.model, setup.pairs[pair].clean, setup.metric[pair])
    n = int(ra.lengths[0])
    for cls, exact, tolerance in (
        ("pattern", ra.patterns[0, layer, head], 0.5 / 255),
        ("ra", torch.tril(ra.maps[0, layer, head]), 0.5 / 127 * float(ra.maps[0, layer, head].abs().max())),
    ):  # fmt: skip
        cells = driver.execute_script(
            f"return Array.from(document.querySelectorAll('#details svg.heat.{cls} rect[data-v]'),"
            " r => [+r.dataset.q, +r.dataset.k, +r.dataset.v])"
        )
        assert len(cells) == n * (n + 1) // 2  # the causal triangle of the pair's tokens
        worst = max(abs(v - float(exact[q, k])) for q, k, v in cells)
        assert worst <= tolerance * 1.01 + 1e-3 * float(exact.abs().max())
    assert float(ra.maps[0, layer, head].abs().max()) > 0
    # the node score, and the q/k edges into it, are the circuit's
    score = float(driver.find_element("id", "node-score").text)
    i = graph.writer_index[name]
    expected = float((setup.scores.scores[i] * graph.real[i]).sum())
    assert score == pytest.approx(expected, rel=2e-3, abs=1e-4)
    rows = details.find_elements("css selector", "table.edges tr[data-e]")
    names = [r.find_element("tag name", "td").text for r in rows]
    assert any(f"->{name}<q>" in e for e in names)
    assert console_errors(driver) == []


def test_search_and_edge_click(setup: Any, browser: Any) -> None:
    driver = browser[0]
    box = driver.find_element("id", "search")
    box.clear()
    box.send_keys("m0\n")
    assert driver.find_element("css selector", "#details h3").text.startswith("m0")
    box.clear()
    box.send_keys("a99.h0\n")
    assert "no node named" in driver.find_element("id", "status").text
    row = driver.find_element("css selector", "#details table.edges tr[data-e]")
    edge = row.find_element("tag name", "td").text
    row.click()
    assert driver.find_element("css selector", "#details h3").text == edge
    score = float(driver.find_element("id", "edge-score").text)
    expected = float(setup.scores.scores[setup.scores.graph.edge_index(edge)])
    assert score == pytest.approx(expected, rel=2e-3, abs=1e-4)
    assert len(driver.find_elements("css selector", "#graph-svg path.edge.sel")) >= 1


def test_svg_export_is_the_drawn_graph(browser: Any, tmp_path: Path) -> None:
    driver = browser[0]
    text = driver.execute_script("return window.raLens.svgText()")
    assert text.startswith("<svg") and "xmlns=" in text
    assert text.count("<path") == driver.execute_script(
        "return document.querySelectorAll('#graph-svg path').length"
    )
    path = tmp_path / "view.svg"
    path.write_text(text)
    import xml.etree.ElementTree as ET

    assert ET.parse(path).getroot().tag.endswith("svg")  # well-formed XML
    # PNG through a canvas: the picture's type, size (twice the drawing's) and PNG signature
    png = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "window.raLens.pngBlob(2).then(async b => done([b.type,"
        " Array.from(new Uint8Array(await b.arrayBuffer()))]), e => done(String(e)))"
    )
    kind, data = png
    assert kind == "image/png" and bytes(data[:8]) == b"\x89PNG\r\n\x1a\n"
    width, height = (
        int.from_bytes(bytes(data[16:20]), "big"),
        int.from_bytes(bytes(data[20:24]), "big"),
    )
    svg = ET.parse(path).getroot()
    assert (width, height) == (
        round(2 * float(svg.get("width"))),
        round(2 * float(svg.get("height"))),
    )
    assert console_errors(driver) == []


def test_both_curves_are_drawn_labelled_by_ranking_with_their_own_area(
    setup: Any, browser: Any
) -> None:
    driver, curve = browser[0], setup.curve
    legend = driver.find_element("css selector", "#curve .curve-legend").text
    assert f"signed score: CPR {curve.cpr:.3f}" in legend
    assert f"|score|: CMD {curve.cmd:.3f}" in legend
    heading = driver.find_element("css selector", "#curve-box h2").text
    assert "CPR" not in heading and "CMD" not in heading  # no one title over two curves
    for ranking, values, area in (
        ("signed", curve.signed_values, curve.cpr),
        ("abs", curve.abs_values, curve.cmd),
    ):
        line = driver.find_element("css selector", f"#curve polyline.curve.{ranking}")
        assert len(line.get_attribute("points").split()) == len(values)
        assert float(line.get_attribute("data-area")) == pytest.approx(area, rel=1e-3)
        titles = driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0]), c => c.textContent)",
            f"#curve circle.pt.{ranking}",
        )
        shown = [float(t.rsplit("faithfulness ", 1)[1]) for t in titles]
        assert sorted(shown) == pytest.approx(sorted(values), abs=1e-3)
    assert console_errors(driver) == []


def _set(driver: Any, element: str, value: Any, event: str) -> None:
    driver.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
        "s.dispatchEvent(new Event(arguments[2]))",
        element,
        value,
        event,
    )


def test_the_ranking_control_chooses_the_circuits_the_size_control_walks(
    setup: Any, browser: Any
) -> None:
    driver = browser[0]
    scores, graph = setup.scores, setup.scores.graph
    _set(driver, "ranking", "signed", "change")
    expected = [
        scores.top(int(k * graph.n_edges_ungrouped), absolute=False, units="ungrouped").n_edges
        for k in setup.curve.sizes
    ]
    expected.insert(sum(n <= setup.circuit.n_edges for n in expected), setup.circuit.n_edges)
    assert int(driver.find_element("id", "size").get_attribute("max")) == len(expected) - 1
    seen = []
    for i in range(len(expected)):
        _set(driver, "size", i, "input")
        seen.append(int(driver.find_element("id", "count-edges").text.replace(",", "")))
    assert seen == expected
    assert "walks the signed score ranking" in driver.find_element("id", "curve").text
    _set(driver, "ranking", "abs", "change")
    assert driver.execute_script("return window.raLens.current().walk") == "abs"
    assert console_errors(driver) == []


def test_the_smallest_circuit_box(setup: Any, browser: Any) -> None:
    driver, curve = browser[0], setup.curve
    points = list(zip(curve.signed_n_edges, curve.signed_values))
    points += list(zip(curve.abs_n_edges, curve.abs_values))
    points.append((setup.circuit.count("ungrouped"), setup.faithfulness))
    assert driver.find_element("id", "target").get_attribute("value") == "0.8"
    data = driver.execute_script(
        "return JSON.parse(document.getElementById('ra-lens-data').textContent)"
    )
    for target in (0.8, 1.0, max(v for _, v in points)):
        _set(driver, "target", target, "input")
        fewest = min(n for n, v in points if v >= target)
        label = driver.find_element("id", "smallest-label").text
        matches = [
            i for i, s in enumerate(data["stops"])
            if s["label"] == label and s["n_units"] == fewest
        ]  # fmt: skip
        assert matches, (label, fewest)
        driver.find_element("id", "open-smallest").click()
        opened = driver.execute_script("return window.raLens.current().stop")
        assert data["stops"][opened]["n_units"] == fewest
        assert (
            int(driver.find_element("id", "count-edges").text.replace(",", ""))
            == (data["stops"][opened]["n_edges"])
        )
    _set(driver, "target", max(v for _, v in points) + 0.5, "input")
    text = driver.find_element("id", "smallest").text
    assert text.startswith("none of the") and "highest measured faithfulness" in text
    assert not driver.find_element("id", "open-smallest").is_displayed()
    note = driver.find_element("id", "grouped-note")
    if setup.scores.graph.n_kv_heads < setup.scores.graph.n_heads:
        assert note.is_displayed() and "named by key/value head" in note.text
    else:
        assert not note.is_displayed()
    assert console_errors(driver) == []


def test_grouped_readers_are_explained(tmp_path: Path) -> None:
    from ra_lens import circuits

    g = circuits.Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8)
    values = torch.linspace(-1, 1, g.real.numel()).view_as(g.real) * g.real
    scores = circuits.EdgeScores(g, values, method="eap", direction="denoise")
    path = tmp_path / "grouped.html"
    scores.to_html(path)
    with headless_chromium() as driver:
        open_page(driver, path)
        note = driver.find_element("id", "grouped-note")
        assert note.is_displayed()
        assert "a1.h0<v> is the value of key/value head 0 of layer 1" in note.text
        assert "read by query heads 0-1" in note.text
        # no curve: the box says so instead of naming a circuit
        assert "no faithfulness is measured" in driver.find_element("id", "smallest").text
        edge = g.readers.index("a1.h1<v>")
        e = driver.execute_script(
            "const D = JSON.parse(document.getElementById('ra-lens-data').textContent);"
            "return D.edges.r.indexOf(arguments[0])",
            edge,
        )
        driver.execute_script(
            "document.querySelector(`#graph-svg path.edge[data-e='${arguments[0]}']`)"
            ".dispatchEvent(new MouseEvent('click', {bubbles: true}))",
            e,
        )
        assert "value of key/value head 1 of layer 1, shared by query heads 2-3" in (
            driver.find_element("css selector", "#details .kv-note").text
        )
        assert console_errors(driver) == []
