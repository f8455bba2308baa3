"""Top-k accuracy of the first answer token at each prompt's last position, batched."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ra_lens._typing import Validated
from ra_lens.capture import HookedModel, eval_mode, to_batch
from ra_lens.nnsight.adapter import NnsightModel, as_nnsight
from ra_lens.progress import tqdm
from ra_lens.tasks.prompts import Prompt

FwdHook = tuple[str | Callable[[str], bool], Callable[..., Any]]


@dataclass(frozen=True)
class Accuracy:
    """ICL accuracy over `n` prompts.

    `ranks[i]` is the rank of prompt i's answer token among the vocabulary logits at its last
    position (0 = the model's top prediction; rank = how many logits are strictly larger), so
    top-k accuracy is the fraction of ranks below k.

    >>> acc = Accuracy.from_ranks(torch.tensor([0, 1, 5, 0]))
    >>> acc.top1, acc.top3, acc.top(10), acc.to_dict()
    (0.5, 0.75, 1.0, {'n': 4, 'top1': 0.5, 'top2': 0.75, 'top3': 0.75})
    """

    top1: float
    top2: float
    top3: float
    n: int
    ranks: Int[Tensor, "n"] = field(repr=False)
    ks: tuple[int, ...] = (1, 2, 3)

    @classmethod
    def from_ranks(cls, ranks: Int[Tensor, "n"], ks: Sequence[int] = (1, 2, 3)) -> Accuracy:
        ranks = ranks.detach().to("cpu", torch.long)
        n = int(ranks.numel())

        def top(k: int) -> float:
            return float((ranks < k).float().mean()) if n else float("nan")

        return cls(top(1), top(2), top(3), n, ranks, tuple(int(k) for k in ks))

    def top(self, k: int) -> float:
        """Top-k accuracy for any k, as a fraction in [0, 1]."""
        return float((self.ranks < k).float().mean()) if self.n else float("nan")

    def to_dict(self) -> dict[str, float | int]:
        """{"n": n, "top1": ..., "top2": ..., "top3": ..., plus "top{k}" for every k in ks}."""
        out: dict[str, float | int] = {"n": self.n}
        for k in sorted({1, 2, 3, *self.ks}):
            out[f"top{k}"] = self.top(k)
        return out


def answer_ranks(
    logits: Float[Tensor, "batch pos vocab"],
    lengths: Int[Tensor, "batch"],
    answers: Int[Tensor, "batch"],
) -> Int[Tensor, "batch"]:
    """Rank of each answer token among the logits at each row's last real position.

    A NaN answer logit (e.g. a patch that broke the forward pass) gets the worst rank, vocab - 1,
    instead of the 0 that comparisons with NaN would give.

    >>> logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]]]).repeat(3, 1, 1)
    >>> logits[2, 1, 0] = float("nan")  # [batch pos vocab]; row i is read at lengths[i] - 1
    >>> answer_ranks(logits, lengths=torch.tensor([2, 1, 2]), answers=torch.tensor([0, 0, 0]))
    tensor([0, 2, 2])
    """
    rows = torch.arange(logits.shape[0], device=logits.device)
    last: Float[Tensor, "batch vocab"] = logits[rows, lengths.to(logits.device) - 1].float()
    target = last[rows, answers.to(logits.device)]
    ranks = (last > target[:, None]).sum(-1)
    return torch.where(target.isnan(), last.shape[-1] - 1, ranks)


def evaluate(
    model: Validated[HookedModel],
    prompts: Sequence[Prompt],
    *,
    fwd_hooks: Sequence[FwdHook] = (),
    batch_size: int = 16,
    ks: Sequence[int] = (1, 2, 3),
    by_length: bool | None = None,
) -> Accuracy:
    """Top-k accuracy of the first token of each prompt's answer at its last position.

    Prompts are tokenised with BOS (`model.to_tokens`) and right-padded with the tokenizer's pad
    id, so prompts of different lengths share a batch: causal attention keeps real positions
    blind to the padding and the logits are read at each prompt's own last real position.
    Hooks that line up with the last positions of a sequence (ra-lens's attention patches) would
    hit a padded prompt at the wrong places, so with such a hook (or `by_length=True`) every
    batch holds prompts of one token length only. The model runs in eval mode (every module's mode
    restored afterwards: dropout would make the accuracy random) under `torch.no_grad()` inside
    `model.hooks(fwd_hooks=...)`, so hooks (e.g. head ablations or attention patches) apply to
    every batch and are removed afterwards.

        Args:
            model: a TransformerLens model (HookedTransformer or TransformerBridge), or an
                nnsight model (`ra_lens.nnsight`: the hooks run inside its trace).
            prompts: from `build_prompts`; only `.text` and `.answer` are used.
            fwd_hooks: (hook name or name filter, hook function) pairs, as for `model.hooks`.
            batch_size: prompts per forward pass.
            ks: the k values reported by `Accuracy.to_dict` (top1..top3 are always there).
            by_length: batch prompts of one token length only (no padding). Default: when a hook
                is aligned to the end of the sequence (`attention_patch_hooks`,
                `forward_patch_hooks`).

        Returns:
            Accuracy with `ranks: Int[Tensor, "n"]` in prompt order.

        >>> from ra_lens.tasks import build_prompts
        >>> pairs = [("b", "of"), ("c", "is"), ("d", "to"), ("l", "an")]
        >>> prompts = build_prompts(pairs, shots=1, seed=0)
        >>> acc = evaluate(model, prompts)
        >>> acc.n, acc.ranks.shape, torch.equal(acc.ranks, evaluate(model, prompts, batch_size=1).ranks)
        (4, torch.Size([4]), True)
    """
    prompts = list(prompts)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    ids, logits_of, scope = _route(model, fwd_hooks)
    token_of = {a: int(ids(a, False)[0]) for a in dict.fromkeys(p.answer for p in prompts)}
    answers = [token_of[p.answer] for p in prompts]
    if by_length is None:
        by_length = any(getattr(fn, "aligned_to_end", False) for _, fn in fwd_hooks)
    if by_length:
        lengths = [len(ids(p.text, True)) for p in prompts]
        groups = [[i for i, n in enumerate(lengths) if n == m] for m in sorted(set(lengths))]
    else:
        groups = [list(range(len(prompts)))]
    batches = [g[i : i + batch_size] for g in groups for i in range(0, len(g), batch_size)]
    ranks = torch.empty(len(prompts), dtype=torch.long)
    with scope:
        for idx in tqdm(batches, desc="evaluate", disable=len(batches) < 4, leave=False):
            logits, real_lengths = logits_of([prompts[i].text for i in idx])
            target = torch.tensor([answers[i] for i in idx], dtype=torch.long)
            ranks[idx] = answer_ranks(logits, real_lengths, target).cpu()
    return Accuracy.from_ranks(ranks, ks)


def _route(
    model: HookedModel | NnsightModel, fwd_hooks: Sequence[FwdHook]
) -> tuple[
    Callable[[str, bool], Tensor],
    Callable[[list[str]], tuple[Tensor, Tensor]],
    contextlib.AbstractContextManager[Any],
]:
    """How `evaluate` reads a model: (a text's ids Int[Tensor, "pos"], with or without BOS;
    texts -> (logits Float[Tensor, "batch pos vocab"], real lengths Int[Tensor, "batch"]) with the
    hooks applied; the scope the batches run in). TransformerLens and nnsight (where the hooks
    run inside its trace) tokenise alike: BOS first, right padding."""
    nnsight_model = as_nnsight(model)
    if nnsight_model is not None:
        from ra_lens.nnsight.patch import run_with_pattern_hooks
        from ra_lens.nnsight.route import to_batch as nnsight_batch
        from ra_lens.nnsight.route import to_tokens

        def nnsight_logits(texts: list[str]) -> tuple[Tensor, Tensor]:
            batch = nnsight_batch(nnsight_model, texts)
            return run_with_pattern_hooks(nnsight_model, batch.tokens, fwd_hooks), batch.lengths

        return (
            lambda text, bos: to_tokens(nnsight_model, text, prepend_bos=bos),
            nnsight_logits,
            contextlib.nullcontext(),
        )

    tl = cast(HookedModel, model)

    def logits(texts: list[str]) -> tuple[Tensor, Tensor]:
        batch = to_batch(tl, texts)
        return tl(batch.tokens), batch.lengths

    @contextlib.contextmanager
    def scope() -> Iterator[None]:  # entered only by `evaluate`'s `with`
        with eval_mode(tl), torch.no_grad(), tl.hooks(fwd_hooks=list(fwd_hooks)):
            yield

    return lambda text, bos: tl.to_tokens(text, prepend_bos=bos)[0], logits, scope()
