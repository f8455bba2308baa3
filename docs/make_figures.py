"""Regenerate the README's figures into docs/figures/ (`make figures`).

    python docs/make_figures.py                     # every figure; the ranking from its JSON
    python docs/make_figures.py --only figure1      # a subset: figure1, patching, ranking
    python docs/make_figures.py --rerun-ranking     # recompute docs/figures/head_ranking_antonym.json

Everything runs on the embedded SmolLM2-135M-Instruct on the CPU, through the public API only:

- figure1_top_heads.png, head_norms.png: RA of the paper's Figure-1 prompt ("I like Italy and
  France. I visited the city of" -> " Florence"), the 3 heads with the largest RA norm beside their
  forward attention, and RA norms beside forward-pattern norms for all 270 heads (seconds).
- antonym_scale_sweep.png: `experiments.attention_patching(model, "antonym", shots=0,
  n_train=25)`, the README's patching table (about 2 minutes); its numbers go to
  antonym_patching.json beside it.
- ablation_curves_top1.png, ablation_curves_top3.png: the head-ranking experiment in a SMALL
  configuration (RANKING below: rankings from 5 prompts instead of the README table's 25, and
  without the RA loss-row and activation-patching rankings; accuracy on the full 28-prompt test
  split), read from the committed head_ranking_antonym.json; `--rerun-ranking` recomputes it
  (58 minutes on the shared 2-core VM: 30 min causal-mediation scan, 26 min ablation curves).
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
#: The small head-ranking configuration the ablation-curve figures show (see the module doc).
RANKING: dict[str, Any] = {
    "task": "antonym",
    "shots": 5,
    "n_prompts": 5,
    "batch_size": 5,  # one forward pass per head for the causal-mediation scan
    "rankings": ["ra", "forward", "random", "layer", "causal_mediation", "attribution_patching"],
}
RANKING_JSON = "head_ranking_antonym.json"
LABELS = {
    "ra": "RA norm",
    "forward": "forward-pattern norm",
    "random": "random",
    "layer": "layer index",
    "causal_mediation": "causal mediation",
    "attribution_patching": "attribution patching",
}
FIGURES = ("figure1", "patching", "ranking")


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

    result = attention_patching(model, "antonym", shots=0, n_train=25)
    print(result.table())
    result.save_json(out / "antonym_patching.json")
    path = out / "antonym_scale_sweep.png"
    result.plot(save=path)
    return [path]


def ranking(model: Any, out: Path, rerun: bool) -> list[Path]:
    """Ablation curves of the small head-ranking run (from its JSON unless `rerun`)."""
    from ra_lens import viz

    source = out / RANKING_JSON
    if rerun or not source.exists():
        from ra_lens.experiments import head_ranking

        result = head_ranking(model, **RANKING)
        print(result.table())
        data = result.to_dict()
        data["configuration"] = dict(RANKING)
        source.write_text(json.dumps(data, indent=2))
    data = json.loads(source.read_text())
    where = (
        f"{data['task']} {data['shots']}-shot, rankings from {data['n_prompts']} prompts, "
        f"{data['n_test']} test prompts"
    )
    paths = []
    for k, key in ((1, "curve"), (3, "curve_top3")):
        path = out / f"ablation_curves_top{k}.png"
        fig = viz.ablation_curves(
            data["fractions"],
            {LABELS.get(name, name): r[key] for name, r in data["rankings"].items()},
            ylabel=f"top-{k} accuracy (unablated {data['unablated'][f'top{k}']:.0%})",
            title=f"Keeping only the top-ranked heads\n{where}",
        )
        # Most curves sit on top of each other at 0 until half the heads are kept: vary the
        # dash and marker so that every one stays visible.
        ax = fig.axes[0]
        for i, line in enumerate(ax.get_lines()):
            line.set_linestyle(("-", "--", ":", "-.")[i % 4])
            line.set_marker(("o", "s", "^", "D", "v", "x")[i % 6])
        ax.legend(fontsize=8, frameon=True, framealpha=0.85)
        fig.savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.1)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES))
    parser.add_argument(
        "--rerun-ranking", action="store_true", help=f"recompute {RANKING_JSON} (slow)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import ra_lens

    model = ra_lens.load_model(device="cpu")
    paths: list[Path] = []
    for name in args.only:
        start = time.perf_counter()
        if name == "figure1":
            paths += figure1(model, args.out)
        elif name == "patching":
            paths += patching(model, args.out)
        else:
            paths += ranking(model, args.out, args.rerun_ranking)
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    for path in paths:
        print("wrote", path)
    return paths


if __name__ == "__main__":
    main()
