"""The one result contract (`ra_lens.types.Result`, `OneFigure`, `ManyFigures`) held by every
result class, each built by its own function on a tiny model: `to_dict()` is JSON, `table()` a
string, `plot()` a Figure (or `plots(out_dir)` the files it wrote), and `save` / `load` give back
every field equal (tensors bit for bit, dtype included). A file that is not the class's own is
refused with a ValueError naming the file."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TOY_PAIRS, arch_or_hooked, has_bridge
from matplotlib.figure import Figure

from ra_lens import circuits, reversed_attention
from ra_lens.attribution import attention_attribution
from ra_lens.metrics import logit_diff, target_nll
from ra_lens.toy_models import tiny_model
from ra_lens.types import ManyFigures, OneFigure, Result

CLEAN = ["The capital of France is", "When Mary and John went to the store"]
CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
METRIC = logit_diff([294, 52], [52, 294])


@pytest.fixture(scope="module")
def model():
    return tiny_model(arch_or_hooked("llama"), seed=1)


@pytest.fixture(scope="module")
def scores(model):
    return circuits.attribute(model, CLEAN, CORRUPTED, METRIC, method="eap")


def _curve(model, scores):
    return circuits.faithfulness_curve(model, scores, CLEAN, CORRUPTED, METRIC, sizes=[0.5, 1.0])


def _refinement(model, scores):
    evaluator = circuits.FaithfulnessEvaluator(model, CLEAN, CORRUPTED, METRIC)
    return circuits.refine(scores, evaluator, fractions=[0.5], candidates=2, budget=4)


def _ablation_curve(model, scores):
    from ra_lens.ranking import ablation_curve
    from ra_lens.tasks import Task, task_prompts

    _, held_out = task_prompts(model, Task("toy", TOY_PAIRS), 1, seed=0)
    heads = torch.arange(model.cfg.n_layers * model.cfg.n_heads, dtype=torch.float32)
    return ablation_curve(
        model, held_out[:3], heads.reshape(model.cfg.n_layers, model.cfg.n_heads), [0, 0.5, 1]
    )


def _head_ranking(model, scores):
    return _ranked(model)


@functools.cache
def _ranked(model):
    """One head ranking of `model`, shared by HeadRankingResult and StudyResult."""
    from ra_lens.experiments import head_ranking
    from ra_lens.tasks import Task

    return head_ranking(model, Task("toy", TOY_PAIRS), shots=1, n_prompts=4,
                        rankings=["random", "ra"], fractions=[0, 1], n_boot=20, progress=False)  # fmt: skip


def _study(model, scores):
    from ra_lens.experiments.ranking_study import StudyResult

    cell = _head_ranking(model, scores)
    return StudyResult([cell], {"tasks": ["toy"], "shots": [1]}, 2.5, ["toy 5-shot: too few"])


def _patching(model, scores):
    from ra_lens.experiments import attention_patching
    from ra_lens.tasks import Task

    return attention_patching(model, Task("toy", TOY_PAIRS), shots=1, n_prompts=3,
                              scales=[0.0, -4.0], progress=False)  # fmt: skip


def _learned_mask(model, scores):
    return circuits.learn_mask(model, CLEAN, CORRUPTED, METRIC, warm_start=scores, steps=2)


def _negative_scale(model, scores):
    return circuits.calibrate_negatives(model, scores, CLEAN, CORRUPTED, METRIC, sizes=[0.5, 1.0])


def _edit_dynamics(model, scores):
    from ra_lens.dynamics import edit_dynamics

    return edit_dynamics(tiny_model("gpt2"), CLEAN[0], target_nll([294]), lr=0.5)


def _task_measurement(model, scores):
    from ra_lens.experiments import attention_attribution as experiment
    from ra_lens.tasks.ioi import PromptPair

    pairs = [
        PromptPair("When Mary and John went to the store, John gave a drink to",
                   "When John and Mary went to the store, John gave a drink to", "a", "b"),
        PromptPair("When John and Mary went to the store, Mary gave a drink to",
                   "When Mary and John went to the store, Mary gave a drink to", "b", "a"),
    ]  # fmt: skip
    return experiment.measure(model, pairs, "toy", n_position_heads=2, progress=False)


#: Every result class: (name, builder, file suffix). The builder takes the model and its EAP scores.
BUILDERS: list[tuple[str, Callable[[Any, Any], Any], str]] = [
    ("ReversedAttention", lambda m, s: reversed_attention(m, CLEAN, METRIC), "safetensors"),
    (
        "AttentionAttribution",
        lambda m, s: attention_attribution(m, CLEAN, CORRUPTED, METRIC),
        "safetensors",
    ),  # fmt: skip
    ("EdgeScores", lambda m, s: s, "safetensors"),
    ("Circuit", lambda m, s: s.top(8), "safetensors"),
    ("FaithfulnessCurve", _curve, "json"),
    (
        "NodeScores",
        lambda m, s: circuits.attribute_nodes(m, CLEAN, CORRUPTED, METRIC, method="eap"),
        "json",
    ),  # fmt: skip
    (
        "Faithfulness",
        lambda m, s: circuits.faithfulness(m, s.top(8), CLEAN, CORRUPTED, METRIC),
        "json",
    ),  # fmt: skip
    ("Refinement", _refinement, "json"),
    (
        "CircuitStability",
        lambda m, s: circuits.bootstrap_jaccard(
            circuits.pair_scores(m, CLEAN, CORRUPTED, METRIC, method="eap"), [0.1, 0.5], n_boot=4
        ),
        "json",
    ),  # fmt: skip
    ("AblationCurve", _ablation_curve, "json"),
    ("LearnedMask", _learned_mask, "json"),
    ("NegativeScale", _negative_scale, "json"),
    ("PatchingResult", _patching, "json"),
    ("HeadRankingResult", _head_ranking, "json"),
    ("StudyResult", _study, "json"),
    # TL >= 3 only: edit_dynamics needs a TransformerBridge (its SUPPORTED), and the experiment's
    # measure runs on bridges (tests/attribution/test_attribution.py's toy measure is tl4 too)
    pytest.param("EditDynamics", _edit_dynamics, "json", marks=pytest.mark.tl4),
    pytest.param("TaskMeasurement", _task_measurement, "json", marks=pytest.mark.tl4),
]  # type: ignore[list-item]


def same(a: Any, b: Any, where: str = "") -> None:
    """a and b equal field by field: tensors in dtype, shape and every value (NaN where NaN)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), where
            a, b = a.nan_to_num(), b.nan_to_num()
        assert torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    "name, build, suffix",
    BUILDERS,
    ids=lambda v: v if isinstance(v, str) and v[0].isupper() else "",
)
def test_every_result_holds_the_contract(model, scores, name, build, suffix, tmp_path):
    if name == "EditDynamics" and not has_bridge():
        pytest.skip("needs a TransformerBridge")
    result = build(model, scores)
    assert type(result).__name__ == name
    assert isinstance(result, Result)
    report = result.to_dict()
    assert isinstance(report, dict) and json.loads(json.dumps(report)) is not None
    assert isinstance(result.table(), str) and result.table().strip()
    if isinstance(result, OneFigure):
        assert isinstance(result.plot(), Figure)
        path = tmp_path / "figure.png"
        assert isinstance(result.plot(save=path), Figure)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert isinstance(result, ManyFigures), f"{name} has neither plot nor plots"
        paths = result.plots(tmp_path / "figures")
        assert paths and all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)

    path = tmp_path / f"result.{suffix}"
    result.save(path)
    back = type(result).load(path)
    same(back, result, name)
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(report, sort_keys=True)

    other = tmp_path / f"other.{suffix}"
    other.write_text("[1, 2]")  # not a result file: refused naming the file
    with pytest.raises(ValueError, match=r"other\." + suffix):
        type(result).load(other)
