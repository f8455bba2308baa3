"""remote="local": the request nnsight's RemoteBackend would send to NDIF, run in a fresh process
that cannot import ra_lens, equals the local run; remote=True builds that same request and
refuses, before any network call, what NDIF cannot run. (No network here: what only NDIF can
show is said in the README.)"""

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
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError  # noqa: E402

import ra_lens  # noqa: E402
from ra_lens.metrics import target_nll  # noqa: E402
from ra_lens.nnsight import remote  # noqa: E402
from ra_lens.toy_models import hf_model, tiny_tokenizer_dir  # noqa: E402

TOKENS = torch.tensor([[0, 51, 28, 288, 75, 73, 90]])
RTOL = 1e-5


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def gqa_toy() -> tuple[Any, Any]:
    """The toy Llama: 4 query heads sharing 2 key/value heads."""
    hf = hf_model("llama", spread=True).float()
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads
    return nnsight.TransformersModel(hf, tokenizer=tokenizer()), hf


def state(hf: torch.nn.Module) -> list[Any]:
    return [hf.training] + [(p.requires_grad, p.grad) for p in hf.parameters()]


def assert_same(got: Any, ref: Any, keep: str) -> None:
    assert torch.allclose(got.norms, ref.norms, rtol=RTOL, atol=0)
    assert float(ref.norms.abs().max()) > 0
    assert torch.allclose(got.metric_values, ref.metric_values, rtol=RTOL)
    assert torch.allclose(got.pattern_norms, ref.pattern_norms, rtol=RTOL)
    if keep == "rows":
        assert got.rows is not None and torch.allclose(got.rows, ref.rows, rtol=RTOL, atol=1e-9)
    if keep == "maps":
        assert got.maps is not None and torch.allclose(got.maps, ref.maps, rtol=RTOL, atol=1e-9)
    # Only what keep asks for comes back: no maps for norms/rows.
    assert (got.maps is None) == (keep != "maps") and (got.rows is None) == (keep != "rows")


@pytest.mark.slow  # starts a fresh Python server process (20-50 s)
@pytest.mark.parametrize("keep", ["norms", "rows", "maps"])
def test_remote_local_equals_the_local_run_on_a_gqa_toy(keep: str) -> None:
    model, hf = gqa_toy()
    hf.train()
    before = state(hf)
    ref = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep=keep)
    got = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep=keep, remote="local")
    assert_same(got, ref, keep)
    assert state(hf) == before


@pytest.mark.real_model
@pytest.mark.parametrize("keep", ["norms", "rows"])
def test_remote_local_equals_the_local_run_on_smollm2(keep: str) -> None:
    """Two right-padded prompts: the metric's lengths and the padding mask travel too."""
    from ra_lens import models
    from ra_lens.metrics import logit_diff

    hf, tok = models.load_hf(models.smollm2_hf_dir(), torch.float32)
    model = nnsight.TransformersModel(hf, tokenizer=tok)
    prompts = ["The capital of France is", "Paris is in"]
    paris, rome = (
        int(tok(w, add_special_tokens=False)["input_ids"][0]) for w in (" Paris", " Rome")
    )
    metric = logit_diff([paris, rome], [rome, paris])
    ref = ra_lens.reversed_attention(model, prompts, metric, keep=keep, layers=[0, 5, 29])
    got = ra_lens.reversed_attention(
        model, prompts, metric, keep=keep, layers=[0, 5, 29], remote="local"
    )
    assert_same(got, ref, keep)


@pytest.mark.slow  # starts a fresh Python server process (20-50 s)
def test_the_server_process_cannot_import_ra_lens() -> None:
    """Without ra-lens shipped by value the request needs ra_lens by reference, and the server
    process refuses it, as NDIF would (ra-lens is not installed there)."""
    model, _ = gqa_toy()
    original = remote.shipped_by_value
    try:
        remote.shipped_by_value = lambda: __import__("contextlib").nullcontext()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="No module named 'ra_lens"):
            ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms", remote="local")
    finally:
        remote.shipped_by_value = original


def test_remote_true_without_an_api_key_names_how_to_set_it(monkeypatch: Any) -> None:
    model, hf = gqa_toy()
    before = state(hf)
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", None)
    sent: list[Any] = []
    monkeypatch.setattr(RemoteBackend, "request", lambda *a: sent.append(a))
    with pytest.raises(ValueError, match="NDIF_API_KEY.*set_default_api_key"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms", remote=True)
    assert not sent and state(hf) == before


def test_remote_true_on_a_model_built_here_names_the_hosted_models(monkeypatch: Any) -> None:
    model, hf = gqa_toy()
    before = state(hf)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", "not-a-real-key")
    with pytest.raises(ValueError, match="Hugging Face id.*hosted models"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms", remote=True)
    with pytest.raises(ValueError, match="remote must be False, True or 'local'"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), remote="ndif")
    assert state(hf) == before


def hosted_stand_in(monkeypatch: Any) -> tuple[Any, Any]:
    """The toy, given a Hub id as if NDIF hosted it (the key needs no network lookup)."""
    from nnsight.modeling import huggingface

    model, hf = gqa_toy()
    model.repo_id = "ra-lens/tiny-llama"
    monkeypatch.setitem(huggingface._ID_CACHE, model.repo_id, model.repo_id)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", "not-a-real-key")
    return model, hf


@pytest.mark.slow  # starts a fresh Python server process (20-50 s)
def test_remote_true_sends_the_request_remote_local_runs(monkeypatch: Any) -> None:
    """The request remote=True would POST (RemoteBackend's own serialization, keyed by the
    model's Hub id, eager attention in its env) run by the stand-in server gives the local
    numbers: remote="local" and NDIF receive the same request."""
    model, hf = hosted_stand_in(monkeypatch)
    sent: list[Any] = []

    def request(backend: Any, request: Any, tracer: Any) -> dict[str, Any]:
        sent.append((backend.model_key, request.env))
        return remote.run_request(backend._serialize(tracer), model, compress=backend.compress)

    monkeypatch.setattr(RemoteBackend, "request", request)
    ref = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows")
    got = ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="rows", remote=True)
    assert_same(got, ref, "rows")
    ((key, env),) = sent
    assert "ra-lens/tiny-llama" in key and env["attn_implementation"] == "eager"


def test_ndifs_refusal_is_passed_through_with_the_fix_named(monkeypatch: Any) -> None:
    model, hf = hosted_stand_in(monkeypatch)
    before = state(hf)

    def refuse(*_: Any) -> None:
        raise RemoteError("Model key ra-lens/tiny-llama is not deployed")

    monkeypatch.setattr(RemoteBackend, "request", refuse)
    with pytest.raises(RuntimeError, match="not deployed.*hosts this model now"):
        ra_lens.reversed_attention(model, TOKENS, target_nll([5]), keep="norms", remote=True)
    assert state(hf) == before
