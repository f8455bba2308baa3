"""`ra-lens circuit`: edge scores over the component graph, the faithfulness curve of circuits of
increasing size, and one circuit drawn and saved as EAP-IG/MIB JSON."""

from __future__ import annotations

import argparse
import math

from ra_lens.cli._shared import _emit_json, _floats, _model, _say
from ra_lens.cli.pairs import PAIR_KEYS, _circuit_pairs, _read_pairs

#: What `ra-lens circuit --out DIR` writes into DIR.
OUT_FILES = ("faithfulness_curve.png", "circuit.png", "circuit.json")
#: The faithfulness the saved circuit reaches when neither --faithfulness nor --edges is given.
DEFAULT_FAITHFULNESS = 0.8


def _run_circuit(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure

    from ra_lens import circuits
    from ra_lens.tasks import ioi
    from ra_lens.timing import timed

    sizes = None if args.sizes is None else _floats(args.sizes)
    file_pairs = [] if args.pairs is None else _read_pairs(args.pairs)  # before the model loads
    seconds: dict[str, float] = {}
    with timed(seconds, "load_model"):
        model = _model(args)
    pairs = _circuit_pairs(args, model, file_pairs)
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    # on a terminal tqdm's bars, piped or in a log plain lines (ra_lens.progress): never silent
    progress = True

    with timed(seconds, "attribute"):
        scores = circuits.attribute(
            model,
            clean,
            corrupted,
            metric,
            method=args.method,
            direction=args.direction,
            steps=args.steps,
            batch_size=args.batch_size,
            progress=progress,
        )
    with timed(seconds, "faithfulness_curve"):
        curve = circuits.faithfulness_curve(
            model,
            scores,
            clean,
            corrupted,
            metric,
            sizes=sizes,
            ablation=args.ablation,
            selection=args.selection,
            units=args.units,
            batch_size=args.batch_size,
            progress=progress,
        )
    found, n_asked = None, None
    if args.edges is not None:  # counted as MIB counts (ungrouped), as the curve and --mib
        n_asked = min(args.edges, scores.graph.n_edges_ungrouped)
        pick = scores.top if args.selection == "top" else scores.greedy
        circuit = pick(n_asked, units="ungrouped")
    else:
        with timed(seconds, "smallest_circuit"):
            found = circuits.smallest_circuit(
                model,
                scores,
                clean,
                corrupted,
                metric,
                curve,
                DEFAULT_FAITHFULNESS if args.faithfulness is None else args.faithfulness,
                batch_size=args.batch_size,
            )
        circuit = found.circuit
    kept = circuits.faithfulness(
        model,
        circuit,
        clean,
        corrupted,
        metric,
        ablation=args.ablation,
        batch_size=args.batch_size,
    )

    source = f"--task {args.task}" if args.pairs is None else f"--pairs {args.pairs}"
    _say(
        args,
        f"model: {args.model}   {source}: {len(pairs)} pairs   metric: logit(answer) - "
        f"logit(wrong)   clean {kept.clean_metric:.3f}, corrupted {kept.corrupted_metric:.3f}, "
        f"empty circuit ({args.ablation}) {kept.empty_metric:.3f}",
    )
    _say(
        args,
        f"scores: {args.method} ({args.direction}) over {scores.graph.n_edges} edges in "
        f"{seconds['attribute']:.1f} s\n",
    )
    _say(args, curve.table())
    if found is None:
        _say(
            args,
            f"\ncircuit: the {n_asked} edges with the largest |score| ({args.selection}), counted "
            f"as MIB counts (ungrouped); {circuit.n_edges_ungrouped} after pruning "
            f"({circuit.n_edges} in this graph), {len(circuit.nodes)} nodes, faithfulness "
            f"{kept.value:.4f}",
        )
    else:
        _say(args, f"\ncircuit: {found.summary()}; {len(circuit.nodes)} nodes")
    files = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        files = [args.out / n for n in OUT_FILES]
        ax = Figure(figsize=(5.5, 3.8), layout="constrained").add_subplot()
        ax.set_title(f"{args.method} circuits, {len(pairs)} pairs")
        curve.plot(files[0], ax=ax)
        circuit.draw(
            files[1],
            title=f"{args.method}: {circuit.n_edges} edges, faithfulness {kept.value:.3f}",
        )
        circuit.to_json(files[2])
    if args.mib is not None:
        files += circuits.export_mib(scores, args.mib, circuits=True, selection=args.selection)
    if args.html is not None:
        scores.to_html(
            args.html,
            curve=curve,
            circuit=circuit,
            faithfulness=kept.value,
            model=model,
            clean=clean,
            metric=metric,
            title=f"{args.model}: {args.method} circuits, {len(pairs)} pairs ({source})",
        )
        files.append(args.html)
    for f in files:
        _say(args, f"wrote {f}")
    _emit_json(
        args.json,
        {
            "model": args.model,
            "task": args.task,
            "pairs_file": None if args.pairs is None else str(args.pairs),
            "pairs": [{key: getattr(p, key) for key in PAIR_KEYS} for p in pairs],
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
                "edges_asked": n_asked,
                "target_faithfulness": None if found is None else found.target,
                "reached": None if found is None else found.reached,
                "search": None if found is None else found.measured,
                "n_edges": circuit.n_edges,
                "n_edges_ungrouped": circuit.n_edges_ungrouped,
                "nodes": circuit.nodes,
                "faithfulness": kept.value,
                # nan (a pair whose clean and corrupted metrics are equal) is not JSON: null
                "faithfulness_per_pair": [
                    None if math.isnan(v) else v for v in kept.per_pair.tolist()
                ],
            },
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0
