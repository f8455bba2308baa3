"""MIB's submission folder (`export_mib`) and reading an EAP-IG graph JSON file into a `Circuit`
(`read_json`). The JSON layout itself (writing, parsing, key/value copies) is in `eapig_json.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from tqdm.auto import tqdm

from ra_lens._typing import Validated
from ra_lens.circuits.circuit import Circuit
from ra_lens.circuits.eapig_json import KvRule, read_fields
from ra_lens.circuits.eapig_json import ungrouped_readers as ungrouped_readers
from ra_lens.circuits.eapig_json import write_json as write_json
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.mib import MIB_SUBMISSION_FRACTIONS as MIB_SUBMISSION_FRACTIONS
from ra_lens.circuits.mib import ChosenCircuits, chosen_for, mib_sign
from ra_lens.circuits.scores import EdgeScores
from ra_lens.types import HookedModel


def read_json(
    path: str | Path, model_or_graph: Validated[HookedModel | Graph], *, kv: KvRule = "copies"
) -> Circuit:
    """The circuit an EAP-IG graph JSON file describes, on the graph of `model_or_graph` (a
    TransformerLens model or a `Graph`); see `eapig_json.py` for key/value edges."""
    g = model_or_graph if isinstance(model_or_graph, Graph) else Graph.from_model(model_or_graph)
    return Circuit(g, **read_fields(path, g, kv=kv))


def export_mib(
    scores: EdgeScores,
    folder: str | Path,
    *,
    circuits: bool = False,
    absolute: bool = False,
    selection: Literal["top", "greedy"] = "top",
    progress: bool = False,
    chosen: ChosenCircuits | None = None,
) -> list[Path]:
    """Write a MIB circuit-track folder for one task and model (hannamw/MIB-circuit-track).

    - `folder/importances.json`: every edge's score in EAP-IG's ungrouped layout (`eapig_json.py`'s
      docstring: a key/value edge on each query head of its group, each copy with its own score
      where `scores.ungrouped_scores` has them, else an equal share), every edge in_graph. The scores carry MIB's sign, positive where the edge helps
      the metric (`EdgeScores.helps`: denoise scores as they are, noise scores negated), since
      MIB ranks them signed for CPR. This is the file MIB's `run_evaluation.py` loads for a task
      and model: name the folder `{circuit_dir}/{method}_{ablation}_{level}/{task}_{model}`
      (e.g. `circuits/ra-lens_patching_edge/ioi_qwen2.5`) or pass the file with
      `--circuit-files`; it then selects and evaluates circuits itself, with and without
      `--absolute`.
    - with circuits=True, `folder/circuits/circuit_{k}.json` for k in 0.001 .. 0.5
      (`MIB_SUBMISSION_FRACTIONS`): the binary circuits of int(k * N) edges, N the ungrouped
      edge count (MIB's), by `EdgeScores.top`/`.greedy(units="ungrouped")` of the score
      (absolute=False: the signed ranking, as MIB's CPR) or of |score|, pruned. Each keeps at
      most int(k * N) edges in the file's ungrouped count (`Circuit.n_edges_ungrouped`).
      `chosen` (a `ChosenCircuits` of these scores and `selection`) hands over circuits already
      chosen, e.g. by `faithfulness_curve`, so none is chosen twice.

    By default only importances.json (MIB takes the scores OR the circuits, and the nine
    circuits are large: 90 MB on SmolLM2); `circuits=True` adds them, `progress=True` shows a
    bar while they are written. circuits=False deletes the nine circuit files an earlier export left in `folder/circuits`
    (ra-lens's names only; the folder too when it is then empty): they described other scores.

    MIB's leaderboard takes, per `{task}_{model}` folder (e.g. `ioi_gpt2`), EITHER one file of
    scores OR the nine circuits: upload `importances.json` alone, or the files of `circuits/`
    alone. The file names of the nine circuits are ra-lens's (MIB fixes their number and
    budgets, not their names).

    Returns:
        The paths written: importances.json first, then the circuits by increasing size.

    >>> import tempfile, torch
    >>> from ra_lens.circuits import EdgeScores
    >>> g = Graph(n_layers=1, n_heads=2, n_kv_heads=1, d_model=8)
    >>> s = EdgeScores(g, torch.rand(len(g.writers), len(g.readers)) * g.real, "eap", "denoise")
    >>> [p.name for p in export_mib(s, tempfile.mkdtemp(), circuits=True)][:3]
    ['importances.json', 'circuit_0.001.json', 'circuit_0.002.json']
    """
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores must be circuits.EdgeScores, got {type(scores).__name__}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    g = scores.graph
    # MIB ranks the file's scores with and without abs(): they carry its sign (positive = helps)
    sign = mib_sign(scores.direction)
    node_scores = None if scores.node_scores is None else sign * scores.node_scores.detach().cpu()
    copies = None if scores.ungrouped_scores is None else scores.ungrouped_helps
    everything = Circuit(
        g, g.real.clone(), scores=scores.helps, node_scores=node_scores, ungrouped_scores=copies
    )
    paths = [out / "importances.json"]
    write_json(everything, paths[0])
    if not circuits:
        _remove_stale_circuits(out)
    else:
        (out / "circuits").mkdir(exist_ok=True)
        picked = chosen_for(scores, chosen, selection).at(
            MIB_SUBMISSION_FRACTIONS, absolute=absolute, units="ungrouped"
        )
        bar = tqdm(picked, desc="MIB circuits", disable=not progress)
        for k, circuit in zip(MIB_SUBMISSION_FRACTIONS, bar):
            paths.append(out / "circuits" / f"circuit_{k:g}.json")
            write_json(circuit, paths[-1])
    return paths


def _remove_stale_circuits(out: Path) -> None:
    """Delete the circuit files an earlier `export_mib(..., circuits=True)` wrote into `out`
    (only ra-lens's own names), so they never sit beside importances.json of other scores; the
    `circuits` folder goes too when nothing else is left in it."""
    folder = out / "circuits"
    if not folder.is_dir():
        return
    for k in MIB_SUBMISSION_FRACTIONS:
        (folder / f"circuit_{k:g}.json").unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()
