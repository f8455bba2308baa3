"""`ra-lens circuit` on a tiny offline model: the files it writes agree with the circuits API, and
bad input is one line on stderr with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import arch_or_hooked

from ra_lens import circuits
from ra_lens.cli import main
from ra_lens.tasks.ioi import PromptPair, paired_batch
from ra_lens.toy_models import tiny_model

ARCH = arch_or_hooked("gpt2")
#: Pairs the tiny tokenizer takes: one-token answers, clean and corrupted of equal length.
PAIRS = [
    PromptPair("I like Italy", "I like Paris", " and", " the"),
    PromptPair("I like Paris", "I like Italy", " the", " and"),
    PromptPair("The capital of Italy is", "The capital of Paris is", " the", " and"),
]
SIZES = [0.05, 0.2, 1.0]


def _write_pairs(path: Path, pairs: list[PromptPair]) -> Path:
    rows = [{"clean": p.clean, "corrupted": p.corrupted, "answer": p.answer, "wrong": p.wrong}
            for p in pairs]  # fmt: skip
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("circuit")
    pairs = _write_pairs(folder / "pairs.jsonl", PAIRS)
    out = folder / "out"
    code = main(
        ["circuit", "--pairs", str(pairs), "--model", f"tiny-{ARCH}", "--method", "exact",
         "--sizes", ",".join(map(str, SIZES)), "--edges", "12", "--out", str(out),
         "--json", str(out / "circuit_run.json")]
    )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "circuit_run.json").read_text())


def test_curve_and_circuit_match_the_api(run: tuple[Path, dict]) -> None:
    out, report = run
    model = tiny_model(ARCH)
    clean, corrupted, metric = paired_batch(model, PAIRS)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric, sizes=SIZES)
    for key in ("signed_n_edges", "abs_n_edges", "n_total", "units", "baseline"):
        assert report["curve"][key] == getattr(curve, key), key
    assert report["curve"]["signed_values"] == pytest.approx(curve.signed_values, abs=1e-6)
    assert report["curve"]["abs_values"] == pytest.approx(curve.abs_values, abs=1e-6)
    assert report["curve"]["cpr"] == pytest.approx(curve.cpr, abs=1e-6)
    assert report["curve"]["cmd"] == pytest.approx(curve.cmd, abs=1e-6)
    assert report["curve"]["abs_values"][-1] == pytest.approx(1.0, abs=1e-5)  # the full graph
    assert report["curve"]["units"] == "ungrouped" and report["curve"]["ablation"] == "patching"
    assert report["faithfulness_baseline"] == kept_baseline()
    assert report["empty_metric"] == pytest.approx(report["corrupted_metric"], abs=1e-5)
    expected = scores.top(12)
    saved = circuits.Circuit.from_json(out / "circuit.json", model)
    assert saved.edge_names == expected.edge_names and saved.n_edges == report["circuit"]["n_edges"]
    kept = circuits.faithfulness(model, expected, clean, corrupted, metric)
    assert report["circuit"]["faithfulness"] == pytest.approx(kept.value, abs=1e-6)
    assert report["clean_metric"] == pytest.approx(kept.clean_metric, abs=1e-6)
    assert report["n_edges_total"] == scores.graph.n_edges and len(report["pairs"]) == 3
    assert report["n_edges_ungrouped"] == scores.graph.n_edges_ungrouped


def kept_baseline() -> str:
    from ra_lens.circuits.faithfulness import BASELINE

    return BASELINE


def test_batch_size_reaches_every_pass_and_mib_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--batch-size 2 on 3 pairs: every forward pass of the run (scoring, the faithfulness curve,
    the saved circuit) sees at most 2 prompts, counted by a hook on the first block; --mib writes
    the MIB folder, whose scores read back as the API's."""
    import ra_lens.cli.circuit as cli_circuit

    seen: list[int] = []
    model = tiny_model(ARCH)
    # (shape[1] > 3: not ra-lens's one-prompt, 3-token liveness probe of hook_pattern)
    model.blocks[0].register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[0]) if args[0].shape[1] > 3 else None
    )
    monkeypatch.setattr(cli_circuit, "load_model_of", lambda args: model)
    pairs = _write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code = main(
        ["circuit", "--pairs", str(pairs), "--model", f"tiny-{ARCH}", "--method", "eap",
         "--sizes", "0.1,1", "--batch-size", "2", "--mib", str(tmp_path / "mib"),
         "--json", str(tmp_path / "run.json")]
    )  # fmt: skip
    assert code == 0
    # each pass over 3 pairs in batches of 2 is a batch of 2 then 1; 32 would have given 3
    assert seen and max(seen) == 2 and seen.count(2) == seen.count(1)
    report = json.loads((tmp_path / "run.json").read_text())
    names = sorted(Path(f).relative_to(tmp_path / "mib").as_posix() for f in report["files"])
    assert names[-1] == "importances.json" and len(names) == 10
    clean, corrupted, metric = paired_batch(model, PAIRS)
    scores = circuits.attribute(model, clean, corrupted, metric, method="eap")
    back = circuits.Circuit.from_json(tmp_path / "mib" / "importances.json", model)
    assert torch.allclose(back.scores, scores.scores.double(), atol=1e-6)


def test_pictures_are_written(run: tuple[Path, dict]) -> None:
    out, report = run
    for name in ("faithfulness_curve.png", "circuit.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and (out / name).stat().st_size > 5000
    assert sorted(Path(f).name for f in report["files"]) == [
        "circuit.json", "circuit.png", "faithfulness_curve.png"
    ]  # fmt: skip


def _assert_one_line(err: str, message: str) -> None:
    """The error is the last line of stderr, whole (loading a model may print progress before)."""
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("ra-lens circuit: error: ") and message in last, err
    assert err.count("ra-lens circuit: error:") == 1, err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["{not json"], "line 1: not JSON"),
        (['{"clean": "I like Italy", "corrupted": "I like Paris", "answer": " and"}'],
         "line 1: expected an object with exactly the keys"),
        (['{"clean": "I like Italy", "corrupted": "I like the Paris", "answer": " and", '
          '"wrong": " the"}'], "pair 1: answer and wrong must be one token"),
        ([], "no pairs in the file"),
    ],
)  # fmt: skip
def test_bad_pairs_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, lines: list[str], message: str
) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines))
    code = main(["circuit", "--pairs", str(path), "--model", f"tiny-{ARCH}"])
    assert code == 2
    _assert_one_line(capsys.readouterr().err, message)


def test_other_user_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pairs = _write_pairs(tmp_path / "pairs.jsonl", PAIRS[:1])
    same = _write_pairs(tmp_path / "same.jsonl", [PromptPair("I like Italy", "I like Paris", " and", " and")])  # fmt: skip
    (tmp_path / "latin1.jsonl").write_bytes(b'{"clean": "caf\xe9"}\n')
    cases = [
        (["--pairs", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--pairs", str(tmp_path)], f"--pairs {tmp_path} is a folder: give a JSONL file"),
        (
            ["--pairs", str(tmp_path / "latin1.jsonl")],
            f"--pairs {tmp_path / 'latin1.jsonl'}: not UTF-8 text (byte 14): give a JSONL file",
        ),
        (["--task", "ioi"], "no pair suits this model's tokenizer"),
        (["--pairs", str(pairs), "--sizes", "10,50"], "fractions of the graph's edges"),
        (["--pairs", str(pairs), "--sizes", "0.1,x"], "comma-separated numbers"),
        (["--pairs", str(same)], "the clean and corrupted prompts give the same mean metric (0"),
        (
            ["--pairs", str(pairs), "--method", "mask", "--direction", "noise"],
            "--method mask trains from the corrupted run (denoise): drop --direction noise",
        ),
    ]
    for extra, message in cases:
        code = main(["circuit", *extra, "--model", f"tiny-{ARCH}"])
        assert code == 2, extra
        _assert_one_line(capsys.readouterr().err, message)


def test_attribute_over_many_pairs_matches_the_api_with_clean_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`attribute --pairs`: scores averaged over the pairs as attention_attribution gives them;
    the edges are named by the CLEAN prompt's tokens (the patched run under denoise is the
    corrupted one) and printed as the pictures draw them, query <- key."""
    from ra_lens import attention_attribution, capture

    pairs = _write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code = main(
        ["attribute", "--pairs", str(pairs), "--model", f"tiny-{ARCH}", "--top", "6",
         "--json", str(tmp_path / "a.json")]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "a.json").read_text())
    model = tiny_model(ARCH)
    clean, corrupted, metric = paired_batch(model, PAIRS)
    att = attention_attribution(model, clean, corrupted, metric)
    for kind in att.nodes:
        got = torch.tensor(report["scores"][kind], dtype=att.scores[kind].dtype)
        torch.testing.assert_close(got, att.scores[kind], rtol=1e-5, atol=1e-9)
        assert got.abs().max() > 0
    assert report["n_pairs"] == 3
    assert report["metric_other_run"] == pytest.approx(float(att.clean_metric.mean()), abs=1e-6)
    clean_tokens = capture.str_tokens(model, clean)[0]
    corrupted_tokens = capture.str_tokens(model, corrupted)[0]
    assert report["str_tokens"] == clean_tokens != corrupted_tokens
    for edge in report["top_edges"]:
        assert edge["query_token"] == clean_tokens[edge["query"]]
        assert edge["key_token"] == clean_tokens[edge["key"]]
        line = f"{edge['query_token']!r} <- {edge['key_token']!r}"
        assert line in printed


def test_attribute_needs_one_pair_or_many(capsys: pytest.CaptureFixture) -> None:
    cases = [
        (["--task", "ioi", "--clean", "I like Italy"], "--clean with --task/--pairs"),
        (["--clean", "I like Italy", "--corrupted", "I like Paris"], "missing --target"),
    ]
    for extra, message in cases:
        assert main(["attribute", *extra, "--model", f"tiny-{ARCH}"]) == 2, extra
        last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
        assert last.startswith("ra-lens attribute: error: ") and message in last, last


@pytest.mark.parametrize(
    ("command", "args", "clash"),
    [
        ("circuit", ["--pairs", "PAIRS"], "circuit.json"),
        ("circuit", ["--pairs", "PAIRS"], "faithfulness_curve.png"),
        ("attribute", ["--clean", "I like Italy", "--corrupted", "I like Paris", "--target", " and"],
         "edges.html"),
        ("maps", ["--prompt", "I like Italy", "--target", " and"], "head_norms.png"),
    ],
)  # fmt: skip
def test_json_naming_a_file_that_out_writes_is_refused_before_the_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    args: list[str],
    clash: str,
) -> None:
    """--json D/circuit.json with --out D would replace the circuit file with the report."""
    from ra_lens import cli

    loaded: list[str] = []
    monkeypatch.setattr(cli._shared, "_load", lambda name, *a, **k: loaded.append(name))
    pairs = _write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    args = [str(pairs) if a == "PAIRS" else a for a in args]
    out = tmp_path / "out"
    argv = [command, *args, "--model", f"tiny-{ARCH}", "--out", str(out)]
    assert main([*argv, "--json", str(out / clash)]) == 2
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert last == (
        f"ra-lens {command}: error: --json {out / clash} is the {clash} that --out {out} "
        f"writes: give the report another name, such as {out}/report.json"
    )
    assert main([*argv, "--json", str(out)]) == 2
    assert f"--json {out} is the --out folder" in capsys.readouterr().err
    # the same file through a symlinked folder, and the --out folder once it exists
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    out.mkdir()
    assert main([*argv, "--json", str(tmp_path / "link" / clash)]) == 2
    assert f"is the {clash} that --out {out} writes" in capsys.readouterr().err
    assert main([*argv, "--json", str(out)]) == 2
    assert f"--json {out} is a folder" in capsys.readouterr().err
    assert loaded == [] and list(out.iterdir()) == []


@pytest.mark.parametrize("size", [["--edges", "12"], []], ids=["edges", "faithfulness"])
def test_each_circuit_is_chosen_once_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: list[str]
) -> None:
    """One `ra-lens circuit --html --mib` run chooses each circuit (edge count, ranking, unit)
    once: the curve, the saved circuit (--edges, or the smallest circuit's search), the MIB
    export and the page share the choice, counted by wrapping `EdgeScores.top` (the run's
    selection). Before, each size was chosen up to 4 times."""
    from collections import Counter

    calls: Counter[tuple[int, bool, str]] = Counter()
    top = circuits.EdgeScores.top

    def counted(self: circuits.EdgeScores, n: int, **kwargs: object) -> circuits.Circuit:
        calls[(n, bool(kwargs.get("absolute", True)), str(kwargs.get("units", "ungrouped")))] += 1
        return top(self, n, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(circuits.EdgeScores, "top", counted)
    pairs = _write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    code = main(
        ["circuit", "--pairs", str(pairs), "--model", f"tiny-{ARCH}", "--method", "eap",
         *size, "--mib", str(tmp_path / "mib"), "--html", str(tmp_path / "page.html"),
         "--json", str(tmp_path / "run.json")]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "run.json").read_text())
    n_total = report["n_edges_ungrouped"]
    # the curve's ten sizes by both rankings, the nine MIB circuits (signed), the saved one
    sizes = {int(k * n_total) for k in circuits.MIB_FRACTIONS}
    expected = {(n, absolute, "ungrouped") for n in sizes for absolute in (False, True)}
    if size:  # and the saved circuit of 12 edges
        assert set(calls) == expected | {(12, True, "ungrouped")}
    else:  # and the sizes the smallest circuit's bisection measured
        searched = {(n, True, "ungrouped") for n, _ in report["circuit"]["search"]}
        assert set(calls) == expected | searched
    assert max(calls.values()) == 1, calls
    assert (tmp_path / "page.html").is_file() and len(report["files"]) == 11


@pytest.mark.parametrize("method", ["mask", "discover"])
def test_methods_that_train_are_the_api_calls(tmp_path: Path, method: str) -> None:
    """--method mask is circuits.learn_mask (scaled rule), --method discover circuits.discover
    (at least 4 pairs: fewer are one line and exit 2); each curve measured on the pairs."""
    four = [*PAIRS, PAIRS[0]]
    pairs = _write_pairs(tmp_path / "pairs.jsonl", four)
    out = tmp_path / "out"
    argv = ["circuit", "--pairs", str(pairs), "--model", f"tiny-{ARCH}", "--method", method,
            "--sizes", ",".join(map(str, SIZES)), "--edges", "12", "--out", str(out),
            "--json", str(out / "run.json")]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "run.json").read_text())
    model = tiny_model(ARCH)
    clean, corrupted, metric = paired_batch(model, four)
    if method == "mask":
        scores = circuits.learn_mask(model, clean, corrupted, metric, rule="scaled").scores
    else:
        scores = circuits.discover(model, clean, corrupted, metric)
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric, sizes=SIZES)
    assert report["curve"]["signed_values"] == pytest.approx(curve.signed_values, abs=1e-6)
    assert report["curve"]["cmd"] == pytest.approx(curve.cmd, abs=1e-6)
    saved = circuits.Circuit.from_json(out / "circuit.json", model)
    assert saved.edge_names == scores.top(12).edge_names
    if method == "discover":
        argv[2] = str(_write_pairs(tmp_path / "three.jsonl", PAIRS))
        assert main(argv) == 2
