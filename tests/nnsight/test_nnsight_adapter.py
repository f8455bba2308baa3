"""The nnsight adapter: what it finds in the HuggingFace modules, what it refuses (each with
the fix), and the model left exactly as found."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

# nnsight.modeling, not nnsight: with tests/ on sys.path, this folder itself imports as a
# namespace package "nnsight" where the real one is not installed.
pytest.importorskip(
    "nnsight.modeling",
    reason="nnsight 0.8.1 needs transformers >= 5: installed in .venv (TL 4) only",
)
import nnsight  # noqa: E402

import ra_lens  # noqa: E402
from ra_lens.metrics import target_nll  # noqa: E402
from ra_lens.nnsight import adapter, is_nnsight_model  # noqa: E402
from ra_lens.toy_models import hf_model, tiny_tokenizer_dir  # noqa: E402

TOKENS = torch.tensor([[0, 51, 28, 288, 75, 73, 90]])


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def wrapped(arch: str = "llama") -> tuple[Any, Any]:
    hf = hf_model(arch, spread=True)
    return nnsight.TransformersModel(hf, tokenizer=tokenizer()), hf


def state(hf: torch.nn.Module) -> tuple[Any, ...]:
    """Every module's mode, every parameter's requires_grad and .grad, every hook."""
    params = list(hf.parameters())
    hooks = [
        (name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for name, m in hf.named_modules()
    ]
    return (
        [m.training for m in hf.modules()],
        [p.requires_grad for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        hooks,
    )


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    grads_equal = all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[2], b[2])
    )
    return a[0] == b[0] and a[1] == b[1] and grads_equal and a[3] == b[3]


def unusual_state(hf: torch.nn.Module) -> None:
    """Train mode, some parameters frozen, some holding a .grad: all must come back."""
    hf.train()
    params = list(hf.parameters())
    params[0].requires_grad_(False)
    params[1].grad = torch.full_like(params[1], 0.25)


def test_finds_each_layers_attention_and_the_softmax_by_what_they_are() -> None:
    model, hf = wrapped("gpt_neo")  # attention wrapped in a GPTNeoAttention module
    assert is_nnsight_model(model) and not is_nnsight_model(hf)
    found = adapter.layout(model)
    assert found.attention_paths == [
        "transformer.h.0.attn.attention",
        "transformer.h.1.attn.attention",
    ]
    assert found.embed_path == "transformer.wte"
    path = adapter.softmax_path(model)
    assert "softmax" in path and adapter.layout(model).softmax_path == path  # found once


def test_the_model_is_left_exactly_as_found() -> None:
    model, hf = wrapped("gemma2")  # soft-capped: the softmax's input is read too
    unusual_state(hf)
    before = state(hf)
    logits_before = hf(TOKENS).logits.detach()
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows")
    assert ra.rows is not None and float(ra.norms.abs().sum()) > 0
    assert same(state(hf), before)
    assert torch.equal(hf(TOKENS).logits.detach(), logits_before)


def test_sdpa_attention_is_refused_naming_eager() -> None:
    model, hf = wrapped()
    hf.set_attn_implementation("sdpa")
    unusual_state(hf)
    before = state(hf)
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    assert same(state(hf), before)


def test_a_model_nnsight_wraps_but_ra_lens_cannot_read_is_refused() -> None:
    model = nnsight.NNsight(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="TransformersModel"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]))


@pytest.mark.parametrize(
    "metric",
    [
        lambda logits: logits[:, -1, 5].detach(),
        lambda logits: torch.tensor(float(logits[0, -1, 5])),
    ],
    ids=["detached", "item"],
)
def test_a_metric_that_does_not_reach_the_attention_is_refused(metric: Any) -> None:
    model, hf = wrapped()
    unusual_state(hf)
    before = state(hf)
    with pytest.raises(ValueError, match="no gradient path"):
        ra_lens.reversed_attention(model, TOKENS, metric)
    assert same(state(hf), before)
    # and the model still works afterwards
    ra = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms")
    assert float(ra.norms.sum()) > 0 and same(state(hf), before)


def test_a_metric_of_the_wrong_shape_is_refused() -> None:
    model, _ = wrapped()
    with pytest.raises(ValueError, match="one value per prompt"):
        ra_lens.reversed_attention(model, TOKENS, lambda logits: logits[:, -1, :3])


@pytest.mark.parametrize(
    ("layers", "error", "message"),
    [
        ([1, 0], ValueError, r"not in increasing order: pass \[0, 1\]"),
        ([0, 0], ValueError, "repeat a layer"),
        ([0, 7], ValueError, "out of range"),
        (1, TypeError, "sequence of ints"),
    ],
)
def test_layers_are_checked_as_the_transformer_lens_route_checks_them(layers, error, message):
    """One check (`checks.check_layers`): refused, never sorted or deduplicated in silence."""
    model, hf = wrapped()
    before = state(hf)
    with pytest.raises(error, match=message):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), layers=layers)
    assert same(state(hf), before)


def test_the_trace_module_imports_only_what_a_server_has() -> None:
    """ra_lens.nnsight._trace is shipped to servers without ra-lens: torch and the stdlib only."""
    import ast
    import sys

    from helpers import REPO_ROOT

    tree = ast.parse((REPO_ROOT / "ra_lens" / "nnsight" / "_trace.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported - {"__future__"} <= {"torch", *sys.stdlib_module_names}, imported


def test_language_model_the_deprecated_alias_works_too() -> None:
    hf = hf_model("llama", spread=True)
    with pytest.warns(Warning):
        model = nnsight.LanguageModel(hf, tokenizer=tokenizer())
    ours = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms")
    theirs = ra_lens.reversed_attention(wrapped()[0], TOKENS, target_nll([5]), keep="norms")
    assert torch.equal(ours.norms, theirs.norms) and float(ours.norms.sum()) > 0


def test_a_model_whose_trace_fails_is_refused_and_left_as_found() -> None:
    """A forward that fails inside nnsight's trace (here the LM head): one error naming what
    ra-lens reads, the cause kept, and the model as found."""
    model, hf = wrapped()

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this head cannot run")

    hf.lm_head.forward = broken
    unusual_state(hf)
    before = state(hf)
    with pytest.raises(RuntimeError, match="nnsight could not trace.*cannot run.*causal LM"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]))
    assert same(state(hf), before)
