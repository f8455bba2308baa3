"""`ra-lens circuit`: edge scores over the component graph, the faithfulness curve of circuits of
increasing size, and one circuit drawn and saved as EAP-IG/MIB JSON."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ra_lens.cli._shared import emit_json, floats, load_model_of, say
from ra_lens.cli.pairs import PAIR_KEYS, circuit_pairs, read_pairs

if TYPE_CHECKING:  # the CLI imports torch and the circuits only once a command runs
    from ra_lens import circuits
    from ra_lens.tasks.ioi import PromptPair
    from ra_lens.types import HookedModel, MetricFn, Tokens

#: What `ra-lens circuit --out DIR` writes into DIR.
OUT_FILES = ("faithfulness_curve.png", "circuit.png", "circuit.json")
#: The faithfulness the saved circuit reaches when neither --faithfulness nor --edges is given.
DEFAULT_FAITHFULNESS = 0.8


@dataclass
class _Run:
    """What one `ra-lens circuit` run has measured so far, handed from step to step."""

    args: argparse.Namespace
    model: HookedModel
    pairs: list[PromptPair]
    clean: Tokens
    corrupted: Tokens
    metric: MetricFn
    seconds: dict[str, float]
    scores: circuits.EdgeScores | None = None
    # each circuit chosen once: the curve, the saved circuit, the MIB export and the page share it
    chosen: circuits.ChosenCircuits | None = None
    curve: circuits.FaithfulnessCurve | None = None
    circuit: circuits.Circuit | None = None
    found: circuits.SmallestCircuit | None = None
    n_asked: int | None = None
    kept: circuits.Faithfulness | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def source(self) -> str:
        a = self.args
        return f"--task {a.task}" if a.pairs is None else f"--pairs {a.pairs}"


def _run_circuit(args: argparse.Namespace) -> int:
    from ra_lens.tasks import ioi
    from ra_lens.timing import timed

    if args.method in ("mask", "discover") and args.direction != "denoise":
        raise ValueError(f"--method {args.method} trains from the corrupted run (denoise): drop --direction noise")  # fmt: skip
    file_pairs = [] if args.pairs is None else read_pairs(args.pairs)  # before the model loads
    seconds: dict[str, float] = {}
    with timed(seconds, "load_model"):
        model = load_model_of(args)
    pairs = circuit_pairs(args, model, file_pairs)
    run = _Run(args, model, pairs, *ioi.paired_batch(model, pairs), seconds=seconds)
    _score_and_curve(run)
    _choose_circuit(run)
    _report(run)
    _write_files(run)
    emit_json(args.json, _summary(run))
    return 0


def _score_and_curve(run: _Run) -> None:
    """Edge scores, then the faithfulness curve of MIB's circuits of each size, both rankings."""
    from ra_lens import circuits
    from ra_lens.timing import timed

    args = run.args
    # on a terminal tqdm's bars, piped or in a log plain lines (ra_lens.progress): never silent
    progress = True
    with timed(run.seconds, "attribute"):
        if args.method == "mask":
            scores = circuits.learn_mask(
                run.model, run.clean, run.corrupted, run.metric, rule="scaled",
                batch_size=args.batch_size, progress=progress,
            ).scores  # fmt: skip
        elif args.method == "discover":
            scores = circuits.discover(
                run.model, run.clean, run.corrupted, run.metric, batch_size=args.batch_size,
                progress=progress,
            )  # fmt: skip
        else:
            scores = circuits.attribute(
                run.model,
                run.clean,
                run.corrupted,
                run.metric,
                method=args.method,
                direction=args.direction,
                steps=args.steps,
                batch_size=args.batch_size,
                progress=progress,
            )
    run.scores = scores
    run.chosen = circuits.ChosenCircuits(scores, args.selection)
    with timed(run.seconds, "faithfulness_curve"):
        run.curve = circuits.faithfulness_curve(
            run.model,
            scores,
            run.clean,
            run.corrupted,
            run.metric,
            sizes=None if args.sizes is None else floats(args.sizes),
            ablation=args.ablation,
            selection=args.selection,
            units=args.units,
            batch_size=args.batch_size,
            progress=progress,
            chosen=run.chosen,
        )


def _choose_circuit(run: _Run) -> None:
    """The circuit to save: --edges edges (as MIB counts), else the smallest circuit reaching
    --faithfulness (default DEFAULT_FAITHFULNESS); then its faithfulness."""
    from ra_lens import circuits
    from ra_lens.timing import timed

    args, scores, chosen, curve = run.args, run.scores, run.chosen, run.curve
    assert scores is not None and chosen is not None and curve is not None
    if args.edges is not None:  # counted as MIB counts (ungrouped), as the curve and --mib
        run.n_asked = min(args.edges, scores.graph.n_edges_ungrouped)
        run.circuit = chosen.pick(run.n_asked, units="ungrouped")
    else:
        with timed(run.seconds, "smallest_circuit"):
            run.found = circuits.smallest_circuit(
                run.model,
                scores,
                run.clean,
                run.corrupted,
                run.metric,
                curve,
                DEFAULT_FAITHFULNESS if args.faithfulness is None else args.faithfulness,
                batch_size=args.batch_size,
                chosen=chosen,
            )
        run.circuit = run.found.circuit
    run.kept = circuits.faithfulness(
        run.model,
        run.circuit,
        run.clean,
        run.corrupted,
        run.metric,
        ablation=args.ablation,
        batch_size=args.batch_size,
    )


def _report(run: _Run) -> None:
    """The run's numbers on stdout (unless --quiet): metrics, scores, the curve, the circuit."""
    args, kept, circuit, scores, curve = run.args, run.kept, run.circuit, run.scores, run.curve
    assert kept is not None and circuit is not None and scores is not None and curve is not None
    say(
        args,
        f"model: {args.model}   {run.source}: {len(run.pairs)} pairs   metric: logit(answer) - "
        f"logit(wrong)   clean {kept.clean_metric:.3f}, corrupted {kept.corrupted_metric:.3f}, "
        f"empty circuit ({args.ablation}) {kept.empty_metric:.3f}",
    )
    say(
        args,
        f"scores: {args.method} ({args.direction}) over {scores.graph.n_edges} edges in "
        f"{run.seconds['attribute']:.1f} s\n",
    )
    say(args, curve.table())
    if run.found is None:
        say(
            args,
            f"\ncircuit: the {run.n_asked} edges with the largest |score| ({args.selection}), "
            f"counted as MIB counts (ungrouped); {circuit.n_edges_ungrouped} after pruning "
            f"({circuit.n_edges} in this graph), {len(circuit.nodes)} nodes, faithfulness "
            f"{kept.value:.4f}",
        )
    else:
        say(args, f"\ncircuit: {run.found.summary()}; {len(circuit.nodes)} nodes")


def _write_files(run: _Run) -> None:
    """--out's figures and circuit file, --mib's folder and --html's page, from the circuits
    already chosen."""
    from matplotlib.figure import Figure

    from ra_lens import circuits

    args, kept, circuit, scores, curve = run.args, run.kept, run.circuit, run.scores, run.curve
    assert kept is not None and circuit is not None and scores is not None and curve is not None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        run.files = [args.out / n for n in OUT_FILES]
        ax = Figure(figsize=(5.5, 3.8), layout="constrained").add_subplot()
        ax.set_title(f"{args.method} circuits, {len(run.pairs)} pairs")
        curve.plot(run.files[0], ax=ax)
        circuit.draw(
            run.files[1],
            title=f"{args.method}: {circuit.n_edges} edges, faithfulness {kept.value:.3f}",
        )
        circuit.to_json(run.files[2])
    if args.mib is not None:
        run.files += circuits.export_mib(
            scores, args.mib, circuits=True, selection=args.selection, chosen=run.chosen
        )
    if args.html is not None:
        from ra_lens.circuits.page import heads_ra, scores_page

        # the heads' RA is computed here and handed to the page, which only draws
        ra = heads_ra(run.model, run.clean, run.metric, graph=scores.graph)
        page = scores_page(
            scores,
            curve=curve,
            circuit=circuit,
            faithfulness=kept.value,
            ra=ra,
            metric=run.metric,
            title=f"{args.model}: {args.method} circuits, {len(run.pairs)} pairs ({run.source})",
            chosen=run.chosen,
        )
        page.save(args.html)
        run.files.append(args.html)
    for f in run.files:
        say(args, f"wrote {f}")


def _summary(run: _Run) -> dict[str, Any]:
    """What --json writes: the settings, the metrics, the curve, the circuit, times and files."""
    args, kept, circuit, scores, curve = run.args, run.kept, run.circuit, run.scores, run.curve
    assert kept is not None and circuit is not None and scores is not None and curve is not None
    found = run.found
    return {
        "model": args.model,
        "task": args.task,
        "pairs_file": None if args.pairs is None else str(args.pairs),
        "pairs": [{key: getattr(p, key) for key in PAIR_KEYS} for p in run.pairs],
        "method": args.method,
        "direction": args.direction,
        "steps": args.steps if args.method.endswith("-ig") else None,
        "metric": "logit(answer) - logit(wrong)",
        "clean_metric": kept.clean_metric,
        "corrupted_metric": kept.corrupted_metric,
        "empty_metric": kept.empty_metric,
        "faithfulness_baseline": kept.baseline,
        "n_edges_total": scores.graph.n_edges,
        "n_edges_ungrouped": scores.graph.n_edges_ungrouped,
        "curve": curve.to_dict(),
        "circuit": {
            "chosen_by": "edges" if found is None else "faithfulness",
            "edges_asked": run.n_asked,
            "target_faithfulness": None if found is None else found.target,
            "reached": None if found is None else found.reached,
            "search": None if found is None else found.measured,
            "n_edges": circuit.n_edges,
            "n_edges_ungrouped": circuit.n_edges_ungrouped,
            "nodes": circuit.nodes,
            "faithfulness": kept.value,
            # nan (a pair whose clean and corrupted metrics are equal) is not JSON: null
            "faithfulness_per_pair": [None if math.isnan(v) else v for v in kept.per_pair.tolist()],
        },
        "seconds": run.seconds,
        "files": [str(f) for f in run.files],
    }
