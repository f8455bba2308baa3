"""Rankings that intervene on the model one head at a time: causal mediation (ablate a head),
Todd et al.'s indirect effect (patch a head's mean output in) and TransformerLens's activation
patching (patch a head's clean output in). One forward pass per head; each is a scorer run by
`engine.rank`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ra_lens import capture
from ra_lens.capture import HookedModel, Z
from ra_lens.patching import HeadMeans, ablation_hooks, check_means, last_token_means
from ra_lens.ranking.engine import Part, PerPrompt, rank, target_probs
from ra_lens.types import Scores, Targets, Tokens


def causal_mediation(
    model: HookedModel,
    prompts: Tokens,
    targets: Targets,
    *,
    means: HeadMeans | None = None,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Drop in p(target) when one head's output is ablated, mean over prompts.

    score[l, h] = mean_i (p_i - p_i with head (l, h) ablated at hook_z), p at each prompt's last
    position. One forward pass per head and per batch of prompts (n_layers x n_heads x
    ceil(N / batch_size) passes), plus one clean pass per batch. Positive = the head helps.

    Args:
        means: None zeroes the head; otherwise its output is replaced by these means
            (`mean_head_outputs`, or `last_token_means` aligned at each prompt's last token).
        per_prompt: return Float[Tensor, "batch layer head"] instead of the mean.

    Returns:
        Float[Tensor, "layer head"].

    One head by hand: p(target) before minus after zeroing head 2 of layer 1.

    >>> scores = causal_mediation(model, ["I like Italy"], [5])
    >>> tokens = model.to_tokens("I like Italy")
    >>> def p():
    ...     return target_probs(model(tokens), torch.tensor([tokens.shape[1]]), torch.tensor([5]))
    >>> with torch.no_grad():
    ...     before = p()
    ...     with model.hooks(fwd_hooks=ablation_hooks([(1, 2)])):
    ...         after = p()
    >>> torch.allclose(scores[1, 2], (before - after).float(), atol=1e-7)
    True
    """
    shape = capture.model_shape(model)
    check_means(means, shape.n_layers, shape.n_heads)
    heads = [(la, h) for la in range(shape.n_layers) for h in range(shape.n_heads)]

    def score(model: HookedModel, part: Part) -> Tensor:
        tokens, lengths = part.prompts.tokens, part.prompts.lengths
        drops = torch.zeros(part.size, shape.n_layers, shape.n_heads, dtype=torch.float64)
        with torch.no_grad():
            before = target_probs(model(tokens), lengths, part.targets).double()
            for i, (layer, head) in enumerate(heads):
                hooks = ablation_hooks([(layer, head)], means=means, lengths=lengths)
                with model.hooks(fwd_hooks=hooks):
                    after = target_probs(model(tokens), lengths, part.targets).double()
                drops[:, layer, head] = (before - after).cpu()
                part.done((i + 1) / len(heads))
        return drops

    return rank(
        model,
        prompts,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="causal mediation",
    )


def indirect_effect(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Todd et al.'s indirect effect: gain in p(target) on shuffled-label prompts when one head's
    last-token output is replaced by its mean last-token output over the clean prompts.

    score[l, h] = mean_i (p_i(corrupted, z[l, h] at the last token := mean_clean) -
    p_i(corrupted)). Only the last token is patched, so clean and corrupted prompts may differ in
    length and number. One forward pass per head and per batch of corrupted prompts.

    Args:
        clean: prompts whose mean last-token hook_z is patched in.
        corrupted: the prompts to patch (e.g. `shuffled_label_prompts` of the clean ones).
        targets: the answer token of each corrupted prompt.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    With one clean prompt patched into itself, its own mean changes nothing:

    >>> indirect_effect(model, ["I like Italy"], ["I like Italy"], [5]).abs().max()
    tensor(0.)
    """
    shape = capture.model_shape(model)
    heads = [(la, h) for la in range(shape.n_layers) for h in range(shape.n_heads)]
    cache: dict[str, Tensor] = {}

    def patch(head: int, value: Tensor, last: Tensor) -> Callable[[Tensor, Any], Tensor]:
        def hook(z: Tensor, hook: Any) -> Tensor:
            z = z.clone()
            rows = torch.arange(z.shape[0], device=z.device)
            z[rows, last.to(z.device), head] = value.to(z.device, z.dtype)
            return z

        return hook

    def score(model: HookedModel, part: Part) -> Tensor:
        if "mean_last" not in cache:  # once the corrupted prompts and targets passed their checks
            cache["mean_last"] = last_token_means(model, clean, batch_size=batch_size)[:, :, -1]
        mean_last = cache["mean_last"]
        tokens, lengths = part.prompts.tokens, part.prompts.lengths
        gains = torch.zeros(part.size, shape.n_layers, shape.n_heads, dtype=torch.float64)
        with torch.no_grad():
            base = target_probs(model(tokens), lengths, part.targets).double()
            for i, (layer, head) in enumerate(heads):
                hook = patch(head, mean_last[layer, head], lengths - 1)
                with model.hooks(fwd_hooks=[(Z.format(layer), hook)]):
                    after = target_probs(model(tokens), lengths, part.targets).double()
                gains[:, layer, head] = (after - base).cpu()
                part.done((i + 1) / len(heads))
        return gains

    return rank(
        model,
        corrupted,
        targets,
        score,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="indirect effect",
    )


#: The quieted bar of TransformerLens's patching loop: how many `quiet_tl_patching` blocks are
#: open in this process, and the `transformer_lens.patching.tqdm` to put back when the last one
#: closes. That loop always draws a tqdm bar and takes no option to hide it, so while
#: `activation_patching` runs (the engine draws its own bar) the module's global `tqdm` is
#: replaced: a process-wide change, so it is counted here, under `TL_BAR_LOCK`, for two
#: threads ranking two models at once (without the count, the first to finish would bring the
#: bar back under the second, or the second would put back the first's quiet bar for good).
TL_BAR_QUIETED: dict[str, Any] = {"open": 0, "original": None}
TL_BAR_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_tl_patching() -> Iterator[None]:
    """TransformerLens's patching loop without its tqdm bar, for the duration of the block
    (re-entrant and thread-safe, see `TL_BAR_QUIETED`).

    >>> import transformer_lens.patching as tl_patching
    >>> found = tl_patching.tqdm
    >>> with quiet_tl_patching(), quiet_tl_patching():
    ...     quiet = tl_patching.tqdm is not found
    >>> quiet, tl_patching.tqdm is found, TL_BAR_QUIETED["open"]
    (True, True, 0)
    """
    import transformer_lens.patching as tl_patching

    with TL_BAR_LOCK:
        if TL_BAR_QUIETED["open"] == 0:
            TL_BAR_QUIETED["original"] = tl_patching.tqdm
            tl_patching.tqdm = functools.partial(tl_patching.tqdm, disable=True)
        TL_BAR_QUIETED["open"] += 1
    try:
        yield
    finally:
        with TL_BAR_LOCK:
            TL_BAR_QUIETED["open"] -= 1
            if TL_BAR_QUIETED["open"] == 0:
                tl_patching.tqdm = TL_BAR_QUIETED["original"]
                TL_BAR_QUIETED["original"] = None


def activation_patching(
    model: HookedModel,
    clean: Tokens,
    corrupted: Tokens,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool = False,
    per_prompt: bool = False,
) -> Scores | PerPrompt:
    """Gain in p(target) when one head's clean output is patched into the corrupted run.

    score[l, h] = mean_i (p_i(corrupted, z[l, h] from clean) - p_i(corrupted)), all positions of
    the head's hook_z output patched at once. Computed by TransformerLens itself:
    `transformer_lens.patching.get_act_patch_attn_head_out_all_pos` with `baseline=True` and
    `reduce="mean"` (per_prompt: `reduce="none"`), its `PatchingResult.effect()`; under TL 2.x,
    which has neither, the mean metric minus the unpatched one (per_prompt: one prompt at a
    time), on a clean cache of hook_z only. This works on TransformerBridge in TL 4.3 (it only
    needs `run_with_cache`, `run_with_hooks` and the hook_z alias); the tests check it against a
    hand-written hook loop. TL 4 refuses a model in train mode; the engine runs it in eval mode.

    Args:
        clean, corrupted: prompts of equal token lengths, pair by pair.
        targets: the clean answer token of each prompt.

    Returns:
        Float[Tensor, "layer head"] (per_prompt: Float[Tensor, "batch layer head"]).

    Patching a run with itself changes nothing:

    >>> activation_patching(model, ["I like Italy"], ["I like Italy"], [5]).abs().max()
    tensor(0.)
    """
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos as patch_heads

    # TL >= 3 reduces per-prompt metrics and subtracts the baseline itself; TL 2.x does neither
    tl_reduce = "reduce" in inspect.signature(patch_heads).parameters
    shape = capture.model_shape(model)
    z_names = {Z.format(la) for la in range(shape.n_layers)}

    def effect(
        model: HookedModel, clean_tokens: Tensor, corrupted_tokens: Tensor, part: Part
    ) -> Tensor:
        def metric(logits: Tensor) -> Tensor:
            probs = target_probs(logits, part.prompts.lengths, part.targets)
            return probs if tl_reduce else probs.mean()

        _, cache = model.run_with_cache(clean_tokens, names_filter=lambda name: name in z_names)
        if tl_reduce:
            reduce = "none" if part.per_prompt else "mean"
            result = patch_heads(
                model, corrupted_tokens, cache, metric, reduce=reduce, baseline=True
            )
            # TL's patch functions are functools.partial over an overloaded function, which mypy
            # types by its first overload (Tensor); with baseline=True it is a PatchingResult.
            # values: [layer head] or [layer head batch]
            values: Tensor = result.effect().double()  # type: ignore[attr-defined]
            return values.permute(2, 0, 1) if part.per_prompt else values
        patched = patch_heads(model, corrupted_tokens, cache, metric)
        return patched.double() - float(metric(model(corrupted_tokens)))

    def score(model: HookedModel, part: Part) -> Tensor:
        assert part.corrupted is not None
        clean_tokens, corrupted_tokens = part.prompts.tokens, part.corrupted.tokens
        with torch.no_grad(), quiet_tl_patching():
            if tl_reduce or not part.per_prompt:
                return effect(model, clean_tokens, corrupted_tokens, part).cpu()
            rows = []  # TL 2.x: a scalar metric, so one prompt at a time
            for i in range(part.size):
                row = slice(i, i + 1)
                one = Part(row, part.prompts.rows(row, trim=True), part.targets[row])
                pair = one.prompts.tokens, part.corrupted.rows(row, trim=True).tokens
                rows.append(effect(model, *pair, one))
            return torch.stack(rows).cpu()

    return rank(
        model,
        clean,
        targets,
        score,
        corrupted=corrupted,
        batch_size=batch_size,
        progress=progress,
        per_prompt=per_prompt,
        desc="activation patching",
    )
