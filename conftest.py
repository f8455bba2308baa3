"""What the docstring examples in ra_lens (collected by --doctest-modules) find in their namespace.

`model`: a fresh tiny random model from `ra_lens.toy_models.tiny_model`, 2 layers x 4 heads,
d_model 32, a 300-token vocabulary, built offline: the GPT-2 TransformerBridge under
TransformerLens 4, a HookedTransformer under TransformerLens 2.18 (which has no bridge), so one
example runs in both environments. Examples that mention `model` get a fresh copy of one
pristine model built once per process (a deep copy takes ~0.02 s, a build 0.1-0.2 s on TL 4), so
no example sees another's hooks, gradients or modes.

Examples of what needs TransformerLens >= 3 are skipped under TL 2, with the reason below.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
from typing import Any

import pytest

from ra_lens.models import bridge_available

HAS_BRIDGE = bridge_available()


def _has_nnsight() -> bool:
    # nnsight.modeling, not nnsight: tests/nnsight imports as a namespace package 'nnsight'
    try:
        return importlib.util.find_spec("nnsight.modeling") is not None
    except ModuleNotFoundError:
        return False


#: remote.py subclasses nnsight's RemoteBackend when imported, so its module (and doctests) is
#: collected only where nnsight is installed (the TL 4 environment; TL 2.18's transformers is
#: too old for nnsight 0.8).
collect_ignore = [] if _has_nnsight() else ["ra_lens/nnsight/remote.py"]

#: Docstrings whose examples need a TransformerBridge (TransformerLens >= 3), and why.
TL4_ONLY = {
    "ra_lens.dynamics.EditDynamics": "edit_dynamics refuses HookedTransformer",
    "ra_lens.dynamics.edit_dynamics": "edit_dynamics refuses HookedTransformer",
    "ra_lens.attribution.result.AttentionAttribution.to_transformer_lens": "AttributionResult is "
    "TransformerLens 4's",
}


@pytest.fixture(autouse=True)
def _doctest_model(request: pytest.FixtureRequest) -> None:
    """Puts `model` into the namespace of the docstring examples that use it."""
    test = getattr(request.node, "dtest", None)  # a doctest.DocTest: only doctest items have it
    if test is None:
        return
    if not HAS_BRIDGE and test.name in TL4_ONLY:
        pytest.skip(f"TransformerLens 2: {TL4_ONLY[test.name]}")
    if any(re.search(r"\bmodel\b", example.source) for example in test.examples):
        namespace = request.getfixturevalue("doctest_namespace")
        namespace["model"] = copy.deepcopy(_pristine_model())


@functools.cache
def _pristine_model() -> Any:
    """The doctests' tiny model, never run: only its copies are handed out."""
    from ra_lens.toy_models import tiny_model

    return tiny_model("gpt2" if HAS_BRIDGE else "hooked")
