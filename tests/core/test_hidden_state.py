"""The process-wide state ra-lens keeps is named, documented and left clean: the model claims
(`capture.CLAIMS`), the probe's findings (`liveness.PROBED`, dropped by `forget_probe`) and the
quieted bar of TransformerLens's patching loop (`ranking.causal.TL_BAR_QUIETED`)."""

from __future__ import annotations

import threading

import transformer_lens.patching as tl_patching
from helpers import arch_or_hooked

from ra_lens import capture, liveness
from ra_lens.metrics import target_nll
from ra_lens.ranking import causal
from ra_lens.toy_models import tiny_model


def test_claims_are_released_after_a_call():
    model = tiny_model(arch_or_hooked("gpt2"))
    with capture.exclusive(model), capture.exclusive(model):
        assert capture.CLAIMS[model] == (threading.get_ident(), 2)
    assert model not in capture.CLAIMS
    from ra_lens import reversed_attention

    reversed_attention(model, "I like Italy", target_nll([5]))
    assert model not in capture.CLAIMS


def test_forget_probe_makes_the_next_call_probe_again(monkeypatch):
    model = tiny_model(arch_or_hooked("gpt2"))
    calls = []
    real = liveness._probe
    monkeypatch.setattr(liveness, "_probe", lambda m: calls.append(m) or real(m))
    first = liveness.live_pattern_layers(model)
    liveness.live_pattern_layers(model)
    assert len(calls) == 1 and liveness.PROBED[model] == first  # probed once, then remembered
    capture.forget_probe(model)
    assert model not in liveness.PROBED and model not in liveness.SEAMED
    assert liveness.live_pattern_layers(model) == first and len(calls) == 2


def test_quiet_bar_survives_interleaved_threads():
    """Two threads open and close their blocks out of order: the bar is quiet while either is
    open and TransformerLens's own tqdm is back once both closed (the earlier save/restore left
    the quiet one in place when the first thread closed last)."""
    found = tl_patching.tqdm
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first() -> None:
        with causal.quiet_tl_patching():
            a_in.set()
            b_in.wait()
        seen["after_a"] = tl_patching.tqdm is found
        a_out.set()

    def second() -> None:
        a_in.wait()
        with causal.quiet_tl_patching():
            b_in.set()
            a_out.wait()
            seen["b_still_quiet"] = tl_patching.tqdm is not found

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"after_a": False, "b_still_quiet": True}
    assert tl_patching.tqdm is found and causal.TL_BAR_QUIETED == {"open": 0, "original": None}
