"""Regenerate the README's figures into docs/figures/ (`make figures`).

    python docs/make_figures.py                     # every figure; the ranking study from its JSON
    python docs/make_figures.py --only figure1      # a subset: figure1, patching, ranking

Everything runs on the embedded SmolLM2-135M-Instruct on the CPU, through the public API only:

- figure1_top_heads.png, head_norms.png: RA of the paper's Figure-1 prompt ("I like Italy and
  France. I visited the city of" -> " Florence"), the 3 heads with the largest RA norm beside their
  forward attention, and RA norms beside forward-pattern norms for all 270 heads (seconds).
- antonym_scale_sweep.png: `experiments.attention_patching(model, "antonym", shots=0,
  n_prompts=25)`, the README's patching table (about 2 minutes); its numbers go to
  antonym_patching.json beside it.
- ranking_study_auc.png, ranking_study_curves.png: the head-ranking study (every ranking, 4
  tasks x 0/5 shots x zero/mean ablation) read from docs/results/ranking_study.json, which
  `python -m ra_lens.experiments.ranking_study` writes (README: how it ran, on a GPU); no model.
- discover_study.png: `circuits.discover` against eap-ig-5 (EAP-IG-inputs) on held-out pairs, read
  from docs/results/circuit_study_cv_*.json (the circuit study with `--methods
  eap-ig-5,mask-scaled-cv`; docs/results/circuit-study.md); no model.
- circuit_page.png: the page of `ra-lens circuit --html` for IOI (4 pairs, "exact" edge scores,
  the faithfulness curve at MIB's fractions, a 150-edge circuit), one head open, screenshot by
  headless Chromium (`tests/browser.py`; a few minutes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "figures"
PROMPT = "I like Italy and France. I visited the city of"
TARGET = " Florence"
STUDY_JSON = Path(__file__).resolve().parent / "results" / "ranking_study.json"
#: The rankings the curve figure draws (all twelve are in the heat map).
CURVE_RANKINGS = ("ra", "ra_temperature", "causal_mediation", "cm_first_order", "random")
FIGURES = ("figure1", "patching", "ranking", "circuit", "discover", "page")


def figure1(model: Any, out: Path) -> list[Path]:
    """RA beside forward attention for the top heads, and the head-norm heat maps."""
    import ra_lens
    from ra_lens import metrics, viz

    target = model.to_tokens(TARGET, prepend_bos=False)[0, 0]
    ra = ra_lens.reversed_attention(model, PROMPT, metrics.target_nll([target]))
    print(
        "top heads (layer, head, RA norm):", [(la, h, round(v, 4)) for la, h, v in ra.top_heads(3)]
    )
    paths = [out / "figure1_top_heads.png", out / "head_norms.png"]
    viz.top_heads_grid(ra, k=3, save=paths[0])
    viz.head_norm_heatmaps(ra, save=paths[1])
    return paths


def patching(model: Any, out: Path) -> list[Path]:
    """The zero-shot antonym scale sweep, RA against the forward-pattern baseline."""
    from ra_lens.experiments import attention_patching

    result = attention_patching(model, "antonym", shots=0, n_prompts=25)
    print(result.table())
    result.save(out / "antonym_patching.json")
    path = out / "antonym_scale_sweep.png"
    result.plot(save=path)
    return [path]


def ranking(out: Path) -> list[Path]:
    """The head-ranking study from its JSON: an AUC heat map (rankings x cells) and the ablation
    curves of the two 5-shot cells where the unablated model is right most often."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = json.loads(STUDY_JSON.read_text())
    # A cell whose unablated top-1 is 0 cannot rank anything by top-1: left out, and said so.
    cells = [c for c in data["cells"] if c["unablated"]["top1"] > 0]
    dropped = sorted(
        {f"{c['task']} {c['shots']}-shot" for c in data["cells"]}
        - {f"{c['task']} {c['shots']}-shot" for c in cells}
    )
    names = data["config"]["rankings"]
    auc = np.full((len(names), len(cells)), np.nan)
    for j, cell in enumerate(cells):
        for i, name in enumerate(names):
            if name in cell["rankings"]:
                auc[i, j] = cell["rankings"][name]["auc"]
    fig, ax = plt.subplots(figsize=(1.0 * len(cells) + 3, 0.42 * len(names) + 2.2))
    image = ax.imshow(auc, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for i in range(len(names)):
        for j in range(len(cells)):
            if not np.isnan(auc[i, j]):
                best = auc[i, j] == np.nanmax(auc[:, j])
                ax.text(j, i, f"{auc[i, j]:.2f}", ha="center", va="center", fontsize=7.5,
                        color="black" if auc[i, j] > 0.55 else "white",
                        fontweight="bold" if best else "normal")  # fmt: skip
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(
        [
            f"{c['task']}\n{c['shots']}-shot {c['ablation']}\n"
            f"n={c['n_test']}, top-1 {c['unablated']['top1']:.0%}"
            for c in cells
        ],
        fontsize=7,
    )
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_title(
        "Head rankings on SmolLM2-135M: AUC of top-1 accuracy keeping the top p% of heads "
        "(bold: best in its column; blank: zero-shot, no labels to shuffle)\n"
        f"left out, unablated top-1 = 0: {', '.join(dropped)}",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.025, pad=0.01, label="AUC top-1")
    fig.tight_layout()
    heat = out / "ranking_study_auc.png"
    fig.savefig(heat, dpi=140)
    plt.close(fig)

    shown = [c for c in cells if (c["task"], c["shots"]) in (("antonym", 5), ("present-past", 5))]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey=True)
    for ax, cell in zip(axes.T.flat, shown, strict=True):  # one task per column
        for k, name in enumerate(CURVE_RANKINGS):
            entry = cell["rankings"][name]
            ci = entry["intervals"]["auc"]
            ax.plot(
                cell["fractions"],
                entry["curve"],
                label=f"{name} {entry['auc']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}]",
                linestyle=("-", "--", ":", "-.")[k % 4],
                marker="os^vD"[k % 5],
                markersize=3.5,
                linewidth=2.2 if name in ("ra", "causal_mediation") else 1.2,
            )
        ax.set_title(
            f"{cell['task']} {cell['shots']}-shot, {cell['ablation']} ablation "
            f"({cell['n_test']} test prompts)",
            fontsize=9,
        )
        ax.set_xlabel("fraction of heads kept (top-ranked first)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best", title="AUC top-1 [95% CI]", title_fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("top-1 accuracy")
    fig.tight_layout()
    curves = out / "ranking_study_curves.png"
    fig.savefig(curves, dpi=130)
    plt.close(fig)
    return [heat, curves]


CIRCUIT_JSON = Path(__file__).resolve().parent / "results" / "circuit_study.json"


def _saved(fig: Any, path: Path, dpi: int) -> Path:
    """Lay out, write and close a pyplot figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def circuit_study(out: Path, source: Path = CIRCUIT_JSON) -> list[Path]:
    """The circuit study from its JSON (`python -m ra_lens.experiments.circuit_study`): faithfulness
    against edges kept, one line per method with its 95 % bootstrap band, one panel per task and
    ablation; no model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    data = json.loads(Path(source).read_text())
    tasks = list(data["tasks"])
    ablations = data["config"]["ablations"]
    order = list(data["config"]["methods"])
    fig, axes = plt.subplots(
        len(ablations), len(tasks), figsize=(4.6 * len(tasks), 4.6 * len(ablations)),
        sharey=True, squeeze=False,
    )  # fmt: skip
    for col, name in enumerate(tasks):
        task = data["tasks"][name]
        shown = [i for i, n in enumerate(task["sizes"]) if n > 0]  # log axis: no empty circuit
        x = [task["sizes"][i] for i in shown]
        for row, ablation in enumerate(ablations):
            ax = axes[row, col]
            for label, entry in task["summary"]["methods"].items():
                k = order.index(label)  # one colour and style per method in every panel
                if ablation not in entry:
                    continue
                e = entry[ablation]
                cpr, cmd = e["cpr"], e["cmd"]
                # the signed ranking's curve, whose area is MIB's CPR (CMD: the |score| ranking's)
                ax.plot(
                    x, [e["signed_faithfulness"][i] for i in shown],
                    label=f"{label}: CPR {cpr['estimate']:.2f} [{cpr['low']:.2f}, {cpr['high']:.2f}], CMD {cmd['estimate']:.3f}",
                    linestyle=("-", "--", ":", "-.")[k % 4], marker="os^vDx"[k % 6], markersize=3,
                    linewidth=1.4, color=f"C{k}",
                )  # fmt: skip
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.axhline(0.0, color="grey", lw=0.8, ls=":")
            if not ax.lines[:-2]:  # this task was not run under this ablation
                ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="grey")
            ax.set_xscale("log")
            ax.set_xlim(min(x) / 1.25, max(x) * 1.25)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(-0.6, 2.6)
            held, train = task["n_pairs"], len(task.get("train_pairs", []))
            ax.set_title(f"{name} ({held} held-out pairs, {train} train), {ablation}", fontsize=9)
            chosen = "greedy" if data["config"].get("selection") == "greedy" else "top-n"
            ax.set_xlabel(
                f"edges kept ({chosen} by score, pruned; of {task['n_edges_total']:,} ungrouped)"
            )
            ax.grid(alpha=0.3)
            if ax.lines[:-2]:
                ax.legend(  # below the panel: the curves fill the upper left
                    fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1,
                    title="CPR with 95% bootstrap interval", title_fontsize=7,
                )  # fmt: skip
    for ax in axes[:, 0]:
        ax.set_ylabel("faithfulness")
    fig.suptitle(
        f"Circuit faithfulness on {data['config']['model']}, MIB's signed ranking (edge patching)",
        fontsize=10,
    )
    return [_saved(fig, out / "circuit_study.png", dpi=130)]


#: The held-out study of `circuits.discover` (label mask-scaled-cv): (title, JSON) per panel column.
DISCOVER_JSONS = (
    ("SmolLM2 IOI", "circuit_study_cv_ioi.json"),
    ("SmolLM2 country-capital", "circuit_study_cv_country-capital.json"),
    ("SmolLM2 antonym", "circuit_study_cv_antonym.json"),
    ("Gemma-3-270M IOI", "circuit_study_cv_gemma3_ioi.json"),
    ("Gemma-3-270M antonym", "circuit_study_cv_gemma3_antonym.json"),
    ("SmolLM2 IOI, other pairs (seed 7)", "circuit_study_cv_ioi_seed7.json"),
)
DISCOVER_LABELS = {"eap-ig-5": "eap-ig-5 (EAP-IG-inputs)", "mask-scaled-cv": "circuits.discover"}


def discover_study(out: Path) -> list[Path]:
    """`circuits.discover` against eap-ig-5 on held-out pairs: the signed ranking's faithfulness
    (area: CPR) in the top row, |1 - f| of the |score| ranking (area: CMD, 95 % bootstrap band of
    f) in the bottom row, one column per model and task; no model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(DISCOVER_JSONS), figsize=(4.2 * len(DISCOVER_JSONS), 8.6))
    for col, (title, name) in enumerate(DISCOVER_JSONS):
        data = json.loads((CIRCUIT_JSON.parent / name).read_text())
        (task,) = data["tasks"].values()
        x = [n / task["n_edges_total"] for n in task["sizes"]]
        for k, (label, shown) in enumerate(DISCOVER_LABELS.items()):
            e = task["summary"]["methods"][label]["patching"]
            cpr, cmd = e["cpr"], e["cmd"]
            style = {"color": f"C{k}", "marker": "os"[k], "markersize": 3, "linewidth": 1.4}
            axes[0, col].plot(
                x, e["signed_faithfulness"], **style,
                label=f"{shown}: CPR {cpr['estimate']:.2f} [{cpr['low']:.2f}, {cpr['high']:.2f}]",
            )  # fmt: skip
            gap = [abs(1 - v) for v in e["faithfulness"]]
            axes[1, col].plot(
                x, gap, **style,
                label=f"{shown}: CMD {cmd['estimate']:.3f} [{cmd['low']:.3f}, {cmd['high']:.3f}]",
            )  # fmt: skip
            # |1 - f| over f's interval: 0 where the interval holds 1
            low = [0.0 if lo <= 1 <= hi else min(abs(1 - lo), abs(1 - hi)) for lo, hi in zip(e["low"], e["high"])]  # fmt: skip
            high = [max(abs(1 - lo), abs(1 - hi)) for lo, hi in zip(e["low"], e["high"])]
            axes[1, col].fill_between(x, low, high, color=f"C{k}", alpha=0.15, linewidth=0)
        held, train = task["n_pairs"], len(task["train_pairs"])
        axes[0, col].set_title(f"{title} ({train} train, {held} held-out pairs)", fontsize=9)
        axes[0, col].axhline(1.0, color="grey", lw=0.8, ls=":")
        for ax in axes[:, col]:
            ax.set_xlabel("fraction of the ungrouped edges kept", fontsize=8)
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    axes[0, 0].set_ylabel("f, signed ranking (area: CPR, higher better)")
    axes[1, 0].set_ylabel("|1 - f|, |score| ranking (area: CMD, lower better)")
    fig.suptitle(
        "circuits.discover against EAP-IG-inputs on held-out pairs, MIB's units (edge patching, "
        "per query-head copy); areas over the linear fraction axis, drawn on a log axis",
        fontsize=10,
    )
    return [_saved(fig, out / "discover_study.png", dpi=120)]


def circuit_page(model: Any, out: Path) -> list[Path]:
    """A screenshot of the circuit page, as `ra-lens circuit --html` writes it, with the head of
    the largest |node score| in the circuit open (found through the page's search box)."""
    import sys
    import tempfile

    from ra_lens import circuits
    from ra_lens.tasks import ioi

    # the headless browser lives with the tests (tests/browser.py), outside the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from browser import console_errors, headless_chromium, open_page

    pairs = ioi.usable(model, ioi.ioi_pairs(40))[:4]
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric)
    circuit = scores.top(150)
    kept = circuits.faithfulness(model, circuit, clean, corrupted, metric)
    page = scores.to_html(
        curve=curve, circuit=circuit, faithfulness=kept.value, model=model, clean=clean,
        metric=metric, title=f"smollm2-135m: exact circuits, {len(pairs)} IOI pairs",
    )  # fmt: skip
    graph = scores.graph
    node = scores.scores.mul(graph.real).sum(1).abs()
    heads = [n for n in circuit.nodes if n.startswith("a")]
    head = max(heads, key=lambda n: float(node[graph.writer_index[n]]))
    path = out / "circuit_page.png"
    with tempfile.TemporaryDirectory() as folder, headless_chromium(1500, 1000) as driver:
        open_page(driver, page.save(Path(folder) / "page.html"))
        box = driver.find_element("id", "search")
        box.send_keys(head + "\n")  # selects the head and scrolls it into view
        errors = console_errors(driver)
        if errors:
            raise RuntimeError(f"the page logged errors: {errors}")
        driver.save_screenshot(str(path))
    print(f"circuit page: {circuit.n_edges} edges, faithfulness {kept.value:.3f}, head {head}")
    return [path]


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import ra_lens

    without_model = {"ranking", "circuit", "discover"}
    model = ra_lens.load_model(device="cpu") if set(args.only) - without_model else None
    paths: list[Path] = []
    for name in args.only:
        start = time.perf_counter()
        if name == "figure1":
            paths += figure1(model, args.out)
        elif name == "patching":
            paths += patching(model, args.out)
        elif name == "circuit":
            paths += circuit_study(args.out)
        elif name == "discover":
            paths += discover_study(args.out)
        elif name == "page":
            paths += circuit_page(model, args.out)
        else:
            paths += ranking(args.out)
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    for path in paths:
        print("wrote", path)
    return paths


if __name__ == "__main__":
    main()
