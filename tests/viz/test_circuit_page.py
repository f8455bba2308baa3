"""The circuit page's contents (ra_lens/viz/circuit_page.py), without a browser: self-contained,
its JSON the typed payload, its circuits the scores' circuits at every size, its heads' pattern
and RA those of `reversed_attention` on each pair (computed by the caller and handed over, never
by the view), the model left as found, and `ra-lens circuit --html` writing the same page as the
API.
(tests/viz/test_circuit_page_browser.py opens it in headless Chromium.)"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import PAGE_PAIRS, arch_or_hooked, page_setup, snapshot

from ra_lens import circuits, reversed_attention
from ra_lens.circuits.page import CircuitPage, circuit_page, heads_ra, scores_page
from ra_lens.cli import main
from ra_lens.viz import circuit_page as view


@pytest.fixture(scope="module")
def setup() -> Any:
    return page_setup()


@pytest.fixture(scope="module")
def page(setup: Any) -> CircuitPage:
    s = setup
    return s.scores.to_html(
        curve=s.curve, circuit=s.circuit, faithfulness=s.faithfulness, model=s.model,
        clean=s.clean, metric=s.metric,
    )  # fmt: skip


def payload(html: str) -> dict[str, Any]:
    """The page's JSON block."""
    match = re.search(
        r'<script type="application/json" id="ra-lens-data">(.*?)</script>', html, re.S
    )
    assert match is not None
    return json.loads(match.group(1))


def drawn_sets(data: dict[str, Any]) -> list[set[str]]:
    """Each stop's drawn edges by name, rebuilt from its add/remove lists as the page does."""
    g, e = data["graph"], data["edges"]
    names = [f"{g['writers'][w]}->{g['readers'][r]}" for w, r in zip(e["w"], e["r"])]
    current: set[int] = set()
    out = []
    for stop in data["stops"]:
        current = (current - set(stop["remove"])) | set(stop["add"])
        out.append({names[i] for i in current})
    return out


def test_page_is_self_contained(page: CircuitPage) -> None:
    html = page.html
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "://" not in html, "no URL of any kind: nothing remote, nothing local either"
    assert not re.search(r"<[^>]*\b(src|href)\s*=", html), "no element loads a resource"
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert html.count("<script") == 2  # the JSON block and the inlined script


def test_stops_are_the_scores_circuits_at_every_mib_fraction(setup: Any, page: CircuitPage) -> None:
    data = payload(page.html)
    graph, scores = setup.scores.graph, setup.scores
    sets = drawn_sets(data)
    for ranking, values in (("signed", setup.curve.signed_values), ("abs", setup.curve.abs_values)):
        mib = [s for s in data["stops"] if s["ranking"] == ranking]
        assert [s["fraction"] for s in mib] == list(circuits.MIB_FRACTIONS)
        assert [s["faithfulness"] for s in mib] == pytest.approx(values, abs=1e-3, rel=1e-3)
    for stop, drawn in zip(data["stops"], sets):
        if stop["fraction"] is None:
            expected = setup.circuit
        else:
            expected = scores.top(
                int(stop["fraction"] * graph.n_edges_ungrouped),
                absolute=stop["ranking"] == "abs",
                units="ungrouped",
            )
        assert stop["n_edges"] == expected.n_edges == len(drawn)
        assert drawn == set(expected.edge_names)
        assert stop["n_nodes"] == len(expected.nodes)
    full = set(circuits.Circuit.full(graph).edge_names)
    assert sets[data["walks"]["abs"][-1]] == sets[data["walks"]["signed"][-1]] == full  # 100 %
    # the chosen circuit sits in both walks by its edge count, and the page opens on it
    chosen = data["stops"][data["start"]]
    assert chosen["fraction"] is None and chosen["n_edges"] == setup.circuit.n_edges
    assert chosen["faithfulness"] == pytest.approx(setup.faithfulness, rel=1e-3)
    for walk in data["walks"].values():
        assert data["start"] in walk
        counts = [data["stops"][i]["n_edges"] for i in walk]
        assert counts == sorted(counts)
    # every stored score is the edge's score (4 significant digits)
    e = data["edges"]
    for w, r, value in zip(e["w"], e["r"], e["s"]):
        assert value == pytest.approx(float(scores.scores[w, r]), rel=1e-3, abs=1e-12)


def test_heads_carry_pattern_and_ra_of_each_pair(setup: Any, page: CircuitPage) -> None:
    data = payload(page.html)
    graph = setup.scores.graph
    heads = [w for w in graph.writers if w.startswith("a")]
    assert sorted(data["heads"]) == sorted(heads)  # the largest circuit (100 %) has them all
    assert len(data["pairs"]) == 3
    for i, pair in enumerate(setup.pairs):
        ra = reversed_attention(setup.model, pair.clean, setup.metric[i])
        tokens = ra.str_tokens[0]
        assert data["pairs"][i]["tokens"] == tokens
        n = len(tokens)
        for name in ("a0.h1", f"a{graph.n_layers - 1}.h{graph.n_heads - 1}"):
            w = graph.writer(name)
            stored = data["heads"][name]
            pattern = np.frombuffer(base64.b64decode(stored["pattern"][i]), np.uint8) / 255
            expected = ra.patterns[0, w.layer, w.head].numpy()
            assert np.abs(pattern.reshape(n, n) - expected).max() <= 0.5 / 255 + 1e-6
            scale = stored["scale"][i]
            exact = torch.tril(ra.maps[0, w.layer, w.head]).numpy()
            assert scale == pytest.approx(np.abs(exact).max(), rel=1e-3)
            got = np.frombuffer(base64.b64decode(stored["ra"][i]), np.int8) / 127 * scale
            assert np.abs(got.reshape(n, n) - exact).max() <= scale * (0.5 / 127 + 1e-3)
            assert np.abs(exact).max() > 0


def test_model_is_left_as_found(setup: Any) -> None:
    model = setup.model
    model.train()
    before = snapshot(model)
    try:
        setup.circuit.to_html(model=model, clean=setup.clean, metric=setup.metric, n_pairs=1)
        after = snapshot(model)
    finally:
        model.eval()
    assert before[0] == after[0] is True and before[1] == after[1] and before[3] == after[3]
    assert all(a is None and b is None for a, b in zip(before[2], after[2]))


def test_a_large_circuit_draws_its_largest_scores(setup: Any) -> None:
    scores = setup.scores
    data = payload(scores_page(scores, sizes=[0.5, 1.0], max_drawn=20).html)
    for stop, drawn in zip(data["stops"], drawn_sets(data)):
        circuit = scores.top(
            int(stop["fraction"] * scores.graph.n_edges_ungrouped),
            absolute=stop["ranking"] == "abs",
            units="ungrouped",
        )
        assert stop["n_edges"] == circuit.n_edges
        if stop["ranking"] == "signed" and circuit.n_edges <= 20:  # few edges help: all drawn
            assert drawn == set(circuit.edge_names)
            continue
        assert circuit.n_edges > 20 and len(drawn) == 20
        keys = {
            name: abs(float(scores.scores[scores.graph.edge_index(name)]))
            for name in circuit.edge_names
        }
        smallest_drawn = min(keys[name] for name in drawn)
        assert all(keys[name] <= smallest_drawn for name in set(keys) - drawn)


def test_one_circuit_page(setup: Any) -> None:
    bare = circuits.Circuit.from_edges(setup.scores.graph, setup.circuit.edge_names)
    data = payload(circuit_page(bare, faithfulness=0.25).html)
    assert len(data["stops"]) == 1 and data["stops"][0]["faithfulness"] == 0.25
    assert drawn_sets(data)[0] == set(setup.circuit.edge_names)
    assert data["edges"]["s"] is None and data["node_scores"] is None and data["pairs"] == []
    scored = payload(setup.circuit.to_html().html)
    i = setup.scores.graph.writer_index["a0.h1"]
    expected = float((setup.scores.scores[i] * setup.scores.graph.real[i]).sum())
    assert scored["node_scores"][i] == pytest.approx(expected, rel=1e-3, abs=1e-12)


def test_bad_arguments_are_refused(setup: Any) -> None:
    other = circuits.EdgeScores(setup.scores.graph, setup.scores.scores.flip(0) * setup.scores.graph.real,
                                method="eap", direction="denoise")  # fmt: skip
    with pytest.raises(ValueError, match="pass the curve measured on these scores"):
        other.to_html(curve=setup.curve)
    with pytest.raises(ValueError, match="pass clean= and metric= with model="):
        setup.scores.to_html(model=setup.model)
    with pytest.raises(ValueError, match="fraction of the graph's edges"):
        setup.scores.to_html(sizes=[10])


def test_save_and_notebook_display(page: CircuitPage, tmp_path: Path) -> None:
    written = page.save(tmp_path / "sub" / "page.html")
    assert written.read_text() == page.html
    frame = page._repr_html_()
    assert frame.startswith('<iframe srcdoc="&lt;!DOCTYPE html&gt;') and "</script>" not in frame
    assert repr(page).startswith(f"CircuitPage({page.n_circuits} circuits")


def test_cli_html_is_the_api_page(setup: Any, page: CircuitPage, tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    keys = ("clean", "corrupted", "answer", "wrong")
    pairs.write_text("".join(json.dumps(dict(zip(keys, p))) + "\n" for p in PAGE_PAIRS))
    out = tmp_path / "page.html"
    code = main(["circuit", "--pairs", str(pairs), "--model", f"tiny-{arch_or_hooked('llama')}",
                 "--method", "exact", "--edges", "12", "--html", str(out)])  # fmt: skip
    assert code == 0
    got, expected = payload(out.read_text()), payload(page.html)
    assert got == expected


def test_per_pair_scores_of_the_shown_pairs(setup: Any) -> None:
    s = setup
    graph = s.scores.graph
    per_pair = torch.stack([s.scores.scores * (i + 1) for i in range(3)])  # pair i: (i + 1) x mean
    scores = circuits.EdgeScores(graph, s.scores.scores, "exact", "denoise", per_pair=per_pair)
    data = payload(
        scores_page(scores, model=s.model, clean=s.clean, metric=s.metric, n_pairs=2).html
    )
    assert len(data["pairs"]) == 2 and len(data["per_pair"]) == 2
    e = data["edges"]
    for i, row in enumerate(data["per_pair"]):
        for w, r, value in zip(e["w"], e["r"], row):
            assert value == pytest.approx(
                (i + 1) * float(s.scores.scores[w, r]), rel=1e-3, abs=1e-12
            )


def test_the_json_is_the_typed_payload(page: CircuitPage) -> None:
    """Every key page.js reads is a field of the payload's TypedDicts, and nothing else."""
    data = payload(page.html)

    def keys(typed: Any) -> set[str]:
        return set(typed.__required_keys__)

    assert set(data) == keys(view.PagePayload)
    assert set(data["graph"]) == keys(view.GraphEntry)
    assert set(data["edges"]) == keys(view.EdgesEntry)
    assert all(set(stop) == keys(view.StopEntry) for stop in data["stops"])
    assert set(data["curve"]) == keys(view.CurveEntry)
    assert all(set(c) == keys(view.RankingCurve) for c in data["curve"]["rankings"].values())
    assert all(set(p) == keys(view.PairEntry) for p in data["pairs"])
    assert all(set(h) == keys(view.HeadEntry) for h in data["heads"].values())


def test_ra_handed_over_is_the_ra_computed_for_it(setup: Any) -> None:
    """The page draws the RA it is given: heads_ra's, passed as ra=, gives the page that
    model=, clean=, metric= give; a plain callable metric (not cut to rows) gets every prompt."""
    s = setup
    ra = heads_ra(s.model, s.clean, s.metric, n_pairs=2, graph=s.scores.graph)
    assert ra.keep == "maps" and ra.tokens.shape[0] == 2
    assert ra.tokens.shape[1] == int(ra.lengths.max())  # the two prompts' width, padding cut
    given = payload(scores_page(s.scores, ra=ra, metric=s.metric).html)
    computed = payload(
        scores_page(s.scores, model=s.model, clean=s.clean, metric=s.metric, n_pairs=2).html
    )
    assert given == computed and len(given["pairs"]) == 2
    assert given["metric"] == "M = logit(answer) - logit(wrong)"

    def plain(logits: torch.Tensor) -> torch.Tensor:
        return s.metric(logits)

    assert heads_ra(s.model, s.clean, plain, n_pairs=1).tokens.shape[0] == len(s.pairs)


def test_the_view_refuses_ra_it_cannot_show(setup: Any) -> None:
    s = setup
    stops = [view.PageStop(s.circuit, "the circuit")]
    norms = reversed_attention(s.model, s.clean, s.metric, keep="norms")
    with pytest.raises(ValueError, match='keep="maps"'):
        view.render_page(stops, ra=norms)
    other = reversed_attention(s.model, s.clean, s.metric, keep="maps", convention="pattern")
    with pytest.raises(ValueError, match='convention="qk"'):
        view.render_page(stops, ra=other)
    some = reversed_attention(s.model, s.clean, s.metric, keep="maps", layers=[0])
    everything = [view.PageStop(s.scores.top(s.scores.graph.count()), "every edge")]
    assert any(n.startswith("a1.") for n in everything[0].circuit.nodes)  # a head of layer 1
    with pytest.raises(ValueError, match="compute RA on the circuit's model, all layers"):
        view.render_page(everything, ra=some)
    with pytest.raises(ValueError, match="pass ra= or model= with clean= and metric=, not both"):
        scores_page(s.scores, ra=norms, model=s.model)
    with pytest.raises(ValueError, match="stops is empty"):
        view.render_page([])
    with pytest.raises(ValueError, match="start=1: pass the index of one of the 1 stops"):
        view.render_page(stops, start=1)
