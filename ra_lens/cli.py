"""The `ra-lens` command: RA maps of a prompt, attention patching and head ranking on ICL tasks.

ra-lens maps --prompt "I like Italy and France. I visited the city of" --target " Florence"
ra-lens patch --task antonym --shots 0
ra-lens rank --task antonym --shots 5
ra-lens attribute --clean "When Mary and John went to the store, John gave a drink to" \
    --corrupted "When Alice and Bob went to the store, John gave a drink to" --target " Mary" --wrong " John"
ra-lens circuit --task ioi --method exact --sizes 0.01,0.05,0.2,1 --out circuit/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ra_lens.files import is_stream, write_file
from ra_lens.types import HookedModel

MODEL_HELP = (
    "model: 'smollm2-135m' (default, embedded, offline), a hub name for users with a network, "
    "or a tiny model with random weights, for trying the tool in seconds: 'tiny-gpt2', "
    "'tiny-llama', 'tiny-opt', 'tiny-native' (TransformerLens >= 3) or 'tiny-hooked' "
    "(TransformerLens 2)"
)


def main(argv: list[str] | None = None) -> int:
    """Run the `ra-lens` command with `argv` (default: the process's arguments); returns the exit
    status: 0, or 2 after printing `ra-lens COMMAND: error: ...` to stderr.

    `--model tiny-gpt2` (TransformerLens >= 3) or `tiny-hooked` (TransformerLens 2) is a random
    tiny model, built in a second:

    >>> import contextlib, io, json, math
    >>> from ra_lens.models import bridge_available
    >>> tiny = "tiny-gpt2" if bridge_available() else "tiny-hooked"
    >>> args = ["--prompt", "The capital of France is", "--target", " Paris", "--top", "3"]
    >>> with contextlib.redirect_stdout(io.StringIO()) as out:
    ...     status = main(["maps", "--model", tiny, *args, "--json", "-"])
    >>> report = json.loads(out.getvalue())
    >>> nll = math.isclose(report["metric"], -math.log(report["target_prob"]), rel_tol=1e-5)
    >>> status, len(report["top_heads"]), nll  # the metric is -log p(target)
    (0, 3, True)
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ra-lens {args.command}: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The `ra-lens` argument parser (every command and its options)."""
    parser = argparse.ArgumentParser(
        prog="ra-lens",
        description="Reversed Attention (dL/d(QK^T), Katz & Wolf 2025) for TransformerLens models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    maps = sub.add_parser(
        "maps",
        help="RA of every head for one prompt and target: table, heat maps, circuitsvis page",
        description="Compute Reversed Attention of every head for -log p(target | prompt), print "
        "the heads with the largest RA norm, and write plots and an HTML view.",
    )
    maps.add_argument("--prompt", required=True, help="the prompt text")
    maps.add_argument("--target", required=True, help="the target text, e.g. ' Florence'")
    maps.add_argument(
        "--completion",
        action="store_true",
        help="teacher-force the whole target (mean NLL of all its tokens) instead of its first token",
    )
    maps.add_argument("--convention", default="qk", choices=["qk", "scores", "pattern"])
    maps.add_argument(
        "--top", type=_positive_int, default=10, metavar="K", help="heads in the table (10)"
    )
    _common(maps)
    maps.set_defaults(run=_run_maps)

    patch = sub.add_parser(
        "patch",
        help="attention patching on an ICL task: accuracy against patching scale",
        description="Average RA over training prompts of an ICL task, add scale x mean RA to the "
        "attention of held-out prompts, and report top-1/3 accuracy per scale against the "
        "forward-pattern baseline.",
    )
    _task_args(patch)
    patch.add_argument("--shots", type=int, default=0, help="demonstrations per prompt (0)")
    patch.add_argument(
        "--n-prompts", type=int, default=25, help="prompts whose RA is averaged (25)"
    )
    patch.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    patch.add_argument(
        "--scales",
        default=None,
        help="comma-separated scales (default: the paper's grid, extended)",
    )
    _common(patch)
    patch.set_defaults(run=_run_patch)

    rank = sub.add_parser(
        "rank",
        help="rank heads by RA against causal mediation, activation and attribution patching",
        description="Rank attention heads for an ICL task by RA norm and by the baselines, then "
        "keep the top p% of heads (ablating the rest) and measure accuracy.",
    )
    rank.add_argument(
        "--task",
        required=True,
        action="append",
        help="ICL task (repeat for several), one of: " + ", ".join(_task_names()),
    )
    rank.add_argument(
        "--rankings",
        default=None,
        help="comma-separated rankings (default all): " + ", ".join(_ranking_names()),
    )
    rank.add_argument("--shots", type=int, default=5, help="demonstrations per prompt (5)")
    rank.add_argument("--n-prompts", type=int, default=25, help="prompts per ranking (25)")
    rank.add_argument("--n-test", type=int, default=None, help="cap on test prompts (all)")
    rank.add_argument(
        "--ablation", default="zero", choices=["zero", "mean"], help="how heads are removed (zero)"
    )
    rank.add_argument(
        "--fractions", default=None, help="comma-separated fractions of heads kept (0,0.1,...,1)"
    )
    _common(rank)
    rank.set_defaults(run=_run_rank)

    attribute = sub.add_parser(
        "attribute",
        help="query/key/pattern attribution of every head for a clean/corrupted pair",
        description="Estimate, for every head, what patching its queries, keys or pattern from "
        "the clean prompt into the corrupted one does to logit(target) - logit(wrong) (or to "
        "p(target) without --wrong), with an exact softmax for queries and keys (AtP*'s fix).",
    )
    attribute.add_argument("--clean", help="the clean prompt (or --task / --pairs)")
    attribute.add_argument("--corrupted", help="the corrupted prompt (same token length)")
    attribute.add_argument("--target", help="the clean answer, e.g. ' Mary'")
    _pair_source_args(attribute, required=False)
    attribute.add_argument(
        "--wrong", default=None, help="a wrong answer: metric = logit(target) - logit(wrong)"
    )
    attribute.add_argument("--method", default="exact", choices=["exact", "linear"])
    attribute.add_argument("--direction", default="denoise", choices=["denoise", "noise"])
    attribute.add_argument(
        "--top", type=_positive_int, default=10, metavar="K", help="rows per table (10)"
    )
    _common(attribute)
    attribute.set_defaults(run=_run_attribute)
    _add_circuit_command(sub)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "bridge", "hooked"],
        help="TransformerBridge (TL >= 3), HookedTransformer (TL 2.x) or auto: the bridge where "
        "installed (auto)",
    )
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write plots here")
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="write machine-readable results ('-': stdout)"
    )


def _task_args(parser: argparse.ArgumentParser) -> None:
    from ra_lens import tasks

    parser.add_argument(
        "--task", required=True, help=f"ICL task, one of: {', '.join(tasks.available())}"
    )


def _load(name: str, backend: str = "auto") -> HookedModel:
    """The model behind --model: a tiny random one (``tiny-ARCH``) or `load_model`'s."""
    if name.startswith("tiny-"):
        from ra_lens.toy_models import tiny_model

        return tiny_model(name.removeprefix("tiny-"))
    from ra_lens.models import load_model

    return load_model(name, backend=backend, device="cpu")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before the computation (which can take many minutes), not after it, when --out or
    --json cannot be written."""
    out: Path | None = getattr(args, "out", None)
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file: give a folder (it is created if missing)")
        _check_writable_folder(out, "--out")
    target = getattr(args, "json", None)
    if target is not None and target != "-" and not is_stream(target):
        path = Path(os.path.realpath(target))  # a symlink is written through: check its target
        if path.exists() and not path.is_file():
            raise ValueError(
                f"--json {target} is a folder: give a file name such as {target}/out.json"
            )
        _check_writable_folder(path.parent, "--json")


def _check_writable_folder(folder: Path, flag: str) -> None:
    existing = folder
    while not existing.exists():  # the nearest existing ancestor decides whether mkdir works
        existing = existing.parent
    try:  # a real write: os.access says yes to root even on read-only file systems
        if not existing.is_dir():
            raise NotADirectoryError(existing)
        tempfile.TemporaryFile(dir=existing).close()
    except OSError:
        raise ValueError(
            f"{flag}: cannot write into {existing}: choose a writable folder"
        ) from None


def _emit_json(target: str | None, payload: dict[str, Any]) -> None:
    """Print the report (`-`), or write it with the library's one writer: through symlinks,
    keeping an existing file's mode, directly into a FIFO or /dev/stdout, atomically otherwise."""
    if target is None:
        return
    text = json.dumps(payload, indent=2)
    if target == "-":
        print(text)
        return
    sys.stdout.flush()  # /dev/stdout may be the terminal the tables went to: keep the order
    write_file(target, text + "\n", make_folders=True)


def _say(args: argparse.Namespace, message: str) -> None:
    # With --json - the JSON owns stdout; everything else goes to stderr.
    print(message, file=sys.stderr if args.json == "-" else sys.stdout)


def _run_maps(args: argparse.Namespace) -> int:
    import torch

    from ra_lens import metrics, reversed_attention, to_batch

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    model = _load(args.model, args.backend)
    seconds["load_model"] = time.perf_counter() - start

    prompt_tokens = to_batch(model, args.prompt).tokens  # refuses text longer than n_ctx
    target_ids = model.to_tokens(args.target, prepend_bos=False)[0].tolist()
    if not target_ids:
        raise ValueError("--target is empty: give the text the model should produce")
    if args.completion:
        tokens, metric = metrics.completion(model, args.prompt, args.target)
    else:
        tokens, metric = prompt_tokens, metrics.target_nll([target_ids[0]])
    start = time.perf_counter()
    ra = reversed_attention(model, tokens, metric, convention=args.convention)
    seconds["reversed_attention"] = time.perf_counter() - start

    with torch.no_grad():
        probs = model(prompt_tokens)[0, -1].float().softmax(-1)
    top_p, top_ids = probs.topk(5)
    predictions = [
        {"token": model.tokenizer.decode([i]), "id": i, "prob": p}
        for i, p in zip(top_ids.tolist(), top_p.tolist())
    ]
    target_prob = float(probs[target_ids[0]])
    report = ra.to_dict(k=args.top)

    first = model.tokenizer.decode([target_ids[0]])
    _say(args, f"model: {args.model}   prompt: {args.prompt!r}   target: {args.target!r}")
    _say(
        args,
        f"metric: -log p({first!r}) = {report['metric']:.3f}"
        if not args.completion
        else f"metric: mean NLL of {args.target!r} = {report['metric']:.3f}",
    )
    _say(
        args,
        "top predictions: "
        + ", ".join(f"{p['token']!r} {p['prob']:.1%}" for p in predictions)
        + f"   (target {first!r}: {target_prob:.1%})",
    )
    _say(args, "\n" + ra.table(args.top))
    _say(
        args,
        f"\nRA of {ra.norms.shape[1] * ra.norms.shape[2]} heads in "
        f"{seconds['reversed_attention']:.2f} s (one forward + one backward pass)",
    )

    files = []
    if args.out is not None:
        from ra_lens import viz

        args.out.mkdir(parents=True, exist_ok=True)
        viz.head_norm_heatmaps(ra, save=args.out / "head_norms.png")
        viz.top_heads_grid(ra, k=min(4, args.top), save=args.out / "top_heads.png")
        viz.circuitsvis_heads(
            ra, ra.top_heads(min(8, args.top)), save=args.out / "reversed_attention.html"
        )
        files = [
            args.out / n for n in ("head_norms.png", "top_heads.png", "reversed_attention.html")
        ]
        for f in files:
            _say(args, f"wrote {f}")
    _emit_json(
        args.json,
        {
            "model": args.model,
            "prompt": args.prompt,
            "target": args.target,
            **report,
            "target_prob": target_prob,
            "predictions": predictions,
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0


def _run_patch(args: argparse.Namespace) -> int:
    from ra_lens.experiments import DEFAULT_SCALES, attention_patching

    scales = DEFAULT_SCALES if args.scales is None else _floats(args.scales)
    model = _load(args.model, args.backend)
    result = attention_patching(
        model,
        args.task,
        shots=args.shots,
        n_prompts=args.n_prompts,
        scales=scales,
        n_test=args.n_test,
    )
    _say(args, result.table())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"patching_{args.task}_{args.shots}shot.png"
        result.plot(save=path)
        _say(args, f"wrote {path}")
    _emit_json(args.json, result.to_dict())
    return 0


def _run_rank(args: argparse.Namespace) -> int:
    from ra_lens.experiments import head_ranking
    from ra_lens.experiments.head_ranking import check_rankings

    extra: dict[str, Any] = {} if args.fractions is None else {"fractions": _floats(args.fractions)}
    if args.rankings is not None:
        extra["rankings"] = check_rankings(
            [n.strip() for n in args.rankings.split(",") if n.strip()]
        )
    model = _load(args.model, args.backend)
    results = []
    for task in args.task:
        result = head_ranking(
            model,
            task,
            shots=args.shots,
            n_prompts=args.n_prompts,
            n_test=args.n_test,
            ablation=args.ablation,
            **extra,
        )
        results.append(result)
        _say(args, result.table())
        if args.out is not None:
            out = args.out if len(args.task) == 1 else args.out / task
            for path in result.plots(out):
                _say(args, f"wrote {path}")
    # One task: its result as before; several: {"results": [one per task]}.
    dicts = [r.to_dict() for r in results]
    _emit_json(args.json, dicts[0] if len(dicts) == 1 else {"results": dicts})
    return 0


def _first_token(model: HookedModel, text: str, flag: str) -> int:
    ids = model.to_tokens(text, prepend_bos=False)[0].tolist()
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens: give a one-token answer")
    return int(ids[0])


def _run_attribute(args: argparse.Namespace) -> int:
    from ra_lens import attention_attribution

    file_pairs = _attribute_source(args)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    model = _load(args.model, args.backend)
    seconds["load_model"] = time.perf_counter() - start
    clean, corrupted, metric, metric_name = _attribute_inputs(args, model, file_pairs)
    start = time.perf_counter()
    att = attention_attribution(
        model, clean, corrupted, metric, method=args.method, direction=args.direction
    )
    seconds["attention_attribution"] = time.perf_counter() - start
    att = _with_clean_labels(att, model, clean)

    report = att.to_dict(k=args.top)
    _say(args, f"model: {args.model}   metric: {metric_name}   {args.method}, {args.direction}")
    clean_value, corrupted_value = (
        float(att.clean_metric.mean()),
        float(att.corrupted_metric.mean()),
    )
    n_pairs = len(att.clean_metric)
    _say(
        args,
        f"{metric_name}: clean {clean_value:.3f}, corrupted {corrupted_value:.3f}"
        + (f" (means over {n_pairs} pairs)" if n_pairs > 1 else ""),
    )
    _say(args, "\n" + att.table(args.top))
    _say(args, f"\nall heads in {seconds['attention_attribution']:.2f} s")

    files = []
    if args.out is not None:
        from ra_lens import viz

        args.out.mkdir(parents=True, exist_ok=True)
        files = [args.out / n for n in ("attribution_heatmaps.png", "top_edges.png", "edges.html")]
        viz.attribution_heatmaps(att, save=files[0])
        viz.top_edges_on_tokens(att, k=min(8, args.top), save=files[1])
        heads = list(dict.fromkeys((e["layer"], e["head"]) for e in report["top_edges"]))[:8]
        viz.attribution_edges_page(att, heads, save=files[2])
        for f in files:
            _say(args, f"wrote {f}")
    _emit_json(
        args.json,
        {
            "model": args.model,
            "clean": args.clean,
            "corrupted": args.corrupted,
            "target": args.target,
            "wrong": args.wrong,
            "task": args.task,
            "pairs_file": None if args.pairs is None else str(args.pairs),
            "n_pairs": n_pairs,
            "metric": metric_name,
            **report,
            # Means over the pairs: the run that was patched (denoise: the corrupted one) and
            # the other one.
            "metric_patched_run": corrupted_value if att.direction == "denoise" else clean_value,
            "metric_other_run": clean_value if att.direction == "denoise" else corrupted_value,
            "seconds": seconds,
            "files": [str(f) for f in files],
        },
    )
    return 0


CIRCUIT_TASKS = ("ioi", "country-capital")
PAIR_KEYS = ("clean", "corrupted", "answer", "wrong")


def _add_circuit_command(sub: Any) -> None:
    circuit = sub.add_parser(
        "circuit",
        help="edge scores over the component graph, a circuit and its faithfulness curve",
        description="Score every edge writer -> reader (input, head outputs, MLPs -> queries, "
        "keys, values, MLPs, logits) for logit(answer) - logit(wrong) over many clean/corrupted "
        "pairs, measure the faithfulness of circuits of increasing size by edge patching (with "
        "MIB's CPR and CMD), and write the curve, a picture and the EAP-IG/MIB JSON file of one "
        "circuit.",
    )
    _pair_source_args(circuit, required=True)
    circuit.add_argument(
        "--method", default="exact", choices=["eap", "eap-ig", "exact", "exact-ig"]
    )
    circuit.add_argument("--direction", default="denoise", choices=["denoise", "noise"])
    circuit.add_argument(
        "--steps", type=_positive_int, default=5, help="IG steps (eap-ig, exact-ig; 5)"
    )
    circuit.add_argument(
        "--sizes",
        default=None,
        help="comma-separated fractions of the graph's edges, increasing (default MIB's "
        "0.001,0.002,0.005,0.01,0.02,0.05,0.1,0.2,0.5,1)",
    )
    circuit.add_argument("--selection", default="top", choices=["top", "greedy"])
    circuit.add_argument("--ablation", default="patching", choices=["patching", "mean", "zero"])
    circuit.add_argument(
        "--edges",
        type=_positive_int,
        default=40,
        metavar="N",
        help="edges asked for in the circuit that is drawn and saved (40; fewer after pruning)",
    )
    circuit.add_argument("--batch-size", type=_positive_int, default=8, help="pairs per pass (8)")
    _common(circuit)
    circuit.set_defaults(run=_run_circuit)


def _pair_source_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--task", choices=CIRCUIT_TASKS, help="built-in paired prompts")
    source.add_argument(
        "--pairs",
        type=Path,
        metavar="FILE.jsonl",
        help='one pair a line: {"clean": ..., "corrupted": ..., "answer": ..., "wrong": ...} '
        "(answers one token; clean and corrupted the same token length)",
    )
    parser.add_argument(
        "--n-pairs", type=_positive_int, default=16, metavar="N", help="pairs used (16)"
    )


def _attribute_source(args: argparse.Namespace) -> list[Any]:
    """Check that `attribute` got one pair (--clean/--corrupted/--target) or many (--task or
    --pairs), not both; returns the pairs of --pairs (read before the model loads)."""
    one = [flag for flag in ("clean", "corrupted", "target", "wrong") if getattr(args, flag)]
    if args.task is not None or args.pairs is not None:
        if one:
            raise ValueError(
                f"--{one[0]} with --task/--pairs: give one pair (--clean, --corrupted, --target) "
                "or many (--task or --pairs), not both"
            )
        return [] if args.pairs is None else _read_pairs(args.pairs)
    missing = [f"--{flag}" for flag in ("clean", "corrupted", "target") if not getattr(args, flag)]
    if missing:
        raise ValueError(
            f"missing {', '.join(missing)}: give --clean, --corrupted and --target (one pair), "
            "or --task / --pairs FILE.jsonl (many pairs)"
        )
    return []


def _attribute_inputs(
    args: argparse.Namespace, model: Any, file_pairs: list[Any]
) -> tuple[Any, Any, Any, str]:
    """(clean, corrupted, metric, metric name) for `attribute`: one pair from the flags, or the
    pairs of --task / --pairs with logit(answer) - logit(wrong) per pair."""
    from ra_lens import metrics, to_batch
    from ra_lens.tasks import ioi

    if args.clean is None:
        clean, corrupted, metric = ioi.paired_batch(model, _circuit_pairs(args, model, file_pairs))
        return clean, corrupted, metric, "logit(answer) - logit(wrong)"
    target = _first_token(model, args.target, "--target")
    if args.wrong is None:
        metric, metric_name = metrics.target_prob([target]), f"p({args.target!r})"
    else:
        wrong = _first_token(model, args.wrong, "--wrong")
        metric = metrics.logit_diff([target], [wrong])
        metric_name = f"logit({args.target!r}) - logit({args.wrong!r})"
    return to_batch(model, args.clean), to_batch(model, args.corrupted), metric, metric_name


def _with_clean_labels(att: Any, model: Any, clean: Any) -> Any:
    """The attribution with the CLEAN prompts' tokens as labels: under "denoise" the patched run
    is the corrupted one, whose tokens (" Bob" where the clean prompt has " John") would name
    the edges of an analysis of the clean behaviour."""
    import dataclasses

    from ra_lens import capture

    return dataclasses.replace(att, str_tokens=capture.str_tokens(model, clean))


def _read_pairs(path: Path) -> list[Any]:
    """PromptPairs from a JSONL file, one {"clean", "corrupted", "answer", "wrong"} a line."""
    from ra_lens.tasks.ioi import PromptPair

    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"--pairs {path}: no such file") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--pairs {path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or set(row) != set(PAIR_KEYS):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"--pairs {path}, line {number}: expected an object with exactly the keys "
                f"{list(PAIR_KEYS)}, got {got}"
            )
        if not all(isinstance(row[key], str) and row[key] for key in PAIR_KEYS):
            raise ValueError(f"--pairs {path}, line {number}: every value must be non-empty text")
        pairs.append(PromptPair(*(row[key] for key in PAIR_KEYS)))
    if not pairs:
        raise ValueError(f"--pairs {path}: no pairs in the file")
    return pairs


def _circuit_pairs(args: argparse.Namespace, model: Any, file_pairs: list[Any]) -> list[Any]:
    """The pairs to use: the first --n-pairs of the file (each must suit the tokenizer) or of
    the task's pairs that suit it."""
    from ra_lens.tasks import ioi

    if args.pairs is not None:
        pairs = file_pairs[: args.n_pairs]
        for number, pair in enumerate(pairs, 1):
            if not ioi.usable(model, [pair]):
                raise ValueError(
                    f"--pairs {args.pairs}, pair {number}: answer and wrong must be one token "
                    "each and clean/corrupted the same number of tokens for this model"
                )
        return pairs
    if args.task == "ioi":
        pairs = ioi.usable(model, ioi.ioi_pairs(max(40, 4 * args.n_pairs)))
    else:
        pairs = ioi.capital_pairs(model)
    if not pairs:
        raise ValueError(
            f"--task {args.task}: no pair suits this model's tokenizer (one-token answers, "
            "equal token lengths); write your own with --pairs FILE.jsonl"
        )
    return pairs[: args.n_pairs]


def _run_circuit(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure

    from ra_lens import circuits
    from ra_lens.tasks import ioi

    sizes = None if args.sizes is None else _floats(args.sizes)
    file_pairs = [] if args.pairs is None else _read_pairs(args.pairs)  # before the model loads
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    model = _load(args.model, args.backend)
    seconds["load_model"] = time.perf_counter() - start
    pairs = _circuit_pairs(args, model, file_pairs)
    clean, corrupted, metric = ioi.paired_batch(model, pairs)
    progress = sys.stderr.isatty()

    start = time.perf_counter()
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
    seconds["attribute"] = time.perf_counter() - start
    assert isinstance(scores, circuits.EdgeScores)
    start = time.perf_counter()
    curve = circuits.faithfulness_curve(
        model,
        scores,
        clean,
        corrupted,
        metric,
        sizes=sizes,
        ablation=args.ablation,
        selection=args.selection,
        progress=progress,
    )
    seconds["faithfulness_curve"] = time.perf_counter() - start
    n_edges = min(args.edges, scores.graph.n_edges)
    circuit = scores.top(n_edges) if args.selection == "top" else scores.greedy(n_edges)
    kept = circuits.faithfulness(
        model, circuit, clean, corrupted, metric, ablation=args.ablation, batch_size=32
    )

    source = f"--task {args.task}" if args.pairs is None else f"--pairs {args.pairs}"
    _say(
        args,
        f"model: {args.model}   {source}: {len(pairs)} pairs   metric: logit(answer) - "
        f"logit(wrong)   clean {kept.clean_metric:.3f}, corrupted {kept.corrupted_metric:.3f}",
    )
    _say(
        args,
        f"scores: {args.method} ({args.direction}) over {scores.graph.n_edges} edges in "
        f"{seconds['attribute']:.1f} s\n",
    )
    _say(args, curve.table())
    _say(
        args,
        f"\ncircuit ({args.selection} {n_edges}, pruned): {circuit.n_edges} edges, "
        f"{len(circuit.nodes)} nodes, faithfulness {kept.value:.4f}",
    )

    files = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        files = [args.out / n for n in ("faithfulness_curve.png", "circuit.png", "circuit.json")]
        ax = Figure(figsize=(5.5, 3.8), layout="constrained").add_subplot()
        ax.set_title(f"{args.method} circuits, {len(pairs)} pairs")
        curve.plot(files[0], ax=ax)
        circuit.draw(
            files[1],
            title=f"{args.method}: {circuit.n_edges} edges, faithfulness {kept.value:.3f}",
        )
        circuit.to_json(files[2])
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
            "n_edges_total": scores.graph.n_edges,
            "curve": curve.to_dict(),
            "circuit": {
                "edges_asked": n_edges,
                "n_edges": circuit.n_edges,
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


def _task_names() -> list[str]:
    from ra_lens import tasks

    return tasks.available()


def _ranking_names() -> list[str]:
    from ra_lens.experiments.head_ranking import RANKINGS

    return list(RANKINGS)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
