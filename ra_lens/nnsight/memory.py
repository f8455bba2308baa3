"""Peak memory of `reversed_attention(..., keep="norms")` through nnsight: the formula of
docs/nnsight_memory.md, and its check against a measured peak on CPU.

nnsight runs the whole model forward and backward in one trace (it cannot re-run one block, so
ra-lens's memory="layerwise" is not available there); the peak is the weights, what autograd
saves for the backward pass (the model's parameters frozen, the embedding output requiring
grad), and the attention weights' gradient of every chosen layer, which the trace holds until
the backward pass ends.

`python -m ra_lens.nnsight.memory` prints the table of the page; `--measure` measures the
peak on SmolLM2 on CPU and prints it beside the formula.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder: layers, d_model, query heads, head size, MLP width, vocabulary,
    parameter count."""

    layers: int
    d_model: int
    heads: int
    d_head: int
    d_mlp: int
    vocab: int
    params: float


LLAMA_31_8B = Shape(32, 4096, 32, 128, 14336, 128256, 8.03e9)
LLAMA_31_70B = Shape(80, 8192, 64, 128, 28672, 128256, 70.6e9)
SMOLLM2_135M = Shape(30, 576, 9, 64, 1536, 49152, 134.5e6)


def peak_bytes(shape: Shape, tokens: int, dtype_bytes: int = 2) -> dict[str, float]:
    """The terms of the peak, in bytes, for one prompt of `tokens` tokens, all layers.

    weights: params x b. saved: per layer, what autograd keeps for the backward pass of an
    eager Llama layer with frozen weights: q and k (for QK^T) and v (for A V), each
    tokens x heads x d_head x b (grouped keys/values are expanded before the products); the two
    RMSNorms' float32 inputs (2 x tokens x d_model x 4); the MLP's gate and up projections and
    SiLU(gate) (3 x tokens x d_mlp x b). attention: per layer the softmax output in float32
    (heads x tokens^2 x 4) plus, below float32, its copy in the model's dtype (x b). grads: the
    gradient of every layer's attention weights (heads x tokens^2 x b), held by the trace until
    the backward pass ends. logits: tokens x vocab x b. reduce: one layer's float32 reduction
    (A, R and the map: 3 x heads x tokens^2 x 4).
    """
    b, t, s = dtype_bytes, tokens, shape
    attention_elems = s.heads * t * t
    per_layer_linear = t * (3 * s.heads * s.d_head * b + 2 * s.d_model * 4 + 3 * s.d_mlp * b)
    per_layer_attention = attention_elems * (4 + (b if b != 4 else 0))
    terms = {
        "weights": s.params * b,
        "saved": s.layers * per_layer_linear,
        "attention": s.layers * per_layer_attention,
        "grads": s.layers * attention_elems * b,
        "logits": t * s.vocab * b,
        "reduce": 3 * attention_elems * 4,
    }
    terms["total"] = sum(terms.values())
    return terms


def longest_prompt(shape: Shape, memory_bytes: float, dtype_bytes: int = 2) -> int:
    """The most tokens whose peak (`peak_bytes`) fits `memory_bytes`."""
    low, high = 0, 1 << 20
    while low < high:
        mid = (low + high + 1) // 2
        if peak_bytes(shape, mid, dtype_bytes)["total"] <= memory_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def measure(tokens: int) -> dict[str, float]:
    """Peak resident memory added by one keep="norms" call on SmolLM2 (float32, CPU), in a
    process of its own: RSS before the call (after a warm-up call at 8 tokens) against the
    process's high-water mark after it (`resource.getrusage`). Run with
    MALLOC_MMAP_THRESHOLD_=65536 so glibc returns freed tensors to the system (else freed
    memory stays resident and hides part of the peak)."""
    import resource

    import nnsight
    import torch

    from ra_lens import models
    from ra_lens.core import reversed_attention
    from ra_lens.metrics import target_nll

    hf, tok = models.load_hf(models.smollm2_hf_dir(), torch.float32)
    model = nnsight.TransformersModel(hf, tokenizer=tok)
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    reversed_attention(model, ids[:, :8], target_nll([5]), keep="norms")
    with open("/proc/self/statm") as handle:
        before = int(handle.read().split()[1]) * resource.getpagesize()
    reversed_attention(model, ids, target_nll([5]), keep="norms")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    formula = peak_bytes(SMOLLM2_135M, tokens, 4)
    return {
        "tokens": tokens,
        "measured_bytes": peak - before,
        "formula_bytes": formula["total"] - formula["weights"],
    }


def table() -> list[dict[str, float | str | int]]:
    rows = []
    for name, shape in (("Llama-3.1-8B", LLAMA_31_8B), ("Llama-3.1-70B", LLAMA_31_70B)):
        for tokens in (1024, 8192):
            terms = peak_bytes(shape, tokens, 2)
            row: dict[str, float | str | int] = {"model": name, "tokens": tokens}
            rows.append(row | {k: v / GB for k, v in terms.items()})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--measure", type=int, nargs="*", help="token counts to measure")
    args = parser.parse_args()
    if args.measure:
        for tokens in args.measure:
            print(json.dumps(measure(tokens)))
    else:
        for row in table():
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            )
        for name, shape in (("8B", LLAMA_31_8B), ("70B", LLAMA_31_70B)):
            for gb in (80, 141, 8 * 80, 8 * 141):
                print(name, gb, "GB:", longest_prompt(shape, gb * GB), "tokens")
