"""How much of a behaviour a circuit keeps: every edge outside it is patched (edge patching).

One forward pass on the clean prompts in which every reader r reads
    its input in this run - sum over its incoming edges w -> r NOT in the circuit of
    (w's output in this run - w's output on the corrupted prompt),
each reader on its own (the query of head 3 and of head 5 of one layer can differ; on a
grouped-query model a `<k>`/`<v>` edge patches that key/value head's input, for all the query
heads of its group; a per-copy circuit, `Circuit.ungrouped_edges`, patches each query head's copy
of it with that copy's own edges, as EAP-IG's evaluator does on its ungrouped model). See
`_edges.py` for the hooks.

Faithfulness, one definition everywhere in ra-lens (`faithfulness`, `FaithfulnessEvaluator`,
`faithfulness_curve`, `ra-lens circuit`, the circuit study), MIB's (`evaluate_area_under_curve`
in hannamw/MIB-circuit-track: the empty graph evaluated under the same intervention):

    f = (m(circuit) - m(empty)) / (m(clean) - m(empty))

m the metric's mean over pairs, "empty" the empty circuit under the chosen ablation (every edge
patched: the corrupted run for "patching", up to float rounding; every writer's mean output for
"mean"; zeros for "zero"), measured by the same edge-patching pass as the circuit. So the full
circuit gives 1 and the empty one 0 under every ablation. The corrupted run's metric is reported
too (`corrupted_metric`), but does not normalise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ra_lens import capture, contract, pairs, state
from ra_lens._typing import Validated
from ra_lens.capture import HookedModel
from ra_lens.circuits import _edges
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.graph import Graph
from ra_lens.progress import tqdm
from ra_lens.record import Recorded, json_ready
from ra_lens.types import MetricFn, Tokens
from ra_lens.weights import check_supported, layer_weights

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Ablation = Literal["patching", "mean", "zero"]
ABLATIONS: tuple[str, ...] = ("patching", "mean", "zero")
#: What every faithfulness in ra-lens is normalised by (stated in results and JSON).
BASELINE = "empty circuit under the same ablation (MIB)"


@dataclass
class Faithfulness(Recorded):
    """The result of `faithfulness`.

    Attributes:
        value: (circuit_metric - empty_metric) / (clean_metric - empty_metric), from the
            metrics' means over pairs (the module docstring's one definition).
        per_pair: Float[Tensor, "pair"]: the same ratio per pair (nan where a pair's clean and
            empty-circuit metrics are equal).
        circuit_metric, clean_metric, corrupted_metric, empty_metric: the metric's mean over
            pairs: the circuit, the clean run, the corrupted run, the empty circuit under
            `ablation`.
        circuit_per_pair, clean_per_pair, corrupted_per_pair, empty_per_pair:
            Float[Tensor, "pair"].
        n_edges: edges in the circuit.
        ablation: what replaced the corrupted outputs ("patching", "mean", "zero").
        baseline: what the value is normalised by, in words (the empty circuit).
    """

    value: float
    per_pair: Float[Tensor, "pair"]
    circuit_metric: float
    clean_metric: float
    corrupted_metric: float
    n_edges: int
    circuit_per_pair: Float[Tensor, "pair"]
    clean_per_pair: Float[Tensor, "pair"]
    corrupted_per_pair: Float[Tensor, "pair"]
    empty_metric: float = float("nan")
    empty_per_pair: Float[Tensor, "pair"] | None = None
    ablation: str = "patching"
    baseline: str = BASELINE

    def __repr__(self) -> str:
        # one line: the per-pair tensors are in the fields and in `table()`
        return (
            f"Faithfulness(value={self.value:.4f}, {self.n_edges} edges, "
            f"{len(self.per_pair)} pairs, ablation={self.ablation!r})"
        )

    def table(self) -> str:
        """A Markdown table: one row per pair (the metric of the circuit, clean, corrupted and
        empty-circuit runs, and the pair's faithfulness), then the mean row."""
        empty = self.empty_per_pair
        rows = [
            repr(self),
            "",
            "| pair | circuit | clean | corrupted | empty | faithfulness |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for i in range(len(self.per_pair)):
            e = float("nan") if empty is None else float(empty[i])
            rows.append(
                f"| {i} | {float(self.circuit_per_pair[i]):.4g} | "
                f"{float(self.clean_per_pair[i]):.4g} | {float(self.corrupted_per_pair[i]):.4g} "
                f"| {e:.4g} | {float(self.per_pair[i]):.4f} |"
            )
        rows.append(
            f"| mean | {self.circuit_metric:.4g} | {self.clean_metric:.4g} | "
            f"{self.corrupted_metric:.4g} | {self.empty_metric:.4g} | {self.value:.4f} |"
        )
        rows.append(f"\nfaithfulness normalised by the {self.baseline}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the per-pair tensors as lists (NaN as None)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value.tolist()
            out[f.name] = json_ready(value)
        return out

    def plot(self, save: str | Path | None = None) -> Figure:
        """Each pair's faithfulness as a bar (the mean in the title); `save` also writes it."""
        from ra_lens.viz import named_bars

        return named_bars(
            [f"pair {i}" for i in range(len(self.per_pair))], self.per_pair,
            title=f"faithfulness {self.value:.3f} ({self.n_edges} edges, {self.ablation})",
            xlabel="faithfulness (1: the clean run, 0: the empty circuit)", save=save,
        )  # fmt: skip


def faithfulness(
    model: Validated[HookedModel],
    circuit: Validated[Circuit],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    ablation: Validated[Ablation] = "patching",
    batch_size: int = 32,
    progress: bool = False,
) -> Faithfulness:
    """Run the clean prompts with every edge outside `circuit` patched, and compare.

    Args:
        model: a TransformerLens model (TransformerBridge or HookedTransformer), sequential
            attention/MLP blocks; may be split over devices (tensors stay on each layer's).
        circuit: a `Circuit` over `Graph.from_model(model)`.
        clean, corrupted: Int[Tensor, "batch pos"], Batch, strings; pair i the same token length.
        metric: logits -> Float[Tensor, "batch"] (one value per prompt), e.g.
            `metrics.logit_diff`; a plain callable needs batch_size >= the number of pairs.
        ablation: what a patched edge's writer output becomes: "patching" its output on the
            pair's corrupted prompt, "mean" its mean over all corrupted prompts (per position,
            real positions only), "zero" zero.
        batch_size: pairs per forward pass.

    Returns:
        Faithfulness: `.value` = (m(circuit) - m(empty)) / (m(clean) - m(empty)), `.per_pair`,
        `.circuit_metric`, `.clean_metric`, `.corrupted_metric`, `.empty_metric`, `.n_edges`.

    Raises:
        ValueError: unknown ablation, a circuit of another model's graph, unequal pair lengths,
            a metric without one value per prompt, clean and corrupted prompts with the same
            mean metric.
        NotImplementedError: readers this cannot rewrite (post-norm blocks on a
            HookedTransformer or with an output bias, ungrouped key/value heads, shortformer
            positions). Parallel attention/MLP blocks are supported.

    The full circuit keeps the clean metric (1), the empty one is the baseline (0):

    >>> from ra_lens.circuits.graph import Graph
    >>> from ra_lens.metrics import logit_diff
    >>> graph = Graph.from_model(model)
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> full = Circuit(graph, graph.real.clone())
    >>> result = faithfulness(model, full, clean, corrupted, logit_diff([294], [52]))
    >>> round(result.value, 6), result.n_edges == graph.n_edges
    (1.0, True)
    >>> empty = Circuit(graph, torch.zeros_like(graph.real))
    >>> faithfulness(model, empty, clean, corrupted, logit_diff([294], [52])).value  # the baseline
    0.0
    """
    _check_circuit(model, circuit)  # before any forward pass
    evaluator = FaithfulnessEvaluator(
        model, clean, corrupted, metric, ablation=ablation, batch_size=batch_size
    )
    return evaluator(circuit, progress=progress)


class FaithfulnessEvaluator:
    """`faithfulness` for many circuits of one model and set of pairs: the clean and corrupted
    runs (every writer's output on the corrupted prompts, or its mean) and the empty circuit
    (the normalising baseline) are taken once, here, so each circuit then costs one forward pass
    per batch instead of four (five with "mean").

    It holds every writer's output on the corrupted prompts: writers x pairs x pos x d_model
    floats (about 110 MB per 8 SmolLM2 pairs of 20 tokens), and during a call as much again for
    one batch (each writer's difference from it). The model must not change between
    calls (its weights are read once, here).

    >>> from ra_lens.circuits.graph import Graph
    >>> from ra_lens.metrics import logit_diff
    >>> graph, metric = Graph.from_model(model), logit_diff([294], [52])
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> evaluate = FaithfulnessEvaluator(model, clean, corrupted, metric)
    >>> full = Circuit(graph, graph.real.clone())
    >>> evaluate(full).value == faithfulness(model, full, clean, corrupted, metric).value
    True
    """

    def __init__(
        self,
        model: Validated[HookedModel],
        clean: Tokens,
        corrupted: Tokens,
        metric: MetricFn,
        *,
        ablation: Validated[Ablation] = "patching",
        batch_size: int = 32,
    ) -> None:
        if ablation not in ABLATIONS:
            raise ValueError(f"unknown ablation {ablation!r}: choose one of {ABLATIONS}")
        capture.check_model(model)
        facts = contract.model_facts(model)
        check_supported(model, facts)
        self.model, self.ablation = model, ablation
        self.graph = Graph.from_model(model)
        self._clean, corrupted_b = pairs.paired(model, clean, corrupted)
        n = self._clean.tokens.shape[0]
        self._rows = pairs.chunks(n, batch_size)
        self._metrics = [pairs.metric_rows(metric, rows, n) for rows in self._rows]
        clean_values, corrupted_values = [], []
        self._references: list[Tensor] = []
        with capture.preserved_state(model), torch.no_grad():
            state.enable_mlp_in(model)
            self._weights = [layer_weights(model, la, facts) for la in range(self.graph.n_layers)]
            for rows, part_metric in zip(self._rows, self._metrics, strict=True):
                clean_part = self._clean.rows(rows)
                corrupted_part = corrupted_b.rows(rows)
                logits = model(clean_part.tokens)
                clean_values.append(pairs.metric_values(part_metric, logits, clean_part))
                run = _edges.EdgeRun(self.graph, self._weights)
                with model.hooks(fwd_hooks=run.hooks(model)):
                    logits = model(corrupted_part.tokens)
                corrupted_values.append(pairs.metric_values(part_metric, logits, corrupted_part))
                self._references.append(run.outputs())
        if ablation == "mean":
            mean = _mean_outputs(self._references, corrupted_b, self._rows)
            self._references = [mean.expand_as(ref) for ref in self._references]
        elif ablation == "zero":
            self._references = [torch.zeros_like(ref[:, :1]).expand_as(ref) for ref in self._references]  # fmt: skip
        self.clean_per_pair = torch.cat(clean_values).detach().double().cpu()
        self.corrupted_per_pair = torch.cat(corrupted_values).detach().double().cpu()
        _check_contrast(self.clean_per_pair, self.corrupted_per_pair)
        # MIB's baseline: the empty circuit, every edge patched, by the same pass as a circuit
        self.empty_per_pair = self._circuit_values(self.graph.real)

    def _circuit_values(
        self,
        mask: Bool[Tensor, "writer reader"],
        progress: bool = False,
        copy_mask: Bool[Tensor, "writer ureader"] | None = None,
    ) -> Float[Tensor, " pair"]:
        """The metric per pair with the edges in `mask` patched (`copy_mask`: per copy, the
        key/value copies' edges): one forward pass per batch (`group` slots per copy)."""
        model, parts = self.model, []
        with capture.preserved_state(model), torch.no_grad():
            state.enable_mlp_in(model)
            batches = zip(self._rows, self._metrics, self._references, strict=True)
            for rows, part_metric, reference in tqdm(
                list(batches), desc="faithfulness", disable=not progress
            ):
                clean_part = self._clean.rows(rows)
                patched = _edges.EdgeRun(
                    self.graph, self._weights, reference=reference, mask=mask, copy_mask=copy_mask
                )
                with model.hooks(fwd_hooks=patched.hooks(model)):
                    logits = patched.first_slot(model(patched.expand(clean_part.tokens)))
                parts.append(pairs.metric_values(part_metric, logits, clean_part))
        return torch.cat(parts).detach().double().cpu()

    def __call__(self, circuit: Validated[Circuit], *, progress: bool = False) -> Faithfulness:
        """Faithfulness of one circuit: one forward pass per batch of pairs."""
        graph = _check_circuit(self.model, circuit)
        mask = graph.real & ~circuit.edges.to(torch.bool).cpu()
        copy_mask = None
        if circuit.ungrouped_edges is not None:  # per copy (the module docstring)
            copy_mask = graph.real[:, graph.ungrouped_target] & ~circuit.ungrouped_edges
        circuit_values = self._circuit_values(mask, progress, copy_mask)
        clean_v, empty_v = self.clean_per_pair, self.empty_per_pair
        clean_m, empty_m = float(clean_v.mean()), float(empty_v.mean())
        circuit_m = float(circuit_values.mean())
        gap = clean_v - empty_v
        per_pair = (circuit_values - empty_v) / gap
        # A pair whose empty circuit is its clean run (to rounding: the two come from different
        # passes) has no ratio: x / 0 would be +-inf or rounding noise; undefined, as 0 / 0.
        flat = gap.abs() <= 1e-6 * torch.maximum(clean_v.abs(), empty_v.abs()).clamp_min(1e-30)
        return Faithfulness(
            value=(circuit_m - empty_m) / (clean_m - empty_m),
            per_pair=per_pair.masked_fill(flat, float("nan")),
            circuit_metric=circuit_m,
            clean_metric=clean_m,
            corrupted_metric=float(self.corrupted_per_pair.mean()),
            n_edges=int((circuit.edges.cpu() & graph.real).sum()),
            circuit_per_pair=circuit_values,
            clean_per_pair=clean_v,
            corrupted_per_pair=self.corrupted_per_pair,
            empty_metric=empty_m,
            empty_per_pair=empty_v,
            ablation=self.ablation,
        )


def _check_contrast(clean: Float[Tensor, " pair"], corrupted: Float[Tensor, " pair"]) -> None:
    """Refuse pairs whose mean clean and corrupted metrics agree (to one part in a million,
    about the float32 rounding of a forward pass): faithfulness divides by their difference."""
    clean_m, corrupted_m = float(clean.mean()), float(corrupted.mean())
    if abs(clean_m - corrupted_m) <= 1e-6 * max(abs(clean_m), abs(corrupted_m)):
        raise ValueError(
            f"the clean and corrupted prompts give the same mean metric ({clean_m:.6g} and "
            f"{corrupted_m:.6g}), so there is no behaviour for a circuit to keep: faithfulness, "
            "(m(circuit) - m(empty)) / (m(clean) - m(empty)), divides by 0 under patching, "
            "where the empty circuit is the corrupted run; give pairs on which the metric "
            "differs (identical prompts, answer == wrong, or corrupted prompts that are the "
            "clean ones in another order give none)"
        )


def _check_circuit(model: HookedModel, circuit: Circuit) -> Graph:
    graph = Graph.from_model(model)
    if not isinstance(circuit, Circuit):
        raise TypeError(
            f"circuit must be a ra_lens.circuits.Circuit, got {type(circuit).__name__}: build one "
            "with EdgeScores.top(n) or Circuit(graph, edges)"
        )
    if circuit.graph != graph:
        raise ValueError(
            f"the circuit is over {circuit.graph}, the model's graph is {graph}: build the "
            "circuit from this model's scores or Graph.from_model(model)"
        )
    if tuple(circuit.edges.shape) != tuple(graph.real.shape):
        raise ValueError(
            f"circuit.edges has shape {tuple(circuit.edges.shape)}, the graph needs "
            f"{tuple(graph.real.shape)} (writers x readers)"
        )
    return graph


def _mean_outputs(
    outputs: list[Tensor], corrupted: capture.Batch, rows_list: list[slice]
) -> Float[Tensor, "writer 1 pos d_model"]:
    """Each writer's output averaged over the corrupted prompts, per position, counting only the
    prompts that reach that position."""
    total: Tensor | None = None
    counts = torch.zeros(corrupted.tokens.shape[1], device=corrupted.tokens.device)
    for rows, output in zip(rows_list, outputs, strict=True):
        real = corrupted.rows(rows).real_mask()
        part_sum = (output * real[None, :, :, None].to(output.device)).sum(1, keepdim=True)
        total = part_sum if total is None else total + part_sum
        counts += real.sum(0).to(counts.device)
    assert total is not None
    return total / counts.clamp(min=1).to(total.device, total.dtype)[None, None, :, None]
