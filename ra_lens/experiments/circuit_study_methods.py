"""The circuit study's methods: what each label runs (`METHODS`, `MASK_OPTIONS`, `ENSEMBLES`),
each method's scores on the training pairs computed once and timed (`Scored`: a method built on
others reuses theirs and counts their seconds once), and every method run again on bootstrap
resamples of the training pairs for the Jaccard of its circuits (`Refits`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import torch

from ra_lens import circuits, timing
from ra_lens.circuits.discover import CALIBRATION_SIZES
from ra_lens.circuits.masks import Objective, Rule
from ra_lens.circuits.mib import MIB_SUBMISSION_FRACTIONS
from ra_lens.circuits.negatives import Fold, cross_calibrate
from ra_lens.tasks import ioi
from ra_lens.tasks.ioi import PromptPair
from ra_lens.types import HookedModel

_MethodName = Literal[
    "eap", "eap-ig", "exact", "exact-ig", "eap-ig-act", "random", "ensemble", "mask", "calibrated"
]

#: method label -> (circuits.attribute's method, IG steps, direction); "random" draws uniform
#: scores. "-noise": the gradient on the clean run (EAP-IG's own choice), scores in MIB's sign.
#: label -> (attribute's method, or "random" / "ensemble"; IG steps; direction)
METHODS: dict[str, tuple[_MethodName, int, Literal["denoise", "noise"]]] = {
    "eap": ("eap", 1, "denoise"),
    "eap-noise": ("eap", 1, "noise"),
    "eap-ig-5": ("eap-ig", 5, "denoise"),
    "eap-ig-5-noise": ("eap-ig", 5, "noise"),
    "eap-ig-20": ("eap-ig", 20, "denoise"),
    "exact": ("exact", 1, "denoise"),
    "exact-ig-5": ("exact-ig", 5, "denoise"),
    "exact-ig-5-noise": ("exact-ig", 5, "noise"),
    "random": ("random", 1, "denoise"),
    "ens-ig": ("ensemble", 5, "denoise"),
    "ens-eap-ig-exact": ("ensemble", 5, "denoise"),
    "eap-ig-act-5-noise": ("eap-ig-act", 5, "noise"),
    "hybrid-ens": ("ensemble", 5, "denoise"),
    # circuits.learn_mask warm-started from eap-ig (5 steps), default budget (MASK_OPTIONS)
    "mask": ("mask", 5, "denoise"),
    "mask-faithful": ("mask", 5, "denoise"),
    "mask-scaled": ("mask", 5, "denoise"),
    # mask-scaled with one option changed (MASK_OPTIONS): the options explored on country-capital
    "mask-scaled-20": ("mask", 5, "denoise"),
    "mask-scaled-lr3": ("mask", 5, "denoise"),
    "mask-scaled-sp0": ("mask", 5, "denoise"),
    # mask-scaled with its negative scores scaled by the factor whose |score| circuits have the
    # lowest CMD (circuits.calibrate_negatives) on the training pairs, or (-xcal) on the half of
    # them that a mask trained on the other half did not see (CALIBRATED)
    "mask-scaled-cal": ("calibrated", 5, "denoise"),
    "mask-scaled-xcal": ("calibrated", 5, "denoise"),
    # circuits.discover: no mask on all the pairs, the mean of two masks, each fitted on one half
    # of the training pairs, its negatives scaled by the factor with the lowest mean CMD of each
    # half's mask on the other half (composed here from Scored's labels, as mask-scaled-xcal is,
    # so that the study records the CMD per factor and fold; a test checks it equals discover)
    "mask-scaled-cv": ("calibrated", 5, "denoise"),
    # the mean of eap-ig's scores and the mask's log-odds (each over its rms), as Hybrid-Ens's
    # best entry averages EAP-IG with Edge Pruning's masks
    "ens-mask": ("ensemble", 5, "denoise"),
    "ens-mask-faithful": ("ensemble", 5, "denoise"),
    "ens-mask-scaled": ("ensemble", 5, "denoise"),
}


class MaskOptions(TypedDict, total=False):
    """The `circuits.learn_mask` options a study's mask labels set (the rest: its defaults)."""

    objective: Objective
    rule: Rule
    steps: int
    lr: float
    sparsity: float


#: mask label -> `circuits.learn_mask`'s options other than its defaults
MASK_OPTIONS: dict[str, MaskOptions] = {
    "mask": {},
    "mask-faithful": {"objective": "faithful"},
    "mask-scaled": {"rule": "scaled"},
    "mask-scaled-20": {"rule": "scaled", "steps": 20},
    "mask-scaled-lr3": {"rule": "scaled", "lr": 0.3},
    "mask-scaled-sp0": {"rule": "scaled", "sparsity": 0.0},
}
#: Where a calibrated method chooses its factor: "train", on the training pairs its scores were
#: fitted to; "apart", the method fitted again on the first half of the training pairs and the
#: factor chosen on the second half, which that fit did not see (then applied to the scores
#: fitted on all of them); "crossfit", `circuits.discover`: the scores are the mean of the two
#: halves' fits (no fit on all the pairs: about the cost of one) and the factor is chosen on both
#: (each half's fit on the other half). A learned mask behaves differently on the pairs it was
#: trained on.
CalibrationPairs = Literal["train", "apart", "crossfit"]
#: calibrated label -> (the method whose negative scores it scales, where the factor is chosen)
CALIBRATED: dict[str, tuple[str, CalibrationPairs]] = {
    "mask-scaled-cal": ("mask-scaled", "train"),
    "mask-scaled-xcal": ("mask-scaled", "apart"),
    "mask-scaled-cv": ("mask-scaled", "crossfit"),
}
#: The scores every learned mask starts from (computed once, its seconds counted in the mask's).
MASK_WARM_START = "eap-ig-5"
#: The label of `circuits.attribute`'s default (eap-ig, 5 steps, denoise): the goals are its.
DEFAULT_METHOD = "eap-ig-5"
#: ensemble label -> the methods it averages (`circuits.ensemble`: normalised, in MIB's sign);
#: their scores are computed once per task, and the ensemble's seconds are the sum of theirs.
ENSEMBLES: dict[str, tuple[str, ...]] = {
    "ens-ig": ("eap-ig-5", "eap-ig-5-noise"),
    "ens-eap-ig-exact": ("eap", "eap-ig-5", "exact"),
    # Hybrid-Ens (circuits.ensemble.hybrid): EAP-IG's EAP, EAP-IG-inputs, EAP-IG-activations
    "hybrid-ens": ("eap-noise", "eap-ig-5", "eap-ig-act-5-noise"),
    "ens-mask": ("eap-ig-5", "mask"),
    "ens-mask-faithful": ("eap-ig-5", "mask-faithful"),
    "ens-mask-scaled": ("eap-ig-5", "mask-scaled"),
}
#: ensemble label -> its `circuits.ensemble` normalise where not "rms" (Hybrid-Ens: raw mean).
ENSEMBLE_NORMALISE: dict[str, Literal["rms", "max", "none", "rank"]] = {"hybrid-ens": "none"}


def random_scores(graph: circuits.Graph, seed: int = 0) -> circuits.EdgeScores:
    """Uniform random scores on the graph's edges (the floor every method must beat)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(graph.real.shape, generator=generator, dtype=torch.float64)
    return circuits.EdgeScores(graph, scores * graph.real, method="random", direction="denoise")


class Scored:
    """Each method's scores on the training pairs and their seconds (wall, CPU), once. A method
    built on others (an ensemble's members, a mask's eap-ig warm start) reuses their scores, and
    its seconds are its own work plus that of every method under it, each counted once."""

    def __init__(
        self,
        model: HookedModel,
        train: Sequence[PromptPair],
        graph: circuits.Graph,
        batch_size: int,
        own_copies: bool = False,
    ) -> None:
        self.model, self.graph, self.batch_size = model, graph, batch_size
        self.own_copies = own_copies  # how the study chooses circuits: the calibration's too
        self.train = list(train)
        self.clean, self.corrupted, self.metric = ioi.paired_batch(model, self.train)
        self.scored: dict[str, circuits.EdgeScores] = {}
        #: calibrated label -> what `calibrate_negatives` chose and saw (`NegativeScale.to_dict`)
        self.calibrations: dict[str, dict[str, Any]] = {}
        # label -> (its own seconds, the labels it was built from)
        self.own: dict[str, tuple[dict[str, float], tuple[str, ...]]] = {}

    def __call__(self, label: str) -> tuple[circuits.EdgeScores, dict[str, float]]:
        if label not in self.scored:
            self.scored[label] = self._score(label)
        return self.scored[label], self._spent(label)

    def _spent(self, label: str) -> dict[str, float]:
        """Seconds of `label` and of everything under it, each label counted once."""
        seen: set[str] = set()
        todo = [label]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(self.own[current][1])
        return {
            key: sum(self.own[s][0][key] for s in seen) for key in ("attribute", "attribute_cpu")
        }

    def _score(self, label: str) -> circuits.EdgeScores:
        method, steps, direction = METHODS[label]
        under = ENSEMBLES.get(label, ()) if method == "ensemble" else ()
        if method == "mask":
            under = (MASK_WARM_START,)
        if method == "calibrated" and CALIBRATED[label][1] != "crossfit":
            under = (CALIBRATED[label][0],)
        parts = [self(part)[0] for part in under]
        spent: dict[str, float] = {}
        with (
            timing.timed(spent, "attribute"),
            timing.timed(spent, "attribute_cpu", clock=timing.cpu_time),
        ):
            if method == "ensemble":
                normalise = ENSEMBLE_NORMALISE.get(label, "rms")
                result = circuits.ensemble(parts, normalise=normalise)
            elif method == "calibrated":
                result = self._calibrated(label, parts[0] if parts else None)
            elif method == "random":
                result = random_scores(self.graph)
            elif method == "mask":
                result = circuits.learn_mask(
                    self.model, self.clean, self.corrupted, self.metric, warm_start=parts[0],
                    batch_size=self.batch_size, **MASK_OPTIONS[label],
                ).scores  # fmt: skip
            else:
                result = circuits.attribute(
                    self.model, self.clean, self.corrupted, self.metric, method=method,
                    steps=steps, direction=direction, batch_size=self.batch_size,
                )  # fmt: skip
        self.own[label] = (spent, tuple(under))
        return result

    def _calibrated(self, label: str, scores: circuits.EdgeScores | None) -> circuits.EdgeScores:
        """`scores` (None under "crossfit": the mean of the halves' fits) with their negatives
        times the factor `calibrate_negatives` chooses where CALIBRATED says (`cross_calibrate`
        on both halves under "crossfit"); what it chose and saw goes to `self.calibrations`."""
        under, pairs = CALIBRATED[label]
        held = self.train
        if pairs == "train":
            assert scores is not None
            fitted = scores
        else:
            if len(self.train) < 4:
                raise ValueError(f"{label}: {len(self.train)} training pairs cannot be split into a fit half and a calibration half of two or more each: give at least 4")  # fmt: skip
            half = (len(self.train) + 1) // 2
            held = self.train[half:]
            fitted = self._on(slice(0, half))(under)[0]
            if pairs == "crossfit":  # discover's steps (its test pins the two equal)
                second = self._on(slice(half, len(self.train)))(under)[0]
                folds = [
                    Fold(fitted, *ioi.paired_batch(self.model, held)),
                    Fold(second, *ioi.paired_batch(self.model, self.train[:half])),
                ]
                calibration = cross_calibrate(
                    self.model, folds, circuits.ensemble([fitted, second], normalise="none"),
                    sizes=CALIBRATION_SIZES, own_copies=self.own_copies, stop_when_worse=True,
                    batch_size=self.batch_size,
                )  # fmt: skip
                self.calibrations[label] = {**calibration.to_dict(), "pairs": pairs, "n_pairs": len(self.train)}  # fmt: skip
                return calibration.scores
        assert scores is not None
        calibration = circuits.calibrate_negatives(
            self.model, fitted, *ioi.paired_batch(self.model, held),
            own_copies=self.own_copies, batch_size=self.batch_size,
        )  # fmt: skip
        self.calibrations[label] = {**calibration.to_dict(), "pairs": pairs, "n_pairs": len(held)}  # fmt: skip
        return circuits.scale_negatives(scores, calibration.scale)

    def _on(self, rows: slice) -> Scored:
        """The methods on training pairs `rows` (same model, graph and batch size), computed
        afresh: the seconds of each calibrated label count all of its own work."""
        return Scored(self.model, self.train[rows], self.graph, self.batch_size, self.own_copies)


class Refits:
    """Every method run again on bootstrap resamples of the training pairs, for the bootstrap
    Jaccard of its circuits (`circuits.refit_jaccard`: a learned mask is not a mean of per-pair
    scores, so each resample trains its own). One `Scored` per resample, shared by the
    methods, so a mask starts from that resample's own eap-ig; all the pairs reuse the study's."""

    def __init__(self, score: Scored, train: Sequence[PromptPair], n_boot: int) -> None:
        self.score, self.train, self.n_boot = score, list(train), n_boot
        self.resamples: dict[tuple[int, ...], Scored] = {tuple(range(len(train))): score}

    def __call__(self, label: str) -> dict[str, Any]:
        """The method's bootstrap Jaccard at MIB's submission sizes, signed and |score|
        rankings (`CircuitStability.to_dict`), and the seconds the refits took."""
        start = timing.now()

        def fit(rows: list[int]) -> circuits.EdgeScores:
            key = tuple(rows)
            if key not in self.resamples:
                s = self.score
                self.resamples[key] = Scored(s.model, [self.train[i] for i in rows], s.graph, s.batch_size, s.own_copies)  # fmt: skip
            return self.resamples[key](label)[0]

        out: dict[str, Any] = {
            ranking: circuits.refit_jaccard(
                fit,
                len(self.train),
                MIB_SUBMISSION_FRACTIONS,
                n_boot=self.n_boot,
                absolute=ranking == "abs",
            ).to_dict()  # fmt: skip
            for ranking in ("signed", "abs")
        }
        out["seconds"] = timing.now() - start
        return out
