"""Test helpers shared by several test files: prompts, the tiny architectures the installed
TransformerLens offers (from `ra_lens.toy_models.ARCHITECTURES`), a model-state snapshot, and a toy
task whose prompts tokenize evenly on the tiny models.

Imported as `from helpers import ...` (pytest puts tests/ on sys.path: it has no __init__.py).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from ra_lens import contract
from ra_lens.capture import Z
from ra_lens.metrics import logit_diff
from ra_lens.models import bridge_available
from ra_lens.tasks import Task
from ra_lens.toy_models import ARCHITECTURES, tiny_model

#: The repository's root (tests/helpers.py sits one folder below it), for tests that run its
#: benchmarks, notebooks or a second environment.
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Two prompts of 9 token ids (below every tiny vocabulary; no tokenizer needed) and a corrupted
#: copy that differs at two positions of each: the float64 pairs of attribution and circuit tests.
CLEAN_TOKENS = torch.tensor([[0, 5, 9, 14, 20, 33, 7, 41, 12], [0, 8, 3, 14, 25, 33, 7, 40, 12]])
CORRUPTED_TOKENS = torch.tensor(
    [[0, 5, 17, 14, 20, 61, 7, 41, 12], [0, 8, 3, 19, 25, 33, 70, 40, 12]]
)

#: The paper's Figure-1 prompt.
FLORENCE = "I like Italy and France. I visited the city of"
#: Three prompts of different token lengths (a right-padded batch), the last with a newline.
PROMPTS = ["I like Italy and France. I visited", "The quick brown fox jumps", "Q: hot\nA:"]
#: Architectures whose hook_attn_scores and hook_pattern are in the autograd graph (OPT delegates
#: attention to HuggingFace; boot_native's hook_attn_scores is a copy of the pattern).
LIVE = ("gpt2", "llama", "hooked")


def has_bridge() -> bool:
    """TransformerLens >= 3 (TransformerBridge) is installed."""
    return bridge_available()


def all_archs() -> list[str]:
    """Tiny architectures available under the installed TransformerLens: the bridge ones on
    TL 4, HookedTransformer ("hooked") on TL 2."""
    return [a for a in ARCHITECTURES if (a != "hooked") == has_bridge()]


def live_archs() -> list[str]:
    """all_archs() whose attention hooks are in the autograd graph."""
    return [a for a in all_archs() if a in LIVE]


def arch_or_hooked(bridge_arch: str) -> str:
    """`bridge_arch` under TL 4, "hooked" (HookedTransformer) under TL 2."""
    return bridge_arch if has_bridge() else "hooked"


def bridge_model(arch: str, **kwargs: Any) -> Any:
    """tiny_model(arch, **kwargs) for a TransformerBridge architecture; skips under TL 2."""
    pytest.importorskip("transformer_lens.model_bridge")
    return tiny_model(arch, **kwargs)


def hook_count(model: Any) -> tuple[int, int]:
    """(TransformerLens hooks on every hook point, PyTorch hooks on every module)."""
    points = sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())
    modules = sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
        for m in model.modules()
    )
    return points, modules


def count_fact_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count calls of contract.block_layout / attention_facts under every name ra_lens binds
    them to (capture re-exports them)."""
    calls: Counter[str] = Counter()
    for name in ("block_layout", "attention_facts"):
        original = getattr(contract, name)

        def wrapper(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(*args)

        for module in list(sys.modules.values()):
            if module is not None and module.__name__.startswith("ra_lens"):
                if getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, wrapper)
    return calls


def snapshot(model: Any) -> tuple[Any, ...]:
    """Train/eval mode, requires_grad and .grad of every parameter, and the hook counts: what
    ra_lens must leave exactly as it was."""
    params = list(model.parameters())
    return (
        model.training,
        [p.requires_grad for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        hook_count(model),
    )


def run_in_other_env(
    python: str, script: str, *args: str, name: str, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """Run `script` (`python -c`) in the other TransformerLens environment with the repository on
    its path and one thread, and return what it saved with torch.save to its first argument
    (`args` follow). Once per test session: starting that environment costs ~5 s of imports, so
    a test module runs it once for all its cases, and pytest-xdist workers share the file `name`
    (under a lock) in the session's temporary folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    out = root / name
    with FileLock(f"{out}.lock"):
        if not out.exists():
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
            done = subprocess.run(
                [python, "-c", script, str(out), *args], env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@contextlib.contextmanager
def disk_full_beyond(n_bytes: int) -> Iterator[None]:
    """A full disk for every file of this process: a write that would make a file longer than
    `n_bytes` fails with OSError EFBIG ("File too large"), after writing what fits, as ENOSPC
    does (RLIMIT_FSIZE, with SIGXFSZ ignored so that the write fails instead of killing the
    process). Use it with capsys: pytest's own capture files must not grow meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# --- circuit pairs ----------------------------------------------------------------------------

#: Two clean/corrupted pairs of unequal token length (the batch is right-padded) and their
#: logit-difference metric, for the circuit tests.
PAIR_CLEAN = ["The capital of France is", "When Mary and John went to the store"]
PAIR_CORRUPTED = ["The capital of Italy is", "When John and Mary went to the store"]
PAIR_METRIC = logit_diff([294, 50], [52, 60])


def eap_ig_act_reference(
    model: Any,
    base_tokens: Any,
    other_tokens: Any,
    lengths: Any,
    steps: int,
    metric: Any = PAIR_METRIC,
) -> dict[tuple[str, str], float]:
    """EAP-IG-activations written out as EAP-IG's `get_scores_ig_activations` reads TL's hooks:
    {(writer, reader): score}, the mean over prompts of sum over nodes n and k = 1..steps of (other - base output of the writer) . dM/d(reader's
    input) in the base run with node n's output held at other + k/steps (base - other), divided
    by n_nodes * steps. `model`: a HookedTransformer whose flags this sets (use_attn_result,
    use_split_qkv_input, use_hook_mlp_in; ungroup_grouped_query_attention where grouped)."""
    cfg = model.cfg
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    if cfg.n_key_value_heads is not None:
        model.set_ungroup_grouped_query_attention(True)
    n_layers, n_heads = cfg.n_layers, cfg.n_heads
    outs = ["hook_embed"]
    for la in range(n_layers):
        outs += [f"blocks.{la}.attn.hook_result", f"blocks.{la}.hook_mlp_out"]

    def record(tokens: Any) -> dict[str, Any]:
        acts: dict[str, Any] = {}

        def keep(x: Any, hook: Any) -> None:
            acts[hook.name] = x.detach().clone()

        with torch.no_grad(), model.hooks(fwd_hooks=[(n, keep) for n in outs]):
            model(tokens)
        return acts

    base, other = record(base_tokens), record(other_tokens)
    writers: dict[str, Any] = {"input": other["hook_embed"] - base["hook_embed"]}
    for la in range(n_layers):
        result = other[f"blocks.{la}.attn.hook_result"] - base[f"blocks.{la}.attn.hook_result"]
        for h in range(n_heads):
            writers[f"a{la}.h{h}"] = result[:, :, h]
        writers[f"m{la}"] = other[f"blocks.{la}.hook_mlp_out"] - base[f"blocks.{la}.hook_mlp_out"]
    inputs = [f"blocks.{la}.hook_{x}_input" for la in range(n_layers) for x in "qkv"]
    inputs += [f"blocks.{la}.hook_mlp_in" for la in range(n_layers)]
    inputs += [f"blocks.{n_layers - 1}.hook_resid_post"]
    total = {name: 0.0 for name in inputs}
    for node in outs:
        for k in range(1, steps + 1):
            point = other[node] + (k / steps) * (base[node] - other[node])
            seen: dict[str, Any] = {}

            def keep_live(x: Any, hook: Any, seen: dict[str, Any] = seen) -> None:
                seen[hook.name] = x

            # a constant, as in EAP-IG (no gradient reaches the node)
            hooks = [(node, lambda x, hook, p=point: p.clone())]
            hooks += [(name, keep_live) for name in inputs]
            with model.hooks(fwd_hooks=hooks):
                value = metric(model(base_tokens), lengths=lengths).sum()
                # EAP-IG's backward hooks fire only where the input requires grad (not layer
                # 0's with the embeddings held on a model without a learned W_pos)
                live = [n for n in inputs if seen[n].requires_grad]
                found = torch.autograd.grad(value, [seen[n] for n in live], allow_unused=True)
            for name, grad in zip(live, found):
                if grad is not None:
                    total[name] = total[name] + grad
    count, n_prompts = len(outs) * steps, base_tokens.shape[0]
    scores = {}
    for reader_hook, grad in total.items():
        if not isinstance(grad, torch.Tensor):
            continue
        layer = int(reader_hook.split(".")[1])
        if reader_hook.endswith("resid_post"):
            readers = {"logits": grad}
        elif reader_hook.endswith("mlp_in"):
            readers = {f"m{layer}": grad}
        else:
            kind = reader_hook.split("_")[-2][-1]
            readers = {f"a{layer}.h{h}<{kind}>": grad[:, :, h] for h in range(n_heads)}
        for reader, g in readers.items():
            for writer, diff in writers.items():
                value = float((diff * g).sum()) / count / n_prompts
                scores[(writer, reader)] = value
    return scores


def assert_ungrouped_scores(
    scores: Any, theirs: dict[tuple[str, str], float], rel: float = 1e-9
) -> None:
    """Every real edge of `scores` (EdgeScores, over EAP-IG's ungrouped readers) equal to
    `theirs` {(writer, reader): score} to `rel` (float64 precision by default)."""
    graph = scores.graph
    ours = scores.ungrouped_scores
    if ours is None:
        ours = scores.scores[:, graph.ungrouped_target]
    real = graph.real[:, graph.ungrouped_target]
    n_checked = 0
    scale = max(abs(v) for v in theirs.values())
    for u, (reader, _) in enumerate(graph.ungrouped_readers):
        for w, writer in enumerate(graph.writers):
            if not bool(real[w, u]):
                continue
            assert float(ours[w, u]) == pytest.approx(
                theirs[(writer, reader)], rel=rel, abs=rel * 1e-3 * scale
            ), (writer, reader)
            n_checked += 1
    assert n_checked == graph.n_edges_ungrouped and scale > 1e-6


#: `hooked_toy` settings of a Llama-like grouped-query model: rotary, 2 key/value heads, RMSNorm,
#: a gated SiLU MLP.
LLAMA_LIKE = dict(
    positional_embedding_type="rotary", n_key_value_heads=2, normalization_type="RMS",
    act_fn="silu", gated_mlp=True,
)  # fmt: skip

# --- the toy task -----------------------------------------------------------------------------

#: Word pairs whose input and answer are each one token (with its leading space) for the tiny
#: tokenizer of `tiny_model`, so every n-shot prompt of the task has the same token length.
TOY_PAIRS = [
    ("b", "of"), ("c", "is"), ("d", "to"), ("l", "an"), ("o", "and"), ("s", "the"),
    ("t", "cap"), ("F", "Par"), ("I", "Mar"), ("of", "Ital"), ("is", "Fran"), ("to", "Jo"),
    ("an", "b"), ("and", "c"), ("the", "d"), ("cap", "l"), ("Par", "o"), ("Mar", "s"),
    ("Ital", "t"), ("Fran", "F"),
]  # fmt: skip
#: The toy task, for experiments and rankings on `tiny_model`.
TOY_TASK = Task(name="toy", pairs=TOY_PAIRS)
#: Prompts in the task's template, of different token lengths on purpose (padding must not
#: change a result); their corrupted twins swap the demonstrations' answers; TOY_TARGETS holds
#: one target token id per prompt.
TOY_CLEAN = [
    "Q: b\nA: of\n\nQ: c\nA: is\n\nQ: d\nA:",
    "Q: c\nA: is\n\nQ: d\nA: to\n\nQ: b\nA:",
    "Q: the city of\nA:",
]
TOY_CORRUPTED = [
    "Q: b\nA: is\n\nQ: c\nA: of\n\nQ: d\nA:",
    "Q: c\nA: to\n\nQ: d\nA: is\n\nQ: b\nA:",
    "Q: the city to\nA:",
]
TOY_TARGETS = [5, 6, 7]


def one_layer_model(*, q_gain: float = 1.0, **overrides: Any) -> Any:
    """The one-layer toy: attention only, no norm, float64, seeded, with the tiny tokenizer: a
    `boot_native` TransformerBridge under TL 4, a HookedTransformer under TL 2. Its logits are
    linear in each head's pattern, so R . (A' - A) is the true effect of a change of the pattern.

    Args:
        q_gain: multiplies W_Q (large queries: saturated rows).
        overrides: config fields over d_model 32, 4 heads of 8, n_ctx 64, 300 tokens, e.g.
            `n_key_value_heads=2`, `positional_embedding_type="rotary"`.
    """
    from transformers import AutoTokenizer

    from ra_lens.toy_models import tiny_tokenizer_dir

    settings = dict(
        d_model=32, d_head=8, n_layers=1, n_heads=4, n_ctx=64, d_vocab=300, act_fn="gelu",
        seed=0, attn_only=True, normalization_type=None,
    )  # fmt: skip
    settings.update(overrides)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    torch.manual_seed(0)
    if has_bridge():
        from transformer_lens.config import TransformerBridgeConfig
        from transformer_lens.model_bridge import TransformerBridge

        model = TransformerBridge.boot_native(
            TransformerBridgeConfig(**settings), dtype=torch.float64, tokenizer=tokenizer
        )
    else:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        config = HookedTransformerConfig(**settings, dtype=torch.float64)
        model = HookedTransformer(config, tokenizer=tokenizer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q._original_component.weight", "attn.W_Q")):
                param.mul_(q_gain)
    return model.eval()


def hooked_toy(**overrides: Any) -> Any:
    """A 2-layer HookedTransformer (TL 2), float64, eval mode, seed 0: the same weights for the
    same settings (`overrides` change the config: rotary, grouped key/value heads, norms)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformers import AutoTokenizer

    from ra_lens.toy_models import tiny_tokenizer_dir

    settings = dict(
        d_model=32, d_head=8, n_layers=2, n_heads=4, n_ctx=64, d_vocab=300, act_fn="gelu",
        normalization_type="LN", seed=0,
    )  # fmt: skip
    settings.update(overrides)
    torch.manual_seed(0)
    model = HookedTransformer(
        HookedTransformerConfig(**settings),
        tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir()),
    )
    return model.to(torch.float64).eval()


def circuit_toy(kind: str) -> Any:
    """The circuit tests' float64 toy: "gpt2", "llama" (grouped-query, rotary) or "gemma2"
    (post-norm, TL 4 only): a TransformerBridge under TL 4, a HookedTransformer under TL 2."""
    if kind == "gemma2":
        return bridge_model("gemma2", dtype=torch.float64)
    if has_bridge():
        return tiny_model(kind, dtype=torch.float64)
    return hooked_toy(**(LLAMA_LIKE if kind == "llama" else {}))


def dropout_model() -> Any:
    """A tiny float64 model in train mode whose forward pass is random unless every module is in
    eval mode: under TL 4 a GPT-2 bridge with dropout 0.3 (residual, embedding, attention; the
    embedding dropout lives only in the HuggingFace model the bridge wraps). TransformerLens 2's
    HookedTransformer has no dropout modules at all, so under TL 2 it is the plain tiny
    HookedTransformer in train mode (only the mode bookkeeping is then tested)."""
    import torch

    if has_bridge():
        model = tiny_model("gpt2", dtype=torch.float64, dropout=0.3)
    else:
        model = tiny_model("hooked", dtype=torch.float64)
    return model.train()


def module_modes(model: Any) -> list[tuple[str, bool]]:
    """(name, training) of every module the forward pass uses, a bridge's HuggingFace modules
    (`model.original_model`) included."""
    import torch

    modes = [(f"bridge.{n}", m.training) for n, m in model.named_modules()]
    hf = getattr(model, "original_model", None)
    if isinstance(hf, torch.nn.Module):
        modes += [(f"hf.{n}", m.training) for n, m in hf.named_modules()]
    return modes


# --- ground truth from HuggingFace's own attention code -----------------------------------------


def hf_attention_grads(hf: Any, tokens: Any, metric: Any) -> dict[str, list[Any]]:
    """dM/d(QK^T), dM/d(softmax input) and dM/d(softmax output) of every layer, read inside a
    plain HuggingFace model's own eager attention: no TransformerLens, no ra-lens.

    A TorchFunctionMode adds a zero tensor that requires grad to the result of every
    [.., seq, seq] matmul or baddbmm that forms QK^T (BLOOM's baddbmm scales it by alpha; the
    leaf is scaled the same way, so its gradient is dM/d(QK^T) itself), and to the input and output
    of every softmax over [.., seq, seq]. Each value: a list over layers of Float[Tensor,
    "batch head query key"] (BLOOM's [batch*head, ...] reshaped). OPT pre-scales its queries:
    `hf_qk_factor` says by what to multiply.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    seq = tokens.shape[1]
    leaves: dict[str, list[Any]] = {"qk": [], "scores": [], "pattern": []}

    def leaf(kind: str, like: Any) -> Any:
        zero = torch.zeros_like(like, requires_grad=True)
        leaves[kind].append(zero)
        return zero

    class Leaves(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            square = lambda t: isinstance(t, torch.Tensor) and t.shape[-2:] == (seq, seq)  # noqa: E731
            if func in (torch.softmax, F.softmax, torch.Tensor.softmax) and square(args[0]):
                out = func(args[0] + leaf("scores", args[0]), *args[1:], **kwargs)
                return out + leaf("pattern", out)
            out = func(*args, **kwargs)
            if func in (torch.baddbmm, torch.Tensor.baddbmm) and square(out):
                return out + kwargs.get("alpha", 1.0) * leaf("qk", out)
            is_matmul = func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
            if is_matmul and square(out) and args[1].shape[-1] == seq:
                return out + leaf("qk", out)
            return out

    with Leaves():
        logits = hf(tokens).logits
    flat = [t for kind in ("qk", "scores", "pattern") for t in leaves[kind]]
    grads = torch.autograd.grad(metric(logits).sum(), flat, allow_unused=True)
    out: dict[str, list[Any]] = {}
    i = 0
    for kind in ("qk", "scores", "pattern"):
        n = len(leaves[kind])
        out[kind] = [
            (torch.zeros_like(t) if g is None else g).reshape(tokens.shape[0], -1, seq, seq)
            for t, g in zip(leaves[kind], grads[i : i + n])
        ]
        i += n
    return out


def hf_qk_factor(hf: Any, layer: int) -> float:
    """What turns the gradient at HuggingFace's QK matmul into dM/d(QK^T): OPT multiplies its
    queries by `scaling` before the matmul (so the matmul forms s QK^T), every other model 1."""
    attn = hf.model.decoder.layers[layer].self_attn if hf.config.model_type == "opt" else None
    return float(attn.scaling) if attn is not None else 1.0


def hf_logits_with_pattern_added(hf: Any, tokens: Any, added: list[Any]) -> Any:
    """The logits of a plain HuggingFace model with `added[layer]` (Float[Tensor, "batch head
    query key"]) added to the output of each layer's attention softmax, inside HF's own eager
    attention: the ground truth of attention patching."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    seq, calls = tokens.shape[1], []

    class Add(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            softmax = func in (torch.softmax, F.softmax, torch.Tensor.softmax)
            if softmax and out.shape[-2:] == (seq, seq):
                delta = added[len(calls)]
                calls.append(func)
                return out + delta.reshape(out.shape).to(out.dtype)
            return out

    with torch.no_grad(), Add():
        logits = hf(tokens).logits
    assert len(calls) == len(added), "one softmax per layer expected"
    return logits


# --- the circuit page ---------------------------------------------------------------------------

#: Clean/corrupted pairs the tiny tokenizer takes (one-token answers, equal token lengths).
PAGE_PAIRS = [
    ("I like Italy", "I like Paris", " and", " the"),
    ("I like Paris", "I like Italy", " the", " and"),
    ("The capital of Italy is", "The capital of Paris is", " the", " and"),
]


def page_setup() -> Any:
    """What a circuit page is built from, on a tiny model (Llama with grouped-query attention
    under TL 4, HookedTransformer under TL 2): the pairs, "exact" edge scores, their faithfulness
    curve at MIB's fractions and a 12-edge circuit with its faithfulness."""
    from types import SimpleNamespace

    from ra_lens import circuits
    from ra_lens.tasks.ioi import PromptPair, paired_batch

    model = tiny_model(arch_or_hooked("llama"))
    pairs = [PromptPair(*p) for p in PAGE_PAIRS]
    clean, corrupted, metric = paired_batch(model, pairs)
    scores = circuits.attribute(model, clean, corrupted, metric, method="exact")
    curve = circuits.faithfulness_curve(model, scores, clean, corrupted, metric)
    circuit = scores.top(12)
    kept = circuits.faithfulness(model, circuit, clean, corrupted, metric)
    return SimpleNamespace(
        model=model, pairs=pairs, clean=clean, corrupted=corrupted, metric=metric,
        scores=scores, curve=curve, circuit=circuit, faithfulness=kept.value,
    )  # fmt: skip


def prob_last(logits: Any, target: int) -> float:
    """p(target) at the last position of the first prompt; logits: [batch, pos, d_vocab]."""
    return float(logits[0, -1].double().softmax(-1)[target])


def clean_z(model: Any, tokens: Any) -> dict[int, Any]:
    """Each layer's hook_z on an unpatched forward pass: {layer: [batch, pos, n_heads, d_head]}."""
    import torch

    seen = {}

    def keep(layer: int) -> Any:
        def hook(z: Any, hook: Any) -> None:
            seen[layer] = z.detach().clone()

        return hook

    hooks = [(Z.format(la), keep(la)) for la in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens)
    return seen


class FakeClock:
    """Advances by `step` seconds on every read."""

    def __init__(self, step: float = 1.0):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def kl_to(model: Any, reference_tokens: Any, *, inside: bool) -> Any:
    """KL(model(reference_tokens) || logits) at the last position; with inside=True the
    reference logits are computed inside the metric, under no_grad, by a second forward pass."""
    with torch.no_grad():
        fixed = model(reference_tokens).log_softmax(-1)[:, -1]

    def metric(logits: Any) -> Any:
        ref = fixed
        if inside:
            with torch.no_grad():
                ref = model(reference_tokens).log_softmax(-1)[:, -1]
        return (ref.exp() * (ref - logits[:, -1].log_softmax(-1))).sum(-1)

    return metric


@contextlib.contextmanager
def benchmark_modules(*names: str) -> Iterator[Any]:
    """benchmarks/<name>.py imported the way `python benchmarks/bench_ra.py` imports them
    (benchmarks/ first on sys.path), as attributes of one namespace."""
    import importlib
    import sys
    from types import SimpleNamespace

    folder = str(REPO_ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield SimpleNamespace(**{name: importlib.import_module(name) for name in names})
    finally:
        sys.path.remove(folder)
