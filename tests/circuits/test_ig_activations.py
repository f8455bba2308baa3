"""`attribute(method="eap-ig-act")` (EAP-IG's "EAP-IG-activations", circuits._ig_activations)
against the algorithm written out directly on a HookedTransformer with TransformerLens's own hook
points, as EAP-IG's `get_scores_ig_activations` reads them (hook_embed, attn.hook_result,
hook_mlp_out replaced; gradients at hook_{q,k,v}_input, hook_mlp_in and the last
hook_resid_post; key/value inputs per query head on the ungrouped model), float64; on
TransformerLens 4's bridge against that reference computed in the TransformerLens 2 environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    LLAMA_LIKE,
    PAIR_CLEAN,
    PAIR_CORRUPTED,
    PAIR_METRIC,
    assert_ungrouped_scores,
    eap_ig_act_reference,
    has_bridge,
    hooked_toy,
    run_in_other_env,
    snapshot,
)

from ra_lens.capture import to_batch
from ra_lens.circuits.attribute import attribute

CLEAN, CORRUPTED, METRIC = PAIR_CLEAN, PAIR_CORRUPTED, PAIR_METRIC  # right-padded: unequal lengths
STEPS = 3


@pytest.mark.skipif(has_bridge(), reason="HookedTransformer: TransformerLens 2")
@pytest.mark.parametrize("direction", ["noise", "denoise"])
@pytest.mark.parametrize("settings", [{}, LLAMA_LIKE], ids=["gpt2-like", "llama-like-gqa"])
def test_eap_ig_act_is_eap_ig_activations_written_out(settings, direction):
    model = hooked_toy(**settings)
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    before = snapshot(model)
    scores = attribute(
        model, clean, corrupted, METRIC, method="eap-ig-act", direction=direction, steps=STEPS
    )
    assert snapshot(model) == before
    assert (scores.ungrouped_scores is not None) == ("n_key_value_heads" in settings)
    base, other = (clean, corrupted) if direction == "noise" else (corrupted, clean)
    theirs = eap_ig_act_reference(
        hooked_toy(**settings), base.tokens, other.tokens, base.lengths, STEPS
    )
    assert_ungrouped_scores(scores, theirs)


OTHER_ENV = """
import sys, torch
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/circuits"]
from ra_lens.capture import to_batch
from ra_lens.toy_models import hooked_matrix_model
from helpers import eap_ig_act_reference as reference
from test_ig_activations import CLEAN, CORRUPTED, STEPS
out = {}
for arch in sys.argv[2].split(","):
    model = hooked_matrix_model(arch, dtype=torch.float64)
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    theirs = reference(model, clean.tokens, corrupted.tokens, clean.lengths, STEPS)
    out[arch] = theirs, clean, corrupted
torch.save(out, sys.argv[1])
"""


#: gpt_neox and phi: parallel blocks (GPT-NeoX's MLP with its own norm, Phi's sharing the
#: attention's); their bridges prepend no BOS where TL 2 does, so both sides use TL 2's token ids.
BRIDGE_ARCHS = ("gpt2", "llama", "gpt_neox", "phi")


@pytest.fixture(scope="module")
def tl2_references(other_env_python, tmp_path_factory):
    """{arch: (reference scores, clean, corrupted)} of every BRIDGE_ARCHS, computed by TL 2 in
    one start of its environment."""
    tests = str(Path(__file__).resolve().parents[1])
    return run_in_other_env(
        other_env_python, OTHER_ENV, ",".join(BRIDGE_ARCHS), tests,
        name="tl2_eap_ig_act_references.pt", tmp_path_factory=tmp_path_factory,
    )  # fmt: skip


@pytest.mark.skipif(not has_bridge(), reason="TransformerBridge (TL 4) against TL 2's reference")
@pytest.mark.parametrize("arch", BRIDGE_ARCHS)
def test_bridge_eap_ig_act_equals_the_reference_on_tl2(arch, tl2_references):
    from ra_lens.toy_models import tiny_model

    model = tiny_model(arch, dtype=torch.float64, spread=True)
    theirs, clean, corrupted = tl2_references[arch]
    with torch.no_grad():  # the bridge adds its own norm hooks on a first forward pass
        model(clean.tokens)
    before = snapshot(model)
    scores = attribute(
        model, clean, corrupted, METRIC, method="eap-ig-act", direction="noise", steps=STEPS
    )
    assert snapshot(model) == before
    # HuggingFace's eager attention takes its softmax in float32 even in a float64 model
    assert_ungrouped_scores(scores, theirs, rel=1e-5)


@pytest.mark.skipif(has_bridge(), reason="HookedTransformer: TransformerLens 2")
@pytest.mark.parametrize("arch", ["gpt_neox", "gptj"])
def test_parallel_blocks_are_eap_ig_activations_written_out(arch):
    """Parallel attention/MLP blocks (GPT-NeoX: the MLP's own norm; GPT-J: the attention's):
    every edge equals the written-out reference, the embeddings' passes dropping layer 0's MLP
    input as EAP-IG's backward hooks do (it reads resid_pre, which requires no grad there)."""
    from ra_lens.toy_models import hooked_matrix_model

    model = hooked_matrix_model(arch, dtype=torch.float64)
    clean, corrupted = to_batch(model, CLEAN), to_batch(model, CORRUPTED)
    before = snapshot(model)
    scores = attribute(
        model, clean, corrupted, METRIC, method="eap-ig-act", direction="noise", steps=STEPS
    )
    assert snapshot(model) == before
    other = hooked_matrix_model(arch, dtype=torch.float64)  # the reference sets its flags
    theirs = eap_ig_act_reference(other, clean.tokens, corrupted.tokens, clean.lengths, STEPS)
    assert_ungrouped_scores(scores, theirs, rel=1e-8)
