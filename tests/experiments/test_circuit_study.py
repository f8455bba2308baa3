"""The circuit study end to end on a tiny model (--quick): its numbers agree with each other and
with `circuits.faithfulness_curve`; user errors are one line and exit 2."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from helpers import arch_or_hooked, disk_full_beyond

from ra_lens import circuits
from ra_lens.circuits import negatives as negatives_module
from ra_lens.experiments import circuit_study as study_module
from ra_lens.experiments import circuit_study_methods as methods_module
from ra_lens.experiments.circuit_study import (
    QUICK_SETTINGS,
    fraction_columns,
    main,
    paired_difference,
    task_pairs,
)
from ra_lens.ranking import trapezoid_auc
from ra_lens.ranking.statistics import bootstrap_indices
from ra_lens.tasks import ioi
from ra_lens.toy_models import tiny_model

# eap-ig-20 stays out to keep the test cheap (the IG path is covered by the circuits tests);
# eap-ig-5 (EAP-IG-inputs) is the CPR reference every method is paired with, eap-noise
# (EAP-IG's EAP) the CMD one.
METHODS = "eap,eap-noise,eap-ig-5,exact,random"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    argv = ["--quick", "--methods", METHODS, "--n-pairs", "4", "--no-progress"]
    assert main([*argv, "--json", str(out / "s.json"), "--markdown", str(out / "s.md")]) == 0
    return json.loads((out / "s.json").read_text()), (out / "s.md").read_text()


def test_explicit_flags_win_over_quick(saved):
    study, _ = saved
    assert study["config"]["n_pairs"] == 4 and list(study["config"]["methods"]) == METHODS.split(",")  # fmt: skip
    assert study["config"]["n_boot"] == QUICK_SETTINGS["n_boot"]
    assert study["tasks"]["toy"]["n_pairs"] == 4
    truth = study["tasks"]["toy"]["truth"]  # --quick: head patching on 2 toy pairs
    assert truth["pairs"] == 2 and list(truth["pearson"]) == METHODS.split(",")
    assert all(-1 <= r <= 1 for r in truth["pearson"].values())


def test_curves_run_from_zero_to_one_and_intervals_hold_the_estimates(saved):
    study, _ = saved
    task = study["tasks"]["toy"]
    sizes = task["sizes"]
    assert sizes[-1] == task["n_edges_total"] and sizes == sorted(set(sizes))
    for label, entry in task["summary"]["methods"].items():
        assert task["methods"][label]["n_edges"][-1] == task["n_edges_total"]
        for ablation in ("patching", "mean"):
            e = entry[ablation]
            assert e["faithfulness"][-1] == pytest.approx(1.0, abs=1e-5), (label, ablation)
            if sizes[0] == 0:
                assert e["faithfulness"][0] == pytest.approx(0.0, abs=1e-9)
            for name in ("cpr", "cmd", *[f"at:{c}" for c in e["at_edges"]]):
                i = e["at_edges"][name[3:]] if name.startswith("at:") else e[name]
                assert i["low"] - 1e-9 <= i["estimate"] <= i["high"] + 1e-9, (label, name)
            for f, lo, hi in zip(e["faithfulness"], e["low"], e["high"]):
                assert lo - 1e-9 <= f <= hi + 1e-9


def test_cpr_and_cmd_are_mibs_trapezoids_of_the_curve(saved):
    study, _ = saved
    task = study["tasks"]["toy"]
    fractions = study["config"]["fractions"]
    columns = fraction_columns(task, fractions)
    for entry in task["summary"]["methods"].values():
        for e in entry.values():  # CPR: the signed ranking's curve; CMD: the |score| ranking's
            signed = [e["signed_faithfulness"][i] for i in columns]
            assert e["cpr"]["estimate"] == pytest.approx(trapezoid_auc(fractions, signed))
            curve = [e["faithfulness"][i] for i in columns]
            cmd = trapezoid_auc(fractions, [abs(1 - v) for v in curve])
            assert e["cmd"]["estimate"] == pytest.approx(cmd)


def test_paired_differences(saved):
    study, text = saved
    task, cfg = study["tasks"]["toy"], study["config"]
    same = paired_difference(task, "exact", "exact", "patching", cfg["fractions"], 50)
    assert same["difference"]["estimate"] == same["difference"]["low"] == 0.0
    assert same["difference"]["high"] == 0.0 and same["ratio"]["estimate"] == pytest.approx(1.0)
    best = task["summary"]["best_ra_lens"]["patching"]
    paired = task["summary"]["paired"]["patching"]
    cpr = task["summary"]["methods"]
    for label in ("eap", "exact", "eap-noise"):  # CPR paired with eap-ig-5
        diff = cpr[label]["patching"]["cpr"]["estimate"] - cpr["eap-ig-5"]["patching"]["cpr"]["estimate"]  # fmt: skip
        assert paired[f"{label} - eap-ig-5"]["difference"]["estimate"] == pytest.approx(diff)
        assert f"| toy | {label} - eap-ig-5 |" in text
    cmd = task["summary"]["paired_cmd"]["patching"]["exact - eap-noise"]["difference"]["estimate"]
    expected = cpr["exact"]["patching"]["cmd"]["estimate"] - cpr["eap-noise"]["patching"]["cmd"]["estimate"]  # fmt: skip
    assert cmd == pytest.approx(expected)
    assert "random - eap-ig-5" not in paired and "| toy (4 held out, 3 train) | random |" in text
    goals = study["goals"]["toy"]
    # the goals are the library default's (eap-ig-5), here the CPR reference itself
    assert goals["method"] == study["config"]["default_method"] == "eap-ig-5"
    assert goals["best_cpr"] == best and "cpr_ratio" not in goals
    cmd = task["summary"]["paired_cmd"]["patching"]["eap-ig-5 - eap-noise"]["difference"]
    assert goals["cmd_difference"] == cmd


def test_scores_come_from_training_pairs_the_curves_from_held_out_ones(saved):
    """MIB attributes on one split and evaluates on another: the study scores the first
    train_pairs pairs and measures the next n_pairs; no pair is in both."""
    study, _ = saved
    task = study["tasks"]["toy"]
    assert study["config"]["train_pairs"] == QUICK_SETTINGS["train_pairs"] == len(task["train_pairs"])  # fmt: skip
    assert len(task["pairs"]) == 4
    assert not {tuple(p) for p in task["pairs"]} & {tuple(p) for p in task["train_pairs"]}
    # noise scores are read in MIB's sign: their head scores follow the denoise truth
    assert study["tasks"]["toy"]["truth"]["pearson"]["eap-noise"] > 0.9


def test_the_curve_matches_faithfulness_curve(saved):
    """The study's patching curves, CPR and CMD are `circuits.faithfulness_curve`'s for the same
    scores: both rankings, sizes in ungrouped edges, normalised by the empty circuit."""
    from ra_lens.toy_models import tiny_model

    study, _ = saved
    task, cfg = study["tasks"]["toy"], study["config"]
    arch = cfg["model"].split()[0].removeprefix("tiny-")
    model = tiny_model(arch, n_layers=2)
    every = task_pairs(model, "toy", cfg["train_pairs"] + 4)
    train, held = every[: cfg["train_pairs"]], every[cfg["train_pairs"] :]
    assert [[p.clean, p.corrupted, p.answer, p.wrong] for p in held] == task["pairs"]
    scores = circuits.attribute(model, *ioi.paired_batch(model, train), method="eap", batch_size=4)
    clean, corrupted, metric = ioi.paired_batch(model, held)
    fractions = cfg["fractions"]
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric, sizes=fractions)
    ours = task["summary"]["methods"]["eap"]["patching"]
    columns = fraction_columns(task, fractions)
    assert curve.abs_values == pytest.approx([ours["faithfulness"][i] for i in columns], abs=1e-4)
    signed = [ours["signed_faithfulness"][i] for i in columns]
    assert curve.signed_values == pytest.approx(signed, abs=1e-4)
    assert curve.cpr == pytest.approx(ours["cpr"]["estimate"], abs=1e-4)
    assert curve.cmd == pytest.approx(ours["cmd"]["estimate"], abs=1e-4)
    assert curve.n_total == task["n_edges_total"] == scores.graph.n_edges_ungrouped
    assert curve.signed_n_edges == [task["methods"]["eap"]["signed_n_edges"][i] for i in columns]
    assert torch.isfinite(torch.tensor(curve.signed_values + curve.abs_values)).all()
    assert study["config"]["faithfulness_baseline"] == curve.baseline


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "eap,nope"], "unknown method nope"),
        (["--tasks", "greater-than"], "unknown task greater-than"),
        (["--n-pairs", "0"], "--n-pairs must be at least 1"),
        # the nine toy pairs are a cycle: the corrupted prompts are the clean ones reordered
        (
            ["--n-pairs", "9", "--train-pairs", "0"],
            "the clean and corrupted prompts give the same mean metric",
        ),
        (
            ["--n-pairs", "8"],
            "task 'toy' has 9 usable pairs: too few for 8 held-out pairs and at least 3 to score on; lower --n-pairs",
        ),  # fmt: skip
        (["--train-pairs", "-1"], "--train-pairs must be at least 0, got -1"),
        (["--refits", "1"], "--refits 1: a bootstrap Jaccard compares resamples, give 2 or more"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, message):
    assert main(["--quick", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err  # building the tiny model may print progress first
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("circuit_study: error: ") and message in last
    assert err.count("circuit_study: error:") == 1


def test_random_scores_live_on_the_graph():
    graph = circuits.Graph(n_layers=2, n_heads=4, n_kv_heads=2, d_model=8, parallel_attn_mlp=False)
    scores = methods_module.random_scores(graph).scores
    assert bool((scores[~graph.real] == 0).all()) and bool((scores[graph.real] > 0).all())


def test_head_patching_is_patching_every_outgoing_edge():
    """The ground truth (a head's hook_z patched from clean into the corrupted run) equals edge
    patching of all that head's outgoing edges, run on the corrupted prompts."""
    from helpers import has_bridge

    from ra_lens.experiments.circuit_study import head_node_scores, head_patching
    from ra_lens.toy_models import tiny_model

    model = tiny_model("llama" if has_bridge() else "hooked", n_layers=2, dtype=torch.float64)
    pairs = task_pairs(model, "toy", 3)
    truth = head_patching(model, pairs)
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    graph = circuits.Graph.from_model(model)
    for layer, head in [(0, 1), (1, 2)]:
        edges = graph.real.clone()
        edges[graph.writer_index[f"a{layer}.h{head}"]] = False
        result = circuits.faithfulness(
            model, circuits.Circuit(graph, edges), corrupted, clean, metric
        )
        effect = result.circuit_metric - result.clean_metric  # "clean" here: the corrupted run
        assert float(truth[layer, head]) == pytest.approx(effect, abs=1e-9)
    scores = circuits.attribute(model, clean, corrupted, metric, method="eap")
    heads = head_node_scores(scores)
    writer = graph.writer_index["a1.h2"]
    assert float(heads[1, 2]) == pytest.approx(float(scores.scores[writer].sum()))


def test_merging_studies_that_ran_side_by_side(saved, tmp_path):
    """Two halves of one study (methods split) merge back into its summary."""
    study, _ = saved
    halves = []
    for methods in (["eap", "eap-noise"], ["eap-ig-5", "exact", "random"]):
        half = json.loads(json.dumps(study))
        task = half["tasks"]["toy"]
        task["methods"] = {m: task["methods"][m] for m in methods}
        half["config"]["methods"] = {m: study["config"]["methods"][m] for m in methods}
        (tmp_path / f"{methods[0]}.json").write_text(json.dumps(half))
        halves.append(str(tmp_path / f"{methods[0]}.json"))
    assert main(["--merge", *halves, "--json", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["tasks"]["toy"]["summary"] == study["tasks"]["toy"]["summary"]
    assert merged["goals"] == study["goals"] and list(merged["config"]["methods"]) == METHODS.split(",")  # fmt: skip
    other = json.loads(json.dumps(study))
    other["config"]["n_boot"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["--merge", halves[0], str(tmp_path / "other.json")]) == 2


def test_merging_parts_with_other_ablations_pools_each_methods_ablations(saved, tmp_path):
    """A part measured under "patching" and a part under "mean" (same methods) merge into the
    study that measured both."""
    study, _ = saved
    parts = []
    for ablation in study["config"]["ablations"]:
        part = json.loads(json.dumps(study))
        task = part["tasks"]["toy"]
        task["reference"] = {ablation: task["reference"][ablation]}
        for result in task["methods"].values():
            result["circuit"] = {ablation: result["circuit"][ablation]}
            result["signed_circuit"] = {ablation: result["signed_circuit"][ablation]}
        part["config"]["ablations"] = [ablation]
        (tmp_path / f"{ablation}.json").write_text(json.dumps(part))
        parts.append(str(tmp_path / f"{ablation}.json"))
    assert len(parts) == 2
    assert main(["--merge", *parts, "--json", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["tasks"]["toy"]["summary"] == study["tasks"]["toy"]["summary"]
    assert merged["config"]["ablations"] == study["config"]["ablations"]
    bent = json.loads((tmp_path / "mean.json").read_text())
    bent["tasks"]["toy"]["methods"]["eap"]["n_edges"][-1] -= 1
    (tmp_path / "mean.json").write_text(json.dumps(bent))
    assert main(["--merge", *parts, "--json", str(tmp_path / "m.json")]) == 2


def test_greedy_selection_is_recorded_and_does_not_merge_with_top(saved, tmp_path):
    study, _ = saved
    argv = ["--quick", "--methods", "eap", "--n-pairs", "4", "--truth-tasks", "", "--no-progress"]
    path = tmp_path / "greedy.json"
    assert main([*argv, "--ablations", "patching", "--selection", "greedy", "--json", str(path)]) == 0  # fmt: skip
    greedy = json.loads(path.read_text())
    assert greedy["config"]["selection"] == "greedy" and study["config"]["selection"] == "top"
    task = greedy["tasks"]["toy"]
    assert all(n <= size for n, size in zip(task["methods"]["eap"]["n_edges"], task["sizes"]))
    assert task["methods"]["eap"]["n_edges"][-1] == task["n_edges_total"]
    (tmp_path / "top.json").write_text(json.dumps(study))
    assert main(["--merge", str(path), str(tmp_path / "top.json")]) == 2


def test_per_copy_circuits_are_recorded_measured_and_do_not_merge_with_grouped(saved, tmp_path):
    study, _ = saved
    argv = ["--quick", "--methods", "eap", "--n-pairs", "4", "--truth-tasks", "", "--no-progress"]
    path = tmp_path / "own.json"
    assert main([*argv, "--ablations", "patching", "--own-copies", "--json", str(path)]) == 0
    own = json.loads(path.read_text())
    assert own["config"]["own_copies"] is True and study["config"]["own_copies"] is False
    task, grouped = own["tasks"]["toy"], study["tasks"]["toy"]
    assert all(n <= size for n, size in zip(task["methods"]["eap"]["n_edges"], task["sizes"]))
    # TL 4's tiny llama has grouped-query attention: per-copy circuits are other circuits
    ours, theirs = (t["methods"]["eap"]["signed_circuit"]["patching"] for t in (task, grouped))
    if task["n_edges_grouped"] < task["n_edges_total"]:
        assert ours != theirs
    else:  # TL 2's tiny model has none: the same circuits
        assert ours == theirs
    (tmp_path / "grouped.json").write_text(json.dumps(study))
    assert main(["--merge", str(path), str(tmp_path / "grouped.json")]) == 2


# --- saving and merging: nothing lost, every bad input one line --------------------------------

WHAT = "a saved study (a file circuit_study --json wrote)"


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_a_full_disk_keeps_the_earlier_results(saved, tmp_path, capsys, flag):
    """A failed write leaves the earlier file whole (not a truncated JSON) and no temporary."""
    study, _ = saved
    part = tmp_path / "part.json"
    part.write_text(json.dumps(study))
    out = tmp_path / "results"
    out.write_text("earlier results")
    with disk_full_beyond(200):
        code = main(["--merge", str(part), flag, str(out)])
    assert code == 2
    assert capsys.readouterr().err == "circuit_study: error: [Errno 27] File too large\n"
    assert out.read_text() == "earlier results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.json", "results"]


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_outputs_are_checked_before_any_work(tmp_path, capsys, monkeypatch, flag):
    ran: list[str] = []
    monkeypatch.setattr(study_module, "circuit_study", lambda *a, **k: ran.append("study"))
    monkeypatch.setattr(study_module, "merge_saved", lambda *a, **k: ran.append("merge"))
    (tmp_path / "part.json").write_text("{}")
    folder = tmp_path / "results"
    folder.mkdir()
    for argv in (["--quick", "--no-progress"], ["--merge", str(tmp_path / "part.json")]):
        assert main([*argv, flag, str(folder)]) == 2
        assert capsys.readouterr().err == (
            f"circuit_study: error: {flag} {folder} is a folder: give the name of a file (in it "
            "or elsewhere)\n"
        )
    assert ran == []


#: Damage to a saved study, and the error --merge gives for it ({path}: the file).
DAMAGES = {
    "list": f"{{path}} is not {WHAT}: it has no objects 'config' and 'tasks'",
    "empty": f"{{path}} is not {WHAT}: it has no objects 'config' and 'tasks'",
    "tasks-list": f"{{path}} is not {WHAT}: it has no objects 'config' and 'tasks'",
    "task-number": f"{{path}} is not {WHAT}: task 'toy' is not an object",
    "task-without-pairs": f"{{path}} is not {WHAT}: task 'toy' lacks pairs",
    "config-without-n_boot": f"{{path}} is not {WHAT}: its config lacks n_boot",
    "method-number": "the saved studies do not have the layout circuit_study --json writes "
    "(TypeError: 'int' object is not subscriptable): merge files it wrote",
}


def damaged(study: dict, damage: str):
    """The saved study with one kind of damage, as a JSON value."""
    if damage == "list":
        return [study]
    if damage == "empty":
        return {}
    bent = json.loads(json.dumps(study))
    toy = bent["tasks"]["toy"]
    if damage == "tasks-list":
        bent["tasks"] = [toy]
    elif damage == "task-number":
        bent["tasks"]["toy"] = 3
    elif damage == "task-without-pairs":
        del toy["pairs"]
    elif damage == "config-without-n_boot":
        del bent["config"]["n_boot"]
    elif damage == "method-number":
        toy["methods"]["eap"] = 5
    return bent


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_merging_damaged_files_is_one_line(saved, tmp_path, capsys, damage):
    study, _ = saved
    path = tmp_path / "part.json"
    path.write_text(json.dumps(damaged(study, damage)))
    assert main(["--merge", str(path), "--json", str(tmp_path / "m.json")]) == 2
    message = DAMAGES[damage].format(path=path)
    assert capsys.readouterr().err == f"circuit_study: error: {message}\n"
    assert not (tmp_path / "m.json").exists()


def test_merging_unreadable_files_names_them(tmp_path, capsys):
    cases = [
        (tmp_path / "missing.json", "{path}: no such file"),
        (tmp_path, f"{{path}} is a folder, not {WHAT}"),
        (tmp_path / "latin1.json", f"{{path}}: not UTF-8 text (byte 1), so not {WHAT}"),
        (tmp_path / "broken.json", f"{{path}} is not valid JSON (Expecting value: line 1 column "
         f"2 (char 1)): pass {WHAT}"),
    ]  # fmt: skip
    (tmp_path / "latin1.json").write_bytes(b'"\xe9t\xe9"')
    (tmp_path / "broken.json").write_text("[")
    for path, message in cases:
        assert main(["--merge", str(path)]) == 2
        assert capsys.readouterr().err == f"circuit_study: error: {message.format(path=path)}\n"


def test_a_method_built_on_others_reuses_them_and_counts_each_once(monkeypatch):
    """ens-mask = mean(eap-ig-5, mask), and the mask starts from that same eap-ig-5: eap-ig-5 is
    computed once, handed to learn_mask as its warm start, and its seconds are counted once."""
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    train = task_pairs(model, "toy", 3)
    graph = circuits.Graph.from_model(model)
    calls: list[str] = []
    real_attribute, real_mask = circuits.attribute, circuits.learn_mask

    def attribute(*args, **kwargs):
        calls.append(kwargs["method"])
        return real_attribute(*args, **kwargs)

    def learn_mask(*args, **kwargs):
        calls.append("mask")
        assert isinstance(kwargs["warm_start"], circuits.EdgeScores)
        return real_mask(*args, **{**kwargs, "steps": 2})

    monkeypatch.setattr(circuits, "attribute", attribute)
    monkeypatch.setattr(circuits, "learn_mask", learn_mask)
    scored = methods_module.Scored(model, train, graph, batch_size=4)
    ens, spent = scored("ens-mask")
    warm, warm_spent = scored("eap-ig-5")
    mask, mask_spent = scored("mask")
    assert calls == ["eap-ig", "mask"]
    assert scored("mask")[0].method == "mask" and ens.method != "mask"
    own = {label: scored.own[label][0]["attribute_cpu"] for label in ("eap-ig-5", "mask", "ens-mask")}  # fmt: skip
    assert warm_spent["attribute_cpu"] == own["eap-ig-5"]
    assert mask_spent["attribute_cpu"] == pytest.approx(own["eap-ig-5"] + own["mask"])
    assert spent["attribute_cpu"] == pytest.approx(sum(own.values()))
    expected = circuits.ensemble([warm, mask], normalise="rms")
    assert torch.equal(ens.scores, expected.scores)


def test_calibrated_mask_is_the_mask_with_its_negatives_scaled_on_the_training_pairs(monkeypatch):
    """mask-scaled-cal: the study's mask-scaled scores, computed once, calibrated on the same
    training pairs with the study's own_copies; its seconds are the mask's plus its own."""
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    train = task_pairs(model, "toy", 3)
    graph = circuits.Graph.from_model(model)
    seen: list[tuple[circuits.EdgeScores, bool]] = []
    real_calibrate, real_mask = circuits.calibrate_negatives, circuits.learn_mask

    def calibrate_negatives(model, scores, *args, **kwargs):
        seen.append((scores, kwargs["own_copies"]))
        return real_calibrate(model, scores, *args, **{**kwargs, "sizes": [0.5, 1.0]})

    monkeypatch.setattr(circuits, "calibrate_negatives", calibrate_negatives)
    monkeypatch.setattr(circuits, "learn_mask", lambda *a, **k: real_mask(*a, **{**k, "steps": 2}))
    scored = methods_module.Scored(model, train, graph, batch_size=4, own_copies=True)
    calibrated, spent = scored("mask-scaled-cal")
    mask, mask_spent = scored("mask-scaled")
    assert len(seen) == 1 and seen[0][0] is mask and seen[0][1] is True
    chosen = real_calibrate(model, mask, scored.clean, scored.corrupted, scored.metric, sizes=[0.5, 1.0], own_copies=True)  # fmt: skip
    assert torch.equal(calibrated.scores, chosen.scores.scores)
    assert scored.calibrations["mask-scaled-cal"]["scale"] == chosen.scale
    assert scored.calibrations["mask-scaled-cal"]["cmd"] == {
        str(c): v for c, v in chosen.cmd.items()
    }
    own = scored.own["mask-scaled-cal"][0]["attribute_cpu"]
    assert spent["attribute_cpu"] == pytest.approx(mask_spent["attribute_cpu"] + own)


def _halves_setup(monkeypatch, candidates):
    """A one-layer grouped-query toy, 5 toy training pairs, its graph, and the calibrations
    seen (scores, calibration tokens): calibrate_negatives at two sizes over `candidates`,
    learn_mask at 2 steps."""
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    train = task_pairs(model, "toy", 5)
    seen: list[tuple[circuits.EdgeScores, torch.Tensor]] = []
    real_calibrate, real_mask = circuits.calibrate_negatives, circuits.learn_mask

    def calibrate_negatives(model, scores, clean, *args, **kwargs):
        seen.append((scores, clean.tokens))
        return real_calibrate(model, scores, clean, *args, **{**kwargs, "sizes": [0.5, 1.0], "candidates": candidates})  # fmt: skip

    monkeypatch.setattr(circuits, "calibrate_negatives", calibrate_negatives)
    monkeypatch.setattr(circuits, "learn_mask", lambda *a, **k: real_mask(*a, **{**k, "steps": 2}))
    return model, train, circuits.Graph.from_model(model), seen


def test_apart_calibration_fits_on_one_half_and_chooses_on_the_other(monkeypatch):
    """mask-scaled-xcal: a mask trained on the first half of the training pairs (from that half's
    own eap-ig) is calibrated on the second half; the factor scales the study's mask-scaled
    scores, fitted on all the pairs. Its seconds count the half's work too."""
    model, train, graph, seen = _halves_setup(monkeypatch, (1.0, 0.5, 0.01))
    scored = methods_module.Scored(model, train, graph, batch_size=4, own_copies=True)
    calibrated, spent = scored("mask-scaled-xcal")
    mask, mask_spent = scored("mask-scaled")
    fit = methods_module.Scored(model, train[:3], graph, batch_size=4, own_copies=True)
    held = methods_module.Scored(model, train[3:], graph, batch_size=4, own_copies=True)
    ((scores, tokens),) = seen
    assert torch.equal(tokens, held.clean.tokens)
    assert torch.allclose(scores.scores, fit("mask-scaled")[0].scores)  # the half's own mask
    record = scored.calibrations["mask-scaled-xcal"]
    assert record["pairs"] == "apart" and record["n_pairs"] == 2
    expected = circuits.scale_negatives(mask, record["scale"])
    assert torch.equal(calibrated.scores, expected.scores)
    own = scored.own["mask-scaled-xcal"][0]["attribute_cpu"]
    assert spent["attribute_cpu"] == pytest.approx(mask_spent["attribute_cpu"] + own)
    too_few = methods_module.Scored(model, train[:3], graph, batch_size=4)
    with pytest.raises(ValueError, match="at least 4"):
        too_few("mask-scaled-xcal")


def test_crossfit_is_the_mean_of_the_halves_masks_scaled_as_both_halves_choose(monkeypatch):
    """mask-scaled-cv: one mask per half of the training pairs (each from its half's own eap-ig),
    the factor chosen by the mean CMD of each half's mask on the other half (cross_calibrate, as
    circuits.discover does); the scores are the two masks' raw mean with that factor, and no
    mask is fitted on all the pairs."""
    model, train, graph, _ = _halves_setup(monkeypatch, (0.01, 0.5))
    seen: list[list] = []
    real_cross = negatives_module.cross_calibrate

    def cross_calibrate(model, folds, scores, **kwargs):  # two sizes, the toy's candidates
        seen.append(list(folds))
        return real_cross(model, folds, scores, **{**kwargs, "sizes": [0.5, 1.0], "candidates": (0.01, 0.5)})  # fmt: skip

    monkeypatch.setattr(methods_module, "cross_calibrate", cross_calibrate)
    scored = methods_module.Scored(model, train, graph, batch_size=4, own_copies=True)
    cv, spent = scored("mask-scaled-cv")
    first = methods_module.Scored(model, train[:3], graph, batch_size=4, own_copies=True)
    second = methods_module.Scored(model, train[3:], graph, batch_size=4, own_copies=True)
    halves = [first("mask-scaled")[0], second("mask-scaled")[0]]
    ((fold_a, fold_b),) = seen  # each half's mask on the other half's pairs
    assert torch.equal(fold_a.clean.tokens, second.clean.tokens)
    assert torch.equal(fold_b.clean.tokens, first.clean.tokens)
    assert torch.allclose(fold_a.scores.scores, halves[0].scores)
    assert torch.allclose(fold_b.scores.scores, halves[1].scores)
    record = scored.calibrations["mask-scaled-cv"]
    assert record["pairs"] == "crossfit" and record["n_pairs"] == 5 and len(record["fold_cmd"]) == 2
    for c, cmd in record["cmd"].items():
        assert cmd == pytest.approx(sum(f[c] for f in record["fold_cmd"]) / 2)
    mean = circuits.ensemble(halves, normalise="none")
    assert torch.allclose(mean.scores, (halves[0].scores + halves[1].scores) / 2)
    assert record["scale"] < 1  # every candidate moves the scores: the test sees one applied
    expected = circuits.scale_negatives(mean, record["scale"])  # each key/value copy by its sign
    assert torch.equal(cv.scores, expected.scores)
    if expected.ungrouped_scores is not None:  # grouped-query (TL 4's toy Llama)
        assert torch.equal(cv.ungrouped_scores, expected.ungrouped_scores)
    assert (cv.scores < 0).any() and "mask-scaled" not in scored.scored
    # circuits.discover, the same steps as a library call (here the halves share one padding)
    discover_module = importlib.import_module("ra_lens.circuits.discover")
    monkeypatch.setattr(discover_module, "cross_calibrate", cross_calibrate)
    monkeypatch.setattr(discover_module, "learn_mask", circuits.learn_mask)
    found = circuits.discover(model, scored.clean, scored.corrupted, scored.metric, batch_size=4)
    torch.testing.assert_close(found.scores, cv.scores, rtol=1e-4, atol=1e-6)
    assert found.method.endswith(f"negatives x {record['scale']:g})")
    assert spent["attribute_cpu"] == pytest.approx(scored.own["mask-scaled-cv"][0]["attribute_cpu"])  # fmt: skip
    with pytest.raises(ValueError, match="at least 4"):
        methods_module.Scored(model, train[:3], graph, batch_size=4)("mask-scaled-cv")


def test_refits_run_every_method_again_on_resamples_of_the_training_pairs(monkeypatch):
    """--refits: each resample of the training pairs gets its own eap-ig-5 and its own mask
    warm-started from it (all the pairs reuse the study's); the Jaccard compares those runs'
    circuits, checked as sets."""
    model = tiny_model(arch_or_hooked("llama"), n_layers=1)
    train = task_pairs(model, "toy", 3)
    graph = circuits.Graph.from_model(model)
    runs: list[tuple[str, torch.Tensor, circuits.EdgeScores]] = []
    real_attribute, real_mask = circuits.attribute, circuits.learn_mask

    def attribute(model, clean, *args, **kwargs):
        runs.append((kwargs["method"], clean.tokens, real_attribute(model, clean, *args, **kwargs)))
        return runs[-1][2]

    def learn_mask(model, clean, *args, **kwargs):
        (warm,) = [r[2] for r in runs if r[0] == "eap-ig" and torch.equal(r[1], clean.tokens)]
        assert kwargs["warm_start"] is warm  # this resample's own eap-ig
        learned = real_mask(model, clean, *args, **{**kwargs, "steps": 2})
        runs.append(("mask", clean.tokens, learned.scores))
        return learned

    monkeypatch.setattr(circuits, "attribute", attribute)
    monkeypatch.setattr(circuits, "learn_mask", learn_mask)
    scored = methods_module.Scored(model, train, graph, batch_size=4)
    refits = methods_module.Refits(scored, train, n_boot=2)
    warm = refits("eap-ig-5")
    mask = refits("mask-scaled")
    resampled = [ioi.paired_batch(model, [train[i] for i in rows])[0].tokens for rows in bootstrap_indices(3, 2).tolist()]  # fmt: skip
    assert [r[0] for r in runs] == ["eap-ig", "eap-ig", "eap-ig", "mask", "mask", "mask"]
    for label in ("eap-ig", "mask"):  # all the pairs, then each resample's own pairs
        tokens = [r[1] for r in runs if r[0] == label]
        assert torch.equal(tokens[0], scored.clean.tokens)
        assert all(torch.equal(t, r) for t, r in zip(tokens[1:], resampled, strict=True))
    for result, label in ((warm, "eap-ig"), (mask, "mask")):
        mine = [r[2] for r in runs if r[0] == label]
        assert result["signed"]["n_boot"] == 2 and result["seconds"] > 0
        for i, n in enumerate(result["signed"]["n_edges"]):
            first, second = (set(s.top(n, absolute=False).edge_names) for s in mine[1:])
            union = first | second
            expected = len(first & second) / len(union) if union else None
            assert result["signed"]["pairwise"][i] == (expected if expected is None else pytest.approx(expected, abs=1e-12))  # fmt: skip


def test_the_markdown_names_each_calibrated_methods_negative_scale():
    from ra_lens.experiments.circuit_study_report import _negative_scale_lines

    study = {
        "tasks": {
            "ioi": {
                "methods": {
                    "eap-ig-5": {},
                    "mask-scaled-cal": {"negative_scale": {"scale": 0.5, "cmd": {"1.0": 0.1, "0.5": 0.05}}},
                    "mask-scaled-xcal": {"negative_scale": {"scale": 1.0, "cmd": {"1.0": 0.2}, "pairs": "apart"}},
                }
            }
        }
    }  # fmt: skip
    assert _negative_scale_lines(study) == [
        "### Negative scales",
        "",
        "- ioi, mask-scaled-cal: negative scores x 0.5, chosen on the training pairs (CMD there x 1.0: 0.1000, x 0.5: 0.0500)",
        "- ioi, mask-scaled-xcal: negative scores x 1, chosen on the half of the training pairs its fit on the other half did not see (CMD there x 1.0: 0.2000)",
        "",
    ]  # fmt: skip
    assert _negative_scale_lines({"tasks": {"ioi": {"methods": {"eap": {}}}}}) == []
