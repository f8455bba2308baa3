"""A saved circuit study: written (`save_study`: the JSON of every per-pair metric, the markdown
tables), read back with its layout checked (`load_saved`), and one method's results pooled across
studies that ran side by side (`merge_method`; `circuit_study.merge_saved` merges whole studies,
in the order of its `METHODS`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ra_lens.experiments.circuit_study_report import markdown
from ra_lens.files import load_json, write_file

#: What `circuit_study.merge_saved` reads of a saved study's config and of each of its tasks.
SAVED_CONFIG_KEYS: tuple[str, ...] = ("ablations", "fractions", "n_boot")
SAVED_TASK_KEYS: tuple[str, ...] = ("n_pairs", "pairs", "sizes", "edge_counts", "reference", "methods")  # fmt: skip


def saved_selection(config: dict[str, Any]) -> str:
    """ "top" or "greedy"; files written before `--selection` existed say "top (by |score|), ..."."""
    return "greedy" if config.get("selection") == "greedy" else "top"


def merge_method(have: dict[str, Any], label: str, result: dict[str, Any], task: str) -> None:
    """Pool one method's results into `have`: a method measured under other ablations in another
    part adds those ablations (its circuits must be the same; the attribution seconds stay the
    first part's)."""
    if label not in have:
        have[label] = json.loads(json.dumps(result))
        return
    if have[label]["n_edges"] != result["n_edges"] or have[label].get(
        "signed_n_edges"
    ) != result.get("signed_n_edges"):
        raise ValueError(f"task {task!r}, method {label!r}: the parts chose different circuits")
    for key in ("circuit", "signed_circuit"):
        for ablation, values in result.get(key, {}).items():
            have[label].setdefault(key, {}).setdefault(ablation, values)


def save_study(study: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """Write the study's JSON and its markdown tables where asked (None: not that one)."""
    if json_path is not None:
        write_file(json_path, json.dumps(study, indent=1), make_folders=True)
    if markdown_path is not None:
        write_file(markdown_path, markdown(study) + "\n", make_folders=True)


def load_saved(path: Path) -> dict[str, Any]:
    """A study `--json` wrote, or a ValueError naming the file and what is wrong with it."""
    what = "a saved study (a file circuit_study --json wrote)"
    data = load_json(path, what)
    if not (
        isinstance(data, dict)
        and isinstance(data.get("config"), dict)
        and isinstance(data.get("tasks"), dict)
    ):
        raise ValueError(f"{path} is not {what}: it has no objects 'config' and 'tasks'")
    lacking = [key for key in SAVED_CONFIG_KEYS if key not in data["config"]]
    if lacking:
        raise ValueError(f"{path} is not {what}: its config lacks {', '.join(lacking)}")
    for name, task in data["tasks"].items():
        if not isinstance(task, dict):
            raise ValueError(f"{path} is not {what}: task {name!r} is not an object")
        lacking = [key for key in SAVED_TASK_KEYS if key not in task]
        if lacking:
            raise ValueError(f"{path} is not {what}: task {name!r} lacks {', '.join(lacking)}")
    return data
