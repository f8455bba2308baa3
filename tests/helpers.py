"""Test helpers shared by several test files: prompts, the tiny architectures the installed
TransformerLens offers (from `ra_lens.toy_models.ARCHITECTURES`), a model-state snapshot, and a toy
task whose prompts tokenize evenly on the tiny models.

Imported as `from helpers import ...` (pytest puts tests/ on sys.path: it has no __init__.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from ra_lens.models import bridge_available
from ra_lens.tasks import Task
from ra_lens.toy_models import ARCHITECTURES, tiny_model

#: The paper's Figure-1 prompt.
FLORENCE = "I like Italy and France. I visited the city of"
#: Three prompts of different token lengths (a right-padded batch), the last with a newline.
PROMPTS = ["I like Italy and France. I visited", "The quick brown fox jumps", "Q: hot\nA:"]
#: Architectures whose hook_attn_scores and hook_pattern are in the autograd graph (OPT delegates
#: attention to HuggingFace; boot_native's hook_attn_scores is a copy of the pattern).
LIVE = ("gpt2", "llama", "hooked")


def has_bridge() -> bool:
    """TransformerLens >= 3 (TransformerBridge) is installed."""
    return bridge_available()


def all_archs() -> list[str]:
    """Tiny architectures available under the installed TransformerLens: the bridge ones on
    TL 4, HookedTransformer ("hooked") on TL 2."""
    return [a for a in ARCHITECTURES if (a != "hooked") == has_bridge()]


def live_archs() -> list[str]:
    """all_archs() whose attention hooks are in the autograd graph."""
    return [a for a in all_archs() if a in LIVE]


def arch_or_hooked(bridge_arch: str) -> str:
    """`bridge_arch` under TL 4, "hooked" (HookedTransformer) under TL 2."""
    return bridge_arch if has_bridge() else "hooked"


def bridge_model(arch: str, **kwargs: Any) -> Any:
    """tiny_model(arch, **kwargs) for a TransformerBridge architecture; skips under TL 2."""
    pytest.importorskip("transformer_lens.model_bridge")
    return tiny_model(arch, **kwargs)


def hook_count(model: Any) -> tuple[int, int]:
    """(TransformerLens hooks on every hook point, PyTorch hooks on every module)."""
    points = sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())
    modules = sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
        for m in model.modules()
    )
    return points, modules


def snapshot(model: Any) -> tuple[Any, ...]:
    """Train/eval mode, requires_grad and .grad of every parameter, and the hook counts: what
    ra_lens must leave exactly as it was."""
    params = list(model.parameters())
    return (
        model.training,
        [p.requires_grad for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        hook_count(model),
    )


# --- the toy task -----------------------------------------------------------------------------

#: Word pairs whose input and answer are each one token (with its leading space) for the tiny
#: tokenizer of `tiny_model`, so every n-shot prompt of the task has the same token length.
TOY_PAIRS = [
    ("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"), ("s", "the"),
    ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "Ital"), ("is", "Fran"), ("to", "Jo"),
    ("an", "b"), ("and", "c"), ("the", "d"), ("cap", "l"), ("Par", "o"), ("Mar", "s"),
    ("Ital", "t"), ("Fran", "F"),
]  # fmt: skip
#: The toy task, for experiments and rankings on `tiny_model`.
TOY_TASK = Task(name="toy", pairs=TOY_PAIRS)
#: Prompts in the task's template, of different token lengths on purpose (padding must not
#: change a result); their corrupted twins swap the demonstrations' answers; TOY_TARGETS holds
#: one target token id per prompt.
TOY_CLEAN = [
    "Q: b\nA: of\n\nQ: c\nA: is\n\nQ: d\nA:",
    "Q: c\nA: is\n\nQ: d\nA: to\n\nQ: b\nA:",
    "Q: the city of\nA:",
]
TOY_CORRUPTED = [
    "Q: b\nA: is\n\nQ: c\nA: of\n\nQ: d\nA:",
    "Q: c\nA: to\n\nQ: d\nA: is\n\nQ: b\nA:",
    "Q: the city to\nA:",
]
TOY_TARGETS = [5, 6, 7]


def dropout_model() -> Any:
    """A tiny float64 model in train mode whose forward pass is random unless every module is in
    eval mode: under TL 4 a GPT-2 bridge with dropout 0.3 (residual, embedding, attention; the
    embedding dropout lives only in the HuggingFace model the bridge wraps). TransformerLens 2's
    HookedTransformer has no dropout modules at all, so under TL 2 it is the plain tiny
    HookedTransformer in train mode (only the mode bookkeeping is then tested)."""
    import torch

    if has_bridge():
        model = tiny_model("gpt2", dtype=torch.float64, dropout=0.3)
    else:
        model = tiny_model("hooked", dtype=torch.float64)
    return model.train()


def module_modes(model: Any) -> list[tuple[str, bool]]:
    """(name, training) of every module the forward pass uses, a bridge's HuggingFace modules
    (`model.original_model`) included."""
    import torch

    modes = [(f"bridge.{n}", m.training) for n, m in model.named_modules()]
    hf = getattr(model, "original_model", None)
    if isinstance(hf, torch.nn.Module):
        modes += [(f"hf.{n}", m.training) for n, m in hf.named_modules()]
    return modes


# --- the circuit page ---------------------------------------------------------------------------

#: Clean/corrupted pairs the tiny tokenizer takes (one-token answers, equal token lengths).
PAGE_PAIRS = [
    ("I like Italy", "I like Paris", " and", " the"),
    ("I like Paris", "I like Italy", " the", " and"),
    ("The capital of Italy is", "The capital of Paris is", " the", " and"),
]


def page_setup() -> Any:
    """What a circuit page is built from, on a tiny model (Llama with grouped-query attention
    under TL 4, HookedTransformer under TL 2): the pairs, "exact" edge scores, their faithfulness
    curve at MIB's fractions and a 12-edge circuit with its faithfulness."""
    from types import SimpleNamespace

    from ra_lens import circuits
    from ra_lens.tasks.ioi import PromptPair, paired_batch

    model = tiny_model(arch_or_hooked("llama"))
    pairs = [PromptPair(*p) for p in PAGE_PAIRS]
    clean, corrupted, metric = paired_batch(model, pairs)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric)
    circuit = scores.top(12)
    kept = circuits.faithfulness(model, circuit, clean, corrupted, metric)
    return SimpleNamespace(
        model=model, pairs=pairs, clean=clean, corrupted=corrupted, metric=metric,
        scores=scores, curve=curve, circuit=circuit, faithfulness=kept.value,
    )  # fmt: skip
