"""Learned edge masks (Edge Pruning / UGS style): a continuous mask over the graph's edges, trained
on training pairs to keep the metric with as few edges as possible, warm-started from EAP-IG.

The masked run is ra-lens's edge patching (`_edges.EdgeRun`) with the Boolean "patch this edge"
replaced by 1 - m[w, r], m in [0, 1]: every reader r of the clean run reads

    its input in this run - sum over writers w of (1 - m[w, r]) * (w's output in this run -
                                                                  w's output on the corrupted prompt)

so m = 1 on every edge is the clean run, m = 0 the corrupted one (the empty circuit under
patching), and a 0/1 mask is exactly `faithfulness`'s edge patching of the circuit m = 1. Unlike
`EdgeRun`, the writers' differences stay in the autograd graph, so the gradient with respect to m
is the true derivative of the masked run (an edge's mask also moves every later writer).
Post-norm heads (Gemma-2/3) are read through the real norm, N(a) - N(a - S) with S the weighted
sum of the patched heads' differences, as `EdgeRun` does for a Boolean mask.

`learn_mask` parametrises m = sigmoid(log_alpha), starts log_alpha at `init_scale` times the
EAP-IG scores divided by their root mean square (in MIB's sign: an edge that helps starts kept,
one that hurts starts patched, an idle one at 1/2), and runs `steps` Adam steps on

    loss = -f(m) + lambda_t * mean over real edges of m,    f = (m_masked - m_empty) / (m_clean - m_empty)

(f: faithfulness of the masked run on the training pairs, MIB's normalisation with the corrupted
run as the empty circuit; objective="faithful" fits (f - 1)^2 instead of -f), lambda_t rising linearly from 0 to `sparsity` over the steps, so the
edges the metric needs least are pushed out first: one run ranks the edges for every circuit size
(MIB's nested circuits come from `EdgeScores.top`/`greedy` on the learned log_alpha). Cost: the
EAP-IG warm start (`ig_steps` forward+backward passes) plus one forward+backward pass of the
masked run per step and batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import capture, contract, pairs, state, timing
from ra_lens._typing import Validated, no_type_check
from ra_lens.capture import HookedModel
from ra_lens.checks import check_count
from ra_lens.circuits import _edges
from ra_lens.circuits.attribute import attribute
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.scores import EdgeScores
from ra_lens.progress import tqdm
from ra_lens.record import Recorded
from ra_lens.types import MetricFn, Tokens
from ra_lens.weights import LayerWeights, check_supported, layer_weights

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Fewest training pairs `learn_mask` takes: the mask is fitted to them, and one pair is a
#: single prompt's quirks.
MIN_PAIRS = 2
Objective = Literal["metric", "faithful"]
Rule = Literal["adam", "scaled"]
RULES: tuple[str, ...] = ("adam", "scaled")
OBJECTIVES: tuple[str, ...] = ("metric", "faithful")


# repr=False: TransformerLens formats a hook's repr when adding it (see EdgeRun).
@dataclass(repr=False)
class MaskedRun(_edges.EdgeRun):
    """`EdgeRun` with a float weight per edge instead of a Boolean mask, in the autograd graph.

    Args (besides `EdgeRun`'s graph, weights and reference):
        patch: Float[Tensor, "writer reader"]: how much of each edge is patched, 1 - m on real
            edges and 0 elsewhere; may require grad.
    """

    patch: Tensor | None = None
    # every writer's (output - reference), chunk by chunk as writers fire, in the autograd graph
    _parts: list[Tensor] = field(default_factory=list)

    def _add_writers(self, outputs: Tensor) -> None:
        assert self.reference is not None
        first = self._writer_count()
        reference = self.reference[first : first + outputs.shape[0]]
        self._parts.append(outputs - reference.to(outputs.device, outputs.dtype))
        self.chunks.append(outputs.detach())

    def _post_in_hook(self, layer: int) -> Any:
        @no_type_check  # built per call (see ra_lens._typing.no_type_check)
        def hook(value: Tensor, hook: Any) -> None:
            self.post_input[layer] = value  # not detached: the mask's gradient flows through it

        return hook

    def _delta(self, readers: list[int], like: Tensor) -> dict[int, Tensor]:
        """reader -> delta [batch pos d_model] for the readers with a non-zero patch (readers
        with none keep the model's own value bit for bit: m = 1 is the clean run exactly)."""
        assert self.patch is not None
        cols = self.patch[: self._writer_count(), readers]
        needed = cols.detach().ne(0).any(0)
        if not bool(needed.any()):
            return {}
        picked = [r for r, need in zip(readers, needed.tolist(), strict=True) if need]
        total = self._soft_sum(cols[:, needed])
        return dict(zip(picked, total.to(like.dtype), strict=True))

    def _soft_sum(self, cols: Tensor) -> Tensor:
        """[readers batch pos d_model]: sum over writers w of cols[w, r] * diff_w; heads behind a
        post-norm are seen through the norm: N(a) - N(a - S), S their weighted sum."""
        post = {la: r for la, r in self._post_rows().items() if r.start < cols.shape[0]}
        return self._through_post_norms(cols, post) if post else self._weighted(cols)

    def _weighted(self, select: Tensor, offset: int = 0) -> Tensor:
        """sum over w of select[w, r] * diff_(offset + w), chunk by chunk (autograd keeps
        references to the chunks, not copies of them)."""
        out: Tensor | None = None
        start = 0
        for part in self._parts:
            stop = start + part.shape[0]
            lo, hi = max(start, offset), min(stop, offset + select.shape[0])
            if lo < hi:
                w = select[lo - offset : hi - offset].to(part.device, part.dtype)
                term = torch.einsum("wr,wbpd->rbpd", w, part[lo - start : hi - start])
                out = term if out is None else out + term.to(out.device)
            start = stop
        assert out is not None
        return out


@dataclass
class LearnedMask(Recorded):
    """The result of `learn_mask`.

    Attributes:
        scores: EdgeScores ranking the edges by the learned log_alpha (MIB's sign, direction
            "denoise", method "mask"): `top(n)` / `greedy(n)` give MIB's nested circuits. On a
            grouped-query model each query head's copy of a key/value edge scores its own warm
            start plus an equal share of the edge's learned change (`ungrouped_scores`).
        mask: Float[Tensor, "writer reader"], sigmoid(log_alpha) on real edges, 0 elsewhere.
        log_alpha: Float[Tensor, "writer reader"], the trained logits (0 off the graph).
        warm_start: the EdgeScores the mask started from.
        faithfulness: f of the masked run on the training pairs before each step.
        losses: the loss before each step.
        kept: edges with m >= 1/2 after each step.
        seconds: process CPU time, warm start included.
    """

    scores: EdgeScores
    mask: Float[Tensor, "writer reader"]
    log_alpha: Float[Tensor, "writer reader"]
    warm_start: EdgeScores
    faithfulness: list[float]
    losses: list[float]
    kept: list[int]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the training curve and the cost (the scores themselves: `scores.save`)."""
        return {
            "method": self.scores.method,
            "faithfulness": self.faithfulness,
            "losses": self.losses,
            "kept": self.kept,
            "seconds": self.seconds,
        }

    def table(self) -> str:
        """A Markdown table: the loss, faithfulness and edges kept at each step."""
        rows = [
            f"| {step} | {loss:.4f} | {f:.3f} | {kept} |"
            for step, (loss, f, kept) in enumerate(zip(self.losses, self.faithfulness, self.kept))
        ]
        head = f"{self.scores.method}: {len(self.losses)} steps, {self.seconds:.1f} CPU s"
        return "\n".join([head, "", "| step | loss | f (training pairs) | edges kept |", "|---|---|---|---|", *rows])  # fmt: skip

    def plot(self, save: str | Path | None = None) -> Figure:
        """The training curve: f of the masked run and the edges kept, per step; `save` also
        writes it."""
        from ra_lens.viz.curves import training_curve

        return training_curve(
            {"f of the masked run": self.faithfulness}, {"edges kept (m >= 1/2)": self.kept},
            title=f"{self.scores.method}: learned edge mask", save=save,
        )  # fmt: skip


def masked_values(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    mask: Float[Tensor, "writer reader"],
) -> Float[Tensor, " pair"]:
    """The metric per pair of the clean run with every edge w -> r patched by 1 - mask[w, r]
    (module docstring), differentiable with respect to `mask` (one batch: all pairs at once).

    Args:
        mask: [writer, reader] in [0, 1] (entries off the graph are ignored), e.g. a
            `Circuit`'s edges as floats: 1 keeps an edge, 0 patches it.

    Raises:
        ValueError: a mask of the wrong shape, NaN or outside [0, 1].
    """
    capture.check_model(model)
    facts = contract.model_facts(model)
    check_supported(model, facts)
    graph = Graph.from_model(model)
    _check_mask(graph, mask)
    clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
    with capture.preserved_state(model):
        state.enable_mlp_in(model)
        weights = [layer_weights(model, la, facts) for la in range(graph.n_layers)]
        reference = _outputs(model, graph, weights, corrupted_b)
        patch = (1 - mask) * graph.real.to(mask.device, mask.dtype)
        return _masked_pass(model, graph, weights, clean_b, reference, patch, metric)


def _check_mask(graph: Graph, mask: Tensor) -> None:
    shape = (len(graph.writers), len(graph.readers))
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, the graph needs {shape} (writer x reader)")  # fmt: skip
    values = mask.detach()[graph.real.to(mask.device)]
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any() | (values > 1).any()):
        raise ValueError("mask must hold finite values in [0, 1] on the graph's edges (1 keeps an edge, 0 patches it)")  # fmt: skip


def _outputs(
    model: HookedModel, graph: Graph, weights: list[LayerWeights], batch: capture.Batch
) -> Float[Tensor, "writer batch pos d_model"]:
    """Every writer's output on `batch` (no gradient)."""
    run = _edges.EdgeRun(graph, weights)
    with torch.no_grad(), model.hooks(fwd_hooks=run.hooks(model)):
        model(batch.tokens)
    return run.outputs()


def _masked_pass(
    model: HookedModel,
    graph: Graph,
    weights: list[LayerWeights],
    batch: capture.Batch,
    reference: Tensor,
    patch: Tensor,
    metric: MetricFn,
) -> Float[Tensor, " pair"]:
    run = MaskedRun(graph, weights, reference=reference, patch=patch)
    with torch.enable_grad(), model.hooks(fwd_hooks=run.hooks(model)):
        logits = model(batch.tokens)
        return pairs.metric_values(metric, logits, batch)


def learn_mask(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    steps: int = 10,
    sparsity: float = 1.0,
    lr: float = 0.1,
    init_scale: float = 1.0,
    objective: Validated[Objective] = "metric",
    rule: Validated[Rule] = "adam",
    warm_start: EdgeScores | Tensor | None = None,
    ig_steps: int = 5,
    budget_s: Validated[float] | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> LearnedMask:
    """Train a continuous edge mask on (clean, corrupted) training pairs (module docstring).

    Args:
        model: as `circuits.attribute` takes it.
        clean, corrupted: the training pairs (>= 2), Int[Tensor, "pair pos"], Batch or strings.
        metric: logits -> Float[Tensor, "pair"], e.g. `ra_lens.metrics.logit_diff`.
        steps: training steps (each one forward+backward pass of the masked run per batch).
        sparsity: the final weight of the penalty on the mean mask (it rises linearly from 0).
        lr: the step size on log_alpha (Adam's learning rate, or the scaled step's size).
        rule: "adam" (each edge's step about lr whatever its gradient) or "scaled" (log_alpha -=
            lr * gradient / rms(gradient over the edges): steps in proportion to each edge's
            gradient, so idle edges stay near their warm-start scores).
        init_scale: log_alpha starts at init_scale * warm / rms(warm) on the real edges.
        objective: "metric" (maximise f: keep what helps, patch what hurts, as CPR rewards)
            or "faithful" (minimise (f - 1)^2: reproduce the clean run, as CMD rewards).
        warm_start: the scores to start from (EdgeScores, or Float[Tensor, "writer reader"] in
            MIB's sign); None: `attribute(..., method="eap-ig", steps=ig_steps)` on these pairs.
        ig_steps: the warm start's IG steps (when warm_start is None).
        budget_s: stop after this much process CPU time (warm start included), if given.
        batch_size: pairs per forward/backward pass.
        progress: show a progress bar.

    Returns:
        LearnedMask: `.scores` (EdgeScores of log_alpha: top/greedy give circuits at any size),
        `.mask`, `.log_alpha`, the training curve and CPU seconds.

    Raises:
        ValueError: steps or ig_steps < 1, budget_s <= 0, sparsity < 0, fewer than 2 pairs,
            non-finite warm-start scores, a warm start of another graph, a mask that collapsed
            to empty (every m < 1/2) or went non-finite.
    """
    start = timing.cpu_time()
    check_count(steps, "steps", why="the number of training steps of the mask")
    check_count(ig_steps, "ig_steps")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s={budget_s!r}: give a positive number of CPU seconds, or None for no limit")  # fmt: skip
    if not (math.isfinite(sparsity) and sparsity >= 0) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"sparsity={sparsity!r}, lr={lr!r}: sparsity must be >= 0 and lr > 0 (finite)")  # fmt: skip
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: choose one of {OBJECTIVES}")
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}: choose one of {RULES}")
    capture.check_model(model)
    facts = contract.model_facts(model)
    check_supported(model, facts)
    graph = Graph.from_model(model)
    clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
    n = clean_b.tokens.shape[0]
    if n < MIN_PAIRS:
        raise ValueError(f"learn_mask got {n} training pair(s): give at least {MIN_PAIRS} (the mask is fitted to them; judge it on other pairs)")  # fmt: skip
    warm = _warm_scores(model, graph, clean_b, corrupted_b, metric, warm_start, ig_steps, batch_size)  # fmt: skip
    real = graph.real
    helps = warm.helps
    scale = helps[real].pow(2).mean().sqrt().clamp_min(1e-30)
    start_grouped = init_scale * helps / scale * real
    start_copies = None
    if warm.ungrouped_scores is not None:
        start_copies = init_scale * warm.ungrouped_helps / scale * real[:, graph.ungrouped_target]
    log_alpha = start_grouped.float().requires_grad_(True)
    trainer = _Trainer(model, graph, facts, clean_b, corrupted_b, metric, batch_size)
    curve = _train(
        trainer, log_alpha, steps, start, progress,
        sparsity=sparsity, lr=lr, objective=objective, rule=rule, budget_s=budget_s,
    )  # fmt: skip
    log_alpha = log_alpha.detach().double() * real
    _check_learned(graph, log_alpha)
    seconds = timing.cpu_time() - start
    scores = _scores(graph, start_grouped, start_copies, log_alpha, seconds)
    mask = torch.sigmoid(log_alpha) * real
    return LearnedMask(scores, mask, log_alpha, warm, seconds=seconds, **curve)


def _train(
    trainer: _Trainer,
    log_alpha: Tensor,
    steps: int,
    start: float,
    progress: bool,
    *,
    sparsity: float,
    lr: float,
    objective: str,
    rule: str,
    budget_s: float | None,
) -> dict[str, list[Any]]:
    """The training loop: log_alpha updated in place; the curve of f, the loss and the edges
    kept after each step."""
    real = trainer.graph.real.to(log_alpha.device)
    optimiser = torch.optim.Adam([log_alpha], lr=lr) if rule == "adam" else None
    curve: dict[str, list[Any]] = {"faithfulness": [], "losses": [], "kept": []}
    for step in tqdm(range(steps), desc="learn mask", disable=not progress):
        weight = sparsity * step / max(steps - 1, 1)
        f, loss, grad = trainer.step(log_alpha, weight, objective)
        curve["faithfulness"].append(f)
        curve["losses"].append(loss)
        if optimiser is not None:
            optimiser.zero_grad()
            log_alpha.grad = grad
            optimiser.step()
        else:  # "scaled": every edge moves in proportion to its own gradient
            with torch.no_grad():
                log_alpha -= lr * grad / grad[real].pow(2).mean().sqrt().clamp_min(1e-30)
        curve["kept"].append(int((log_alpha.detach() >= 0)[real].sum()))
        if budget_s is not None and timing.cpu_time() - start >= budget_s:
            break
    return curve


def _warm_scores(
    model: HookedModel,
    graph: Graph,
    clean: capture.Batch,
    corrupted: capture.Batch,
    metric: MetricFn,
    warm_start: EdgeScores | Tensor | None,
    ig_steps: int,
    batch_size: int,
) -> EdgeScores:
    """The warm start as EdgeScores, refusing NaN and another graph's scores."""
    if warm_start is None:
        return attribute(
            model, clean, corrupted, metric, method="eap-ig", steps=ig_steps, batch_size=batch_size
        )
    if isinstance(warm_start, EdgeScores):
        if warm_start.graph != graph:
            raise ValueError(f"warm_start is over {warm_start.graph}, the model's graph is {graph}: attribute this model")  # fmt: skip
        return warm_start
    shape = (len(graph.writers), len(graph.readers))
    if tuple(warm_start.shape) != shape:
        raise ValueError(f"warm_start has shape {tuple(warm_start.shape)}, the graph needs {shape} (writer x reader)")  # fmt: skip
    values = warm_start.detach().cpu().double()
    bad = int((~torch.isfinite(values) & graph.real).sum())
    if bad:
        raise ValueError(f"warm_start has {bad} non-finite (NaN/inf) scores on the graph's edges: re-run the attribution (in float32 or float64) or pass warm_start=None to compute EAP-IG here")  # fmt: skip
    return EdgeScores(graph, values * graph.real, "warm-start", "denoise")


class _Trainer:
    """The training pairs' fixed parts (corrupted outputs, clean and empty metrics) and one
    step: f, the loss and its gradient with respect to log_alpha, summed over batches."""

    def __init__(
        self,
        model: HookedModel,
        graph: Graph,
        facts: contract.ModelFacts,
        clean: capture.Batch,
        corrupted: capture.Batch,
        metric: MetricFn,
        batch_size: int,
    ) -> None:
        self.model, self.graph, self.clean = model, graph, clean
        n = clean.tokens.shape[0]
        self.rows = pairs.chunks(n, batch_size)
        self.metrics = [pairs.metric_rows(metric, rows, n) for rows in self.rows]
        with capture.preserved_state(model), torch.no_grad():
            state.enable_mlp_in(model)
            self.weights = [layer_weights(model, la, facts) for la in range(graph.n_layers)]
            self.references = [_outputs(model, graph, self.weights, corrupted.rows(r)) for r in self.rows]  # fmt: skip
            clean_v = [
                pairs.metric_values(m, model(clean.rows(r).tokens), clean.rows(r))
                for r, m in zip(self.rows, self.metrics, strict=True)
            ]
            empty_v = [
                pairs.metric_values(m, model(corrupted.rows(r).tokens), corrupted.rows(r))
                for r, m in zip(self.rows, self.metrics, strict=True)
            ]
        self.n = n
        self.clean_m = float(torch.cat(clean_v).double().mean())
        self.empty_m = float(torch.cat(empty_v).double().mean())
        if abs(self.clean_m - self.empty_m) <= 1e-6 * max(abs(self.clean_m), abs(self.empty_m)):
            raise ValueError(f"the clean and corrupted training prompts give the same mean metric ({self.clean_m:.6g}): there is no behaviour for a mask to keep; give pairs on which the metric differs")  # fmt: skip

    def step(self, log_alpha: Tensor, weight: float, objective: str) -> tuple[float, float, Tensor]:
        real = self.graph.real.to(log_alpha.device)
        grad = torch.zeros_like(log_alpha)
        total = 0.0
        gap = self.clean_m - self.empty_m
        with capture.preserved_state(self.model):
            state.enable_mlp_in(self.model)
            for rows, metric, reference in zip(self.rows, self.metrics, self.references, strict=True):  # fmt: skip
                mask = torch.sigmoid(log_alpha)
                patch = (1 - mask) * real
                values = _masked_pass(self.model, self.graph, self.weights, self.clean.rows(rows), reference, patch, metric)  # fmt: skip
                part = -values.double().sum() / (self.n * gap)
                (g,) = torch.autograd.grad(part, [log_alpha])
                grad += g
                total += float(values.detach().double().sum())
        f = (total / self.n - self.empty_m) / gap
        fit = -f
        if objective == "faithful":  # d(f - 1)^2 = 2 (f - 1) df, and grad holds -df
            grad *= -2 * (f - 1)
            fit = (f - 1) ** 2
        mask = torch.sigmoid(log_alpha.detach())
        penalty = mask[real].mean()
        grad += weight * mask * (1 - mask) * real / int(real.sum())
        return f, fit + weight * float(penalty), grad


def _check_learned(graph: Graph, log_alpha: Tensor) -> None:
    if not bool(torch.isfinite(log_alpha).all()):
        raise ValueError("the mask went non-finite during training: lower lr, or check the metric for overflow (float16)")  # fmt: skip
    if not bool((log_alpha >= 0)[graph.real].any()):
        raise ValueError("the mask collapsed to empty (every edge's m < 1/2): the sparsity penalty outweighed the metric; lower sparsity or steps, or raise init_scale")  # fmt: skip


def _scores(
    graph: Graph, start: Tensor, start_copies: Tensor | None, log_alpha: Tensor, seconds: float
) -> EdgeScores:
    """log_alpha as EdgeScores. On a grouped-query model (`start_copies` given) each query
    head's copy of a key/value edge scores its own warm start (init_scale * its helps / the
    same rms: the copies of an edge add up to the edge's start, as EAP-IG's copies add up) plus
    an equal share of what training moved the edge (log_alpha - start): an edge that training
    left alone keeps the warm start's per-copy order and signs, which MIB's per-copy evaluator
    ranks."""
    ungrouped = None
    if start_copies is not None:
        target = graph.ungrouped_target
        moved = (log_alpha - start)[:, target] / graph.copies.double()[target]
        ungrouped = (start_copies + moved) * graph.real[:, target]
    return dataclasses.replace(
        EdgeScores(graph, log_alpha, "mask", "denoise", ungrouped_scores=ungrouped),
        seconds=seconds,
    )
