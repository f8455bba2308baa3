"""`reversed_attention` on nnsight models: checks and batching here, the trace in `_trace`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import Batch
from ra_lens.checks import check_layers, check_ra_options
from ra_lens.metrics import metric_lengths
from ra_lens.nnsight import adapter
from ra_lens.nnsight._trace import ra_in_trace
from ra_lens.nnsight.adapter import NnsightModel
from ra_lens.result import ReversedAttention


def reversed_attention(
    model: NnsightModel,
    tokens: Tensor | Batch | str | Sequence[str],
    metric: Any,
    *,
    layers: Validated[Sequence[int]] | None = None,
    keep: str = "maps",
    convention: str = "qk",
    rows_at: Tensor | None = None,
    remote: Any = False,
) -> ReversedAttention:
    """Reversed Attention of an nnsight model; same arguments and result as
    `ra_lens.reversed_attention` (which calls this for nnsight models).

    One `model.trace` (forward and backward, `_trace.ra_in_trace`) reads each chosen layer's
    attention weights A and their gradient R = dL/dA, and reduces them on the spot to the
    convention and `keep` asked for; the model runs in eval mode with its parameters frozen
    (nothing accumulates in their .grad) and is left as found.

    Args:
        model: `nnsight.TransformersModel(hf_model, tokenizer=...)` (or `LanguageModel`) of a
            HuggingFace causal LM loaded with attn_implementation="eager".
        tokens, metric, layers, keep, convention, rows_at: as `ra_lens.reversed_attention`;
            strings go through the model's tokenizer with BOS first (`to_tokens`).
        remote: False runs the trace here; True sends it to NDIF as one request (an API key in
            NDIF_API_KEY, a model NDIF hosts wrapped by its Hugging Face id) that reduces RA on
            the server, so keep="norms"/"rows" download O(layers x heads [x keys]) numbers;
            "local" sends the same request to a fresh local process that cannot import ra_lens,
            on a copy of this model (`ra_lens.nnsight.remote`).

    Returns:
        ReversedAttention (CPU, float32), routes all "pattern".

    Raises:
        ValueError: non-eager attention (naming attn_implementation="eager"); a metric without a
            gradient path or of the wrong shape; bad layers, keep, convention or rows_at.
        TypeError: an nnsight model that does not wrap a HuggingFace causal LM.
        RuntimeError: nnsight could not trace the model; NDIF refused or failed the request
            (the fix named: hosted models, API key, eager attention).
    """
    check_ra_options(keep, convention, rows_at)
    if remote is not False:
        from ra_lens.nnsight import remote as remote_run

        remote_run.check(model, remote)
    found = adapter.layout(model)
    chosen = check_layers(layers, len(found.attention_paths))
    batch = to_batch(model, tokens)
    paths = [found.attention_paths[la] for la in chosen]
    facts = [adapter.scale_and_softcap(model, p) for p in paths]
    scales, caps = [f[0] for f in facts], [f[1] for f in facts]
    needs_scores = convention == "qk" and any(c is not None for c in caps)
    score_path = adapter.softmax_path(model) if needs_scores else None
    lengths = metric_lengths(metric, batch)
    positions = batch.row_positions(rows_at) if keep == "rows" else None
    # NDIF's model is not here (the local one holds no weights): the inputs travel from the CPU.
    device = torch.device("cpu") if remote is True else adapter.input_device(model)
    shipping = contextlib.nullcontext() if remote is False else remote_run.shipped_by_value()
    with adapter.preserved(model), shipping:
        try:
            out = ra_in_trace(
                model,
                batch.tokens.to(device),
                paths,
                metric,
                keep=keep,
                convention=convention,
                scales=scales,
                softcaps=caps,
                score_paths=[score_path] * len(paths),
                embed_path=found.embed_path,
                rows_at=positions,
                lengths=None if lengths is None else lengths.to(device),
                real=batch.real_mask().to(device) if batch.padded else None,
                trace_kwargs=None if remote is False else remote_run.trace_kwargs(model, remote),
            )
        except ValueError:
            raise
        except Exception as error:
            refused = None if remote is False else remote_run.explained(error)
            raise (refused or _explained(error)) from error
    return _result(model, out, batch, chosen, convention, scales, positions)


def _result(
    model: NnsightModel,
    out: dict[str, Tensor],
    batch: Batch,
    chosen: list[int],
    convention: str,
    scales: list[float],
    positions: Tensor | None,
) -> ReversedAttention:
    """The trace's outputs as a ReversedAttention on the CPU in float32, after checking the
    metric gave one value per prompt."""
    values = out["values"]
    if values.ndim > 1 or (values.ndim == 1 and values.shape[0] != batch.tokens.shape[0]):
        raise ValueError(
            f"the metric returned shape {tuple(values.shape)}: it must return one value per "
            f"prompt, Float[Tensor, '{batch.tokens.shape[0]}'], or a scalar"
        )
    cpu = {k: v.detach().to("cpu", torch.float32) for k, v in out.items()}
    return ReversedAttention(
        norms=cpu["norms"],
        pattern_norms=cpu["pattern_norms"],
        tokens=batch.tokens.cpu(),
        lengths=batch.lengths.cpu(),
        metric_values=cpu["values"],
        layers=chosen,
        convention=convention,
        scales=scales,
        routes=["pattern"] * len(chosen),
        maps=cpu.get("maps"),
        patterns=cpu.get("patterns"),
        rows=cpu.get("rows"),
        row_positions=None if positions is None else positions.cpu(),
        str_tokens=_str_tokens(model, batch),
    )


def _explained(error: Exception) -> Exception:
    """nnsight's errors, said in ra-lens's terms where the cause is known."""
    text = f"{type(error).__name__}: {error}"
    if "grad" in text and ("never" in text or "not" in text or "None" in text):
        return ValueError(
            "no gradient reached the attention weights: the metric must depend on the logits "
            f"the model returns, through the attention of the chosen layers ({text[:300]})"
        )
    return RuntimeError(
        f"nnsight could not trace this model ({text[:500]}): ra-lens reads nnsight."
        "TransformersModel(hf_model, tokenizer=...) wrapping a HuggingFace causal LM"
    )


def to_batch(model: NnsightModel, tokens: Tensor | Batch | str | Sequence[str]) -> Batch:
    """A right-padded `Batch` from ids or strings (`to_tokens`: BOS first, as TransformerLens
    tokenises, so both routes see the same ids)."""
    if isinstance(tokens, Batch):
        return tokens
    if isinstance(tokens, Tensor):
        if tokens.ndim not in (1, 2) or tokens.is_floating_point():
            raise ValueError(
                f"tokens must be Int[Tensor, 'batch pos'], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        ids = tokens if tokens.ndim == 2 else tokens[None]
        return Batch(ids.long(), torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long))
    prompts = [tokens] if isinstance(tokens, str) else list(tokens)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("tokens must be an Int[Tensor, 'batch pos'], a string or strings")
    tokenizer = _tokenizer(model)
    rows = [to_tokens(model, p) for p in prompts]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), int(lengths.max())), int(pad or 0), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return Batch(ids, lengths)


def to_tokens(model: NnsightModel, text: str, *, prepend_bos: bool = True) -> Tensor:
    """Int[Tensor, "pos"]: `text` through the model's tokenizer without its own special tokens,
    with the BOS token first where the tokenizer has one (TransformerLens's `to_tokens`)."""
    tokenizer = _tokenizer(model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if prepend_bos and bos is not None:
        ids = [bos, *ids]
    return torch.tensor(ids, dtype=torch.long)


def _tokenizer(model: NnsightModel) -> Any:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "the nnsight model has no tokenizer: pass token ids, or wrap the model as "
            "nnsight.TransformersModel(hf_model, tokenizer=tokenizer)"
        )
    return tokenizer


def _str_tokens(model: NnsightModel, batch: Batch) -> list[list[str]] | None:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    return [
        tokenizer.convert_ids_to_tokens(row[: int(n)].tolist())
        for row, n in zip(batch.tokens, batch.lengths)
    ]


def ra_ranking(
    model: NnsightModel,
    prompts: Tensor | Batch | Sequence[str],
    targets: Any,
    *,
    loss_row: bool = False,
    batch_size: int = 8,
    per_prompt: bool = False,
) -> Tensor:
    """`ra_lens.ranking.ra_ranking` on an nnsight model (which calls this): mean RA norm of each
    head for each prompt's own -log p(target), Float[Tensor, "layer head"] (per_prompt:
    Float[Tensor, "batch layer head"]); loss_row: the norm of the row at the loss position."""
    from ra_lens.metrics import target_nll

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batch = to_batch(model, prompts)
    targets = torch.as_tensor(targets, dtype=torch.long).reshape(-1)
    n = batch.tokens.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"{targets.shape[0]} targets for {n} prompts: give one per prompt")
    parts = []
    for start in range(0, n, batch_size):
        rows = slice(start, min(start + batch_size, n))
        part = batch.rows(rows, trim=True)
        metric = target_nll(targets[rows])
        if loss_row:
            ra = reversed_attention(model, part, metric, keep="rows")
            assert ra.rows is not None
            parts.append(ra.rows.double().pow(2).sum(-1).sqrt().float())
        else:
            parts.append(reversed_attention(model, part, metric, keep="norms").norms)
    scores = torch.cat(parts)
    return scores if per_prompt else scores.mean(0)
