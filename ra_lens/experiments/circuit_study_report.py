"""The circuit study's report (issue 22): statistics, goals and tables, all recomputed from the
per-pair metrics `circuit_study.run_task` saves.

Faithfulness at a size is (m(circuit) - m(empty)) / (m(clean) - m(empty)), m the metric's mean over
pairs (`curves`); CPR and CMD are MIB's trapezoid areas over the fraction of edges (`areas`), CPR of
the signed ranking's curve, CMD of the |score| ranking's (as MIB's print_results.py reports them).
Intervals: 95 % percentile bootstrap over pairs, the same resamples for every method, so paired
differences between methods come with their own interval (`paired_difference`). `summarise` gives
one task's numbers, `goals` checks issue 22's goals, `markdown` writes the tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens.ranking import bootstrap_indices
from ra_lens.ranking.statistics import percentile_interval

#: The references, ra-lens's runs of EAP-IG's algorithms: eap-ig with 5 steps, denoise, is
#: EAP-IG-inputs (the gradient at the embeddings 0, 0.2, .., 0.8 of the way from the corrupted to
#: the clean run; CPR and CPU seconds); eap, noise (the gradient on the clean run), is EAP-IG's
#: EAP (CMD), equal to it edge by edge on SmolLM2 (README). Both read the clean - corrupted
#: difference in MIB's sign.
CPR_REFERENCE = "eap-ig-5"
CMD_REFERENCE = "eap-noise"
#: Issue 29's goals for the default method: CPR at least this times the CPR reference's, CMD at
#: most the CMD reference's, attribution CPU at most this share of the CPR reference's.
CPR_RATIO_GOAL = 1.2
CPU_SHARE_GOAL = 0.25
NOT_CANDIDATES: tuple[str, ...] = ("random",)


def curves(
    task: dict[str, Any],
    method: str,
    ablation: str,
    index: Tensor | None = None,
    *,
    signed: bool = False,
) -> Float[Tensor, "boot size"]:
    """Faithfulness at each size from the metrics' means over pairs, on the pairs as observed
    (index None: one row) or on each bootstrap resample of pairs (index [boot, n]); the circuits
    of the |score| ranking, or of the signed ranking (signed=True)."""
    ref = task["reference"][ablation]
    result = task["methods"][method]
    if signed and "signed_circuit" not in result:
        raise ValueError(
            f"method {method!r} has no signed-ranking circuits: the file predates MIB's CPR "
            "(signed ranking); rerun the study"
        )
    values = result["signed_circuit" if signed else "circuit"][ablation]
    circuit = torch.tensor(values, dtype=torch.float64).T
    clean = torch.tensor(ref["clean"], dtype=torch.float64)
    empty = torch.tensor(ref["empty"], dtype=torch.float64)
    if index is None:
        index = torch.arange(len(clean))[None]
    clean_m, empty_m = clean[index].mean(1), empty[index].mean(1)
    return (circuit[index].mean(1) - empty_m[:, None]) / (clean_m - empty_m)[:, None]


def fraction_columns(task: dict[str, Any], fractions: Sequence[float]) -> list[int]:
    """The size index of each fraction."""
    return [task["sizes"].index(int(k * task["n_edges_total"])) for k in fractions]


def areas(
    fractions: Sequence[float], values: Float[Tensor, "boot size"], *, absolute: bool
) -> Float[Tensor, "boot"]:
    """Trapezoid areas over the fractions: CPR of f, or CMD of |1 - f| (absolute)."""
    x = torch.tensor(list(fractions), dtype=torch.float64)
    y = (1 - values).abs() if absolute else values
    return ((x[1:] - x[:-1]) * (y[:, 1:] + y[:, :-1]) / 2).sum(-1)


def interval(estimate: float, stats: Tensor, n: int, n_boot: int) -> dict[str, Any]:
    """95 % percentile interval of bootstrap statistics (nan resamples dropped), as a dict."""
    return percentile_interval(float(estimate), stats, 0.95, n, n_boot, 0).to_dict()


def area_samples(
    task: dict[str, Any],
    method: str,
    ablation: str,
    fractions: Sequence[float],
    n_boot: int,
    *,
    absolute: bool = False,
) -> tuple[float, Tensor]:
    """CPR (the signed ranking's; absolute=False) or CMD (the |score| ranking's; absolute=True)
    as observed and on each resample (the same resamples for every method)."""
    columns = fraction_columns(task, fractions)
    index = bootstrap_indices(task["n_pairs"], n_boot, seed=0)
    signed = not absolute
    point = curves(task, method, ablation, signed=signed)[:, columns]
    boot = curves(task, method, ablation, index, signed=signed)[:, columns]
    point, boot = (
        areas(fractions, point, absolute=absolute),
        areas(fractions, boot, absolute=absolute),
    )
    return float(point[0]), boot


def paired_difference(
    task: dict[str, Any],
    a: str,
    b: str,
    ablation: str,
    fractions: Sequence[float],
    n_boot: int,
    *,
    absolute: bool = False,
) -> dict[str, Any]:
    """CPR(a) - CPR(b) (CMD with absolute=True) with its interval over the same resamples, and
    the ratio a / b."""
    point_a, boot_a = area_samples(task, a, ablation, fractions, n_boot, absolute=absolute)
    point_b, boot_b = area_samples(task, b, ablation, fractions, n_boot, absolute=absolute)
    n = task["n_pairs"]
    return {
        "difference": interval(point_a - point_b, boot_a - boot_b, n, n_boot),
        "ratio": interval(point_a / point_b, boot_a / boot_b, n, n_boot),
    }


def summarise(task: dict[str, Any], fractions: Sequence[float], n_boot: int) -> dict[str, Any]:
    """Per method and ablation: the |score| ranking's curve with bands ("faithfulness") and the
    signed ranking's ("signed_faithfulness"), CPR (signed), CMD (|score|), faithfulness at the
    fixed edge counts (|score|); the paired CPR differences of the best ra-lens method against
    the references."""
    n = task["n_pairs"]
    index = bootstrap_indices(n, n_boot, seed=0)
    columns = fraction_columns(task, fractions)
    out: dict[str, Any] = {"methods": {}, "paired": {}, "paired_cmd": {}, "best_ra_lens": {}}
    for ablation in task["reference"]:
        for label in task["methods"]:
            point, boot = curves(task, label, ablation), curves(task, label, ablation, index)
            s_point = curves(task, label, ablation, signed=True)
            s_boot = curves(task, label, ablation, index, signed=True)
            band = [interval(float(point[0, i]), boot[:, i], n, n_boot) for i in range(len(task["sizes"]))]  # fmt: skip
            entry = out["methods"].setdefault(label, {})
            entry[ablation] = {
                "faithfulness": point[0].tolist(),
                "low": [b["low"] for b in band],
                "high": [b["high"] for b in band],
                "signed_faithfulness": s_point[0].tolist(),
                "cpr": interval(
                    float(areas(fractions, s_point[:, columns], absolute=False)[0]),
                    areas(fractions, s_boot[:, columns], absolute=False), n, n_boot,
                ),
                "cmd": interval(
                    float(areas(fractions, point[:, columns], absolute=True)[0]),
                    areas(fractions, boot[:, columns], absolute=True), n, n_boot,
                ),
                "at_edges": {str(c): band[task["sizes"].index(c)] for c in task["edge_counts"]},
            }  # fmt: skip
        candidates = [m for m in task["methods"] if m not in NOT_CANDIDATES]
        if not candidates:
            continue
        cpr = {m: out["methods"][m][ablation]["cpr"]["estimate"] for m in candidates}
        out["best_ra_lens"][ablation] = max(candidates, key=lambda m: cpr[m] if cpr[m] is not None else -math.inf)  # fmt: skip
        for label in candidates:
            for ref, absolute, key in ((CPR_REFERENCE, False, "paired"), (CMD_REFERENCE, True, "paired_cmd")):  # fmt: skip
                if ref in task["methods"] and label != ref:
                    out.setdefault(key, {}).setdefault(ablation, {})[f"{label} - {ref}"] = (
                        paired_difference(
                            task, label, ref, ablation, fractions, n_boot, absolute=absolute
                        )  # fmt: skip
                    )
    return out


def goals(study: dict[str, Any]) -> dict[str, Any]:
    """Issue 29's goals per task under patching, for the study's default method (config
    "default_method"; the best CPR where absent): CPR >= 1.2 x the CPR reference's
    (eap-ig-5), CMD <= the CMD reference's (eap-noise), attribution CPU <= a quarter of the CPR reference's."""
    out: dict[str, Any] = {}
    wanted = study["config"].get("default_method")
    for name, task in study["tasks"].items():
        summary = task["summary"]
        best = summary["best_ra_lens"].get("patching")
        if best is None:
            continue
        method = wanted if wanted in task["methods"] else best
        row: dict[str, Any] = {"method": method, "best_cpr": best}
        cpr_pair = summary["paired"].get("patching", {}).get(f"{method} - {CPR_REFERENCE}")
        if cpr_pair is not None:
            row["cpr_ratio"] = cpr_pair["ratio"]
            row["cpr_ratio_met"] = cpr_pair["ratio"]["estimate"] >= CPR_RATIO_GOAL
            cpu = [task["methods"][m].get("cpu_seconds") for m in (method, CPR_REFERENCE)]
            if None not in cpu and cpu[1] > 0:
                row["cpu_share"] = cpu[0] / cpu[1]
                row["cpu_share_met"] = row["cpu_share"] <= CPU_SHARE_GOAL
        cmd_pair = summary.get("paired_cmd", {}).get("patching", {}).get(f"{method} - {CMD_REFERENCE}")  # fmt: skip
        if cmd_pair is not None:
            row["cmd_difference"] = cmd_pair["difference"]
            row["cmd_met"] = cmd_pair["difference"]["estimate"] <= 0
        out[name] = row
    return out


# --------------------------------------------------------------------------------------------
# reporting


def _ci(entry: dict[str, Any], digits: int = 3) -> str:
    if entry["estimate"] is None:
        return "n/a"
    return f"{entry['estimate']:.{digits}f} [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"


def markdown(study: dict[str, Any]) -> str:
    """The study's tables: per task x method CPR, CMD (95 % intervals), seconds, faithfulness at
    100/500/2,000 edges; the paired differences; the goals."""
    lines = _header(study)
    for ablation in study["config"]["ablations"]:
        lines += _ablation_tables(study, ablation)
    lines += _truth_table(study)
    lines += _jaccard_table(study)
    lines += _negative_scale_lines(study)
    if study.get("goals"):
        lines += _goal_lines(study["goals"])
    return "\n".join(lines)


def _header(study: dict[str, Any]) -> list[str]:
    """The paragraph saying how the study ran: model, selection, resamples, fractions, runtime."""
    cfg = study["config"]
    chosen = (
        "grown from the logits (`EdgeScores.greedy`) then pruned"
        if cfg.get("selection") == "greedy"
        else "top-n then pruned"
    )
    chosen += (
        ", n in EAP-IG's ungrouped edges; CPR from the signed ranking (largest score), CMD and "
        "f @ n edges from the |score| ranking (MIB's); faithfulness normalised by the empty "
        "circuit under the ablation"
    )
    return [
        f"Model {cfg['model']}, {cfg['device']}; {chosen}; edge patching "
        f"(`circuits.faithfulness`); {cfg['n_boot']} bootstrap resamples over pairs, 95 % "
        f"percentile intervals; fractions {', '.join(f'{100 * k:g}%' for k in cfg['fractions'])}"
        f" of the edges. {_scored_on(cfg)} CPU s: attribution only, CPU seconds of the process."
        f" Study ran {study['runtime_seconds']:.0f} s.",
        "",
    ]


def _ablation_tables(study: dict[str, Any], ablation: str) -> list[str]:
    """One ablation's table (task x method: CPR, CMD, CPU s, f at the edge counts) and its paired
    CPR and CMD differences."""
    counts = [str(c) for c in study["config"]["edge_counts"]]
    lines = [
        f"### Ablation: {ablation}",
        "",
        "| task (pairs) | method | CPR (higher better) | CMD (lower better) | CPU s | "
        + " | ".join(f"f @ {c} edges" for c in counts)
        + " |",
        "|---|---|---|---|---:|" + "---|" * len(counts),
    ]
    for name, task in study["tasks"].items():
        for label, entry in task["summary"]["methods"].items():
            if ablation not in entry:
                continue
            e = entry[ablation]
            at = [_ci(e["at_edges"][c], 2) if c in e["at_edges"] else "-" for c in counts]
            lines.append(
                f"| {name} ({_pair_counts(task)}) | {label} | {_ci(e['cpr'])} | {_ci(e['cmd'])}"
                f" | {_cpu(task['methods'][label])} | " + " | ".join(at) + " |"
            )
    lines.append("")
    for key, what in (("paired", "CPR"), ("paired_cmd", "CMD")):
        rows = [
            (name, pair, value)
            for name, task in study["tasks"].items()
            for pair, value in task["summary"].get(key, {}).get(ablation, {}).items()
        ]
        if rows:
            lines += [
                f"Paired {what} differences ({ablation}), same resamples:",
                "",
                f"| task | method - reference | {what} difference | {what} ratio |",
                "|---|---|---|---|",
            ]
            lines += [f"| {n} | {k} | {_ci(v['difference'])} | {_ci(v['ratio'], 2)} |" for n, k, v in rows]  # fmt: skip
            lines.append("")
    return lines


def _truth_table(study: dict[str, Any]) -> list[str]:
    """Pearson r of each method's head scores to head activation patching, per task that ran it
    (nothing where none did)."""
    truths = [(n, t["truth"]) for n, t in study["tasks"].items() if "truth" in t]
    if not truths:
        return []
    lines = [
        "Head scores (each head's outgoing edges summed) against head activation patching "
        "(denoise, hook_z, all positions), Pearson r:",
        "",
        "| task (pairs patched) | " + " | ".join(truths[0][1]["pearson"]) + " |",
        "|---|" + "---|" * len(truths[0][1]["pearson"]),
    ]
    for name, truth in truths:
        values = " | ".join(f"{r:.3f}" for r in truth["pearson"].values())
        lines.append(f"| {name} ({truth['pairs']}) | {values} |")
    lines.append("")
    return lines


def _jaccard_table(study: dict[str, Any]) -> list[str]:
    """Each method's bootstrap Jaccard (--refits) at MIB's submission sizes: the mean over
    pairs of resamples, signed ranking (CPR's circuits) / |score| ranking (CMD's)."""
    rows = [
        (name, label, result["jaccard"])
        for name, task in study["tasks"].items()
        for label, result in task["methods"].items()
        if "jaccard" in result
    ]
    if not rows:
        return []
    fractions = rows[0][2]["signed"]["fractions"]
    n_boot = rows[0][2]["signed"]["n_boot"]
    lines = [
        f"### Bootstrap Jaccard ({n_boot} resamples of the training pairs, each method run "
        "again on each; signed / |score| ranking; stable at >= 0.8)",
        "",
        "| task | method | " + " | ".join(f"{100 * k:g}%" for k in fractions) + " |",
        "|---|---|" + "---:|" * len(fractions),
    ]
    for name, label, jaccard in rows:
        cells = [
            f"{_number(s)} / {_number(a)}"
            for s, a in zip(jaccard["signed"]["pairwise"], jaccard["abs"]["pairwise"], strict=True)
        ]
        lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _negative_scale_lines(study: dict[str, Any]) -> list[str]:
    """The factor each calibrated method chose, where it chose it, and the CMD there of every
    candidate tried (`circuits.calibrate_negatives`; crossfit: the mean of both halves')."""
    where = {
        "train": "the training pairs",
        "apart": "the half of the training pairs its fit on the other half did not see",
        "crossfit": "both halves of the training pairs, each half's fit on the other half (mean CMD; the scores: the mean of the two fits)",
    }
    lines = [
        f"- {name}, {label}: negative scores x {scale['scale']:g}, chosen on "
        f"{where[scale.get('pairs', 'train')]} (CMD there "
        + ", ".join(f"x {c}: {v:.4f}" for c, v in scale["cmd"].items())
        + ")"
        for name, task in study["tasks"].items()
        for label, result in task["methods"].items()
        if (scale := result.get("negative_scale")) is not None
    ]
    return ["### Negative scales", "", *lines, ""] if lines else []


def _number(value: float | None) -> str:
    """A Jaccard for a table: "-" where every circuit of that size was pruned to nothing."""
    return "-" if value is None or value != value else f"{value:.2f}"


def _goal_lines(goals: dict[str, Any]) -> list[str]:
    """Issue 29's goals per task (`goals`), met or missed."""
    lines = ["### Goals (patching)", ""]
    for name, row in goals.items():
        parts = [f"method {row['method']} (best CPR: {row['best_cpr']})"]
        if "cpr_ratio" in row:
            met = "met" if row["cpr_ratio_met"] else "missed"
            parts.append(f"CPR / {CPR_REFERENCE} {_ci(row['cpr_ratio'], 2)} (>= {CPR_RATIO_GOAL}: {met})")  # fmt: skip
        if "cmd_difference" in row:
            met = "met" if row["cmd_met"] else "missed"
            parts.append(f"CMD - {CMD_REFERENCE} {_ci(row['cmd_difference'])} (<= 0: {met})")
        if "cpu_share" in row:
            met = "met" if row["cpu_share_met"] else "missed"
            parts.append(f"CPU / {CPR_REFERENCE} {row['cpu_share']:.2f} (<= {CPU_SHARE_GOAL}: {met})")  # fmt: skip
        lines.append(f"- {name}: " + "; ".join(parts))
    return lines


def _cpu(result: dict[str, Any]) -> str:
    """CPU seconds of the attribution; wall seconds in files written before they were kept."""
    if "cpu_seconds" in result:
        return f"{result['cpu_seconds']:.0f}"
    return f"{result['seconds']:.0f} (wall)"


def _scored_on(cfg: dict[str, Any]) -> str:
    if cfg.get("train_pairs", 0):
        return "Scores from the training pairs, measured on the held-out pairs (counts per task)."
    return "Scores from the measured pairs themselves."


def _pair_counts(task: dict[str, Any]) -> str:
    train = len(task.get("train_pairs", []))
    return f"{task['n_pairs']} held out, {train} train" if train else str(task["n_pairs"])
