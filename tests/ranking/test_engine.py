"""ranking/engine.py and the package surface: one target check, one set of counts, batch sizes,
the progress bar, the public names; bad input gives clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import TOY_CLEAN as CLEAN
from helpers import TOY_CORRUPTED as CORRUPTED
from helpers import TOY_TARGETS as TARGETS
from helpers import TOY_TASK as TOY
from helpers import arch_or_hooked

from ra_lens import ranking as rk
from ra_lens.experiments import head_ranking
from ra_lens.experiments.head_ranking import check_rankings
from ra_lens.toy_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model(arch_or_hooked("llama"), n_layers=2)


def test_bad_input_gives_clear_errors(llama):
    n_heads = llama.cfg.n_heads
    scores = torch.zeros(2, n_heads)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rk.ablation_curve(llama, ["x"], scores, (0.0, 1.5))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rk.kept_heads(scores, -0.1)
    with pytest.raises(ValueError, match="shape"):
        rk.ablation_curve(llama, ["x"], torch.zeros(3, n_heads), (0.5,))
    with pytest.raises(ValueError, match="NaN"):
        rk.ablation_curve(llama, ["x"], torch.full((2, n_heads), float("nan")), (0.5,))
    with pytest.raises(TypeError, match="Tensor"):
        rk.ablation_curve(llama, ["x"], [[0.0] * n_heads] * 2, (0.5,))
    with pytest.raises(ValueError, match="unknown ranking 'gradient': choose from ra, ra_loss_row"):
        check_rankings(["ra", "gradient"])
    with pytest.raises(ValueError, match="same token length"):
        rk.activation_patching(llama, CLEAN[:2], ["Q: b\nA:", "Q: c\nA:"], TARGETS[:2])
    with pytest.raises(ValueError, match="targets for"):
        rk.causal_mediation(llama, CLEAN, TARGETS[:2])
    with pytest.raises(ValueError, match="unknown ranking"):
        head_ranking(llama, TOY, shots=2, n_prompts=2, rankings=("ra", "nope"))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        head_ranking(llama, TOY, shots=2, n_prompts=2, fractions=(0.0, 2.0))


#: Every ranking that reads targets, called on two prompts with the given targets.
TARGETED = {
    "ra_ranking": lambda m, t: rk.ra_ranking(m, CLEAN[:2], t),
    "temperature_ranking": lambda m, t: rk.temperature_ranking(m, CLEAN[:2], t),
    "forward_ranking": lambda m, t: rk.forward_ranking(m, CLEAN[:2], t),
    "causal_mediation": lambda m, t: rk.causal_mediation(m, CLEAN[:2], t),
    "first_order_mediation": lambda m, t: rk.first_order_mediation(m, CLEAN[:2], t),
    "indirect_effect": lambda m, t: rk.indirect_effect(m, CLEAN[:2], CORRUPTED[:2], t),
    "activation_patching": lambda m, t: rk.activation_patching(m, CLEAN[:2], CORRUPTED[:2], t),
    "attribution_patching": lambda m, t: rk.attribution_patching(m, CLEAN[:2], CORRUPTED[:2], t),
    "exact_qk_attribution": lambda m, t: rk.exact_qk_attribution(m, CLEAN[:2], CORRUPTED[:2], t),
}


@pytest.mark.parametrize("name", list(TARGETED))
@pytest.mark.parametrize(
    "targets, error, message",
    [
        ([5, -1], ValueError, "negative id is not counted from the end"),
        ([5, 300], ValueError, r"must lie in 0\.\.299"),
        ([5, 100000], ValueError, r"must lie in 0\.\.299"),
        (torch.tensor([5.0, 6.7]), TypeError, "integer token ids, got a torch.float32"),
        ([5.0, 6.7], TypeError, "integer token ids, got 5.0"),
        ([5], ValueError, "1 targets for 2 prompts"),
    ],
)
def test_every_ranking_refuses_bad_targets_before_running(llama, name, targets, error, message):
    with pytest.raises(error, match=message):
        TARGETED[name](llama, targets)


def test_rankings_accept_integer_targets_of_any_kind(llama):
    expected = rk.causal_mediation(llama, CLEAN[:2], [5, 6])
    for targets in (torch.tensor([5, 6]), torch.tensor([5, 6], dtype=torch.int32), [5, 6]):
        torch.testing.assert_close(rk.causal_mediation(llama, CLEAN[:2], targets), expected)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_rankings_refuse_bad_batch_sizes(llama, batch_size):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        rk.ra_ranking(llama, CLEAN, TARGETS, batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        rk.last_token_means(llama, CLEAN, batch_size=batch_size)


def test_the_public_list_holds_public_names_and_the_old_names_still_import():
    public = set(rk.__all__)
    assert not public & {"check_scores", "bootstrap_indices", "check_fractions", "target_probs"}
    assert {"ra_ranking", "spearman", "pearson", "top_recall", "ablation_curve"} <= public
    old = [
        "ablation_hooks", "bootstrap_indices", "check_fractions", "check_scores",
        "last_token_means", "target_probs", "HeadMeans", "PerPrompt",
    ]  # fmt: skip
    assert all(hasattr(rk, name) for name in [*public, *old])


def test_the_progress_bar_moves_inside_a_part_and_ends_full(llama, monkeypatch):
    import ra_lens.ranking.engine as engine

    seen = []

    class Bar:  # records where the engine's bar stands after each update
        def __init__(self, total, **kwargs):
            self.n, self.total = 0.0, total

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, step):
            self.n += step
            seen.append(round(self.n, 6))

    monkeypatch.setattr(engine, "tqdm", Bar)
    rk.causal_mediation(llama, CLEAN, TARGETS, batch_size=2, progress=True)
    n_heads = 2 * llama.cfg.n_heads  # one step per head in each part, then the part's end
    assert len(seen) == 2 * (n_heads + 1) and seen == sorted(seen) and seen[-1] == 3
    assert seen[n_heads - 1] == 2 and seen[0] == pytest.approx(2 / n_heads, abs=1e-6)
