"""Why RA's norm misses heads: for each cell of a saved ranking study, causal mediation's (and its
first-order estimate's) top-10 heads, where RA's norm ranks them, and how saturated each head's
attention row at the loss position is (mean over the cell's ranking prompts of its largest weight).

    python benchmarks/ranking_saturation.py docs/results/ranking_study.json \
        > docs/results/ranking_study/saturation.json
"""

import json
import sys

import torch

from ra_lens import capture
from ra_lens import ranking as rk
from ra_lens.capture import PATTERN
from ra_lens.models import load_model
from ra_lens.tasks import task_prompts


def last_row_max(model, texts: list[str]) -> torch.Tensor:
    """Float[Tensor, "layer head"]: mean over prompts of max_k A[last, k]."""
    shape = capture.model_shape(model)
    batch = capture.to_batch(model, texts)
    out = torch.zeros(shape.n_layers, shape.n_heads)

    def record(layer: int):
        def hook(pattern, hook):
            rows = pattern[torch.arange(pattern.shape[0]), :, batch.lengths - 1]  # [batch head key]
            out[layer] = rows.max(-1).values.float().mean(0).cpu()

        return hook

    hooks = [(PATTERN.format(la), record(la)) for la in range(shape.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(batch.tokens)
    return out


def main(paths: list[str]) -> dict:
    model = load_model(device="cpu")
    report = {}
    for path in paths:
        for cell in json.loads(open(path).read())["cells"]:
            train, _ = task_prompts(model, cell["task"], cell["shots"], seed=42)
            maxes = last_row_max(model, [p.text for p in train[: cell["n_prompts"]]])
            scores = cell["rankings"]
            ra = torch.tensor(scores["ra"]["scores"])
            ra_rank = {h: i + 1 for i, h in enumerate(rk.head_order(ra))}
            entry = {
                "spearman_ra_norm_vs_one_minus_last_row_max": rk.spearman(ra, 1 - maxes),
                "median_last_row_max": float(maxes.median()),
            }
            for ref in ("causal_mediation", "cm_first_order", "ra"):
                if ref in scores:
                    top = rk.head_order(torch.tensor(scores[ref]["scores"]))[:10]
                    entry[f"top10_{ref}"] = [
                        {
                            "head": list(h),
                            "ra_rank": ra_rank[h],
                            "last_row_max": round(float(maxes[h]), 3),
                        }
                        for h in top
                    ]
            report[f"{cell['task']} {cell['shots']}-shot {cell['ablation']}"] = entry
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
