"""Edge scores: what patching one edge writer -> reader would do to a metric, for every edge.

denoise: score[w, r] estimates m(corrupted run with edge w -> r patched to clean) - m(corrupted);
noise: m(clean run with it patched to corrupted) - m(clean). Means over pairs; 0 off the graph.

- "eap": (w's output on the other run - on this run) . dM/d(r's input), one backward pass
  (EAP, Syed et al. 2023). The gradient at each reader's own input comes from a zero tensor added
  to that input alone (`_edges.EdgeRun(leaves=True)`).
- "eap-ig": the gradient averaged over `steps` points of the straight line between the two runs'
  embeddings, point k = other + (k / steps) (this - other), k = 1..steps, as EAP-IG "inputs"
  does; steps=1 is "eap".
- "exact": edges into a query (key) go through the reader head's real softmax: the writer's
  difference is added to the reader's input, the norm, W_Q (W_K) and the rotary embedding are
  applied exactly, every attention row of the head is recomputed with the changed query (keys)
  and the change of the pattern is multiplied by R = dM/dA (AtP*'s fix, per edge: an edge moves
  the query or key at every position at once, so whole rows are recomputed). <v>, MLP and logits
  edges as "eap".
- "exact-ig": "exact" with R, the residual stream and the gradients averaged along the IG path.
- "eap-ig-act": EAP-IG's "EAP-IG-activations": the gradient averaged over passes in which one
  node's output (the embeddings, one layer's attention, one MLP) is held at a point between the
  two runs, k = 1..steps per node, all other nodes computed (`_ig_activations`); EAP-IG's own
  algorithm with direction="noise". It costs (2 n_layers + 1) x steps passes per batch.

Grouped-query models (n_kv_heads < n_heads): the graph has one `<k>` and one `<v>` reader per
key/value head, while EAP-IG's ungrouped graph, which MIB judges, has one per query head (the key
or value input that head alone reads). Every method also scores those copies
(`EdgeScores.ungrouped_scores`), each as EAP-IG's would on the ungrouped model: query head h reads
the key only through its own pattern A_h and the value only through z_h = A_h v, so its copy's
gradient is the backward pass of dM/dA_h (through the model's own softmax, soft-cap, q/k norms and
rotation) or of A_h^T dM/dz_h (through v's projection) to the reader's input; "exact" keeps each
query head's own exact-softmax key score. The copies of an edge add up to its grouped score: the
last query head of each group gets the grouped score less the others' (one backward pass per
group saved). Models without grouped-query attention keep one pass and no copies.

Node scores (one per writer and per reader, their edges' sums) are `circuits.nodes.attribute_nodes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from ra_lens import attention, capture, contract, pairs, state
from ra_lens._typing import Validated
from ra_lens.capture import PATTERN, HookedModel
from ra_lens.checks import check_count
from ra_lens.circuits import _edges, _ig_activations
from ra_lens.circuits.graph import Graph
from ra_lens.circuits.scores import EdgeScores
from ra_lens.progress import tqdm
from ra_lens.types import MetricFn, Tokens
from ra_lens.weights import LayerWeights, check_supported, layer_weights

Method = Literal["eap", "eap-ig", "exact", "exact-ig", "eap-ig-act"]
METHODS: tuple[str, ...] = ("eap", "eap-ig", "exact", "exact-ig", "eap-ig-act")
DIRECTIONS: tuple[str, ...] = ("denoise", "noise")
#: Writers per chunk in the exact softmax (bounds memory: chunk x batch x heads x pos^2).
_WRITER_CHUNK = 32


def attribute(
    model: Validated[HookedModel],
    clean: Tokens,
    corrupted: Tokens,
    metric: MetricFn,
    *,
    method: Validated[Method] = "eap-ig",
    direction: Validated[Literal["denoise", "noise"]] = "denoise",
    steps: int = 5,
    batch_size: int = 8,
    progress: bool = False,
) -> EdgeScores:
    """Score every edge of the model's graph (`Graph.from_model`).

    Args:
        model: TransformerBridge or HookedTransformer with sequential attention/MLP blocks
            (grouped-query attention and rotary embeddings included).
        clean, corrupted: Int[Tensor, "batch pos"], Batch or strings; pair i of equal token
            length (right padding across pairs is fine).
        metric: logits -> Float[Tensor, "batch"], one value per prompt (ra_lens.metrics); a plain
            callable needs batch_size >= the number of pairs.
        method: "eap", "eap-ig", "exact", "exact-ig" or "eap-ig-act" (module docstring). The default,
            "eap-ig" with 5 steps, denoise, is EAP-IG-inputs' algorithm: on held-out SmolLM2
            pairs it gave the best CPR at a fraction of "exact"'s and "exact-ig"'s cost (README).
        direction: "denoise" (gradient on the corrupted run) or "noise" (on the clean run).
        steps: points on the IG path ("eap-ig", "exact-ig"; per node for "eap-ig-act"; ignored
            otherwise).
        batch_size: pairs per forward/backward pass (memory grows with it).
        progress: show a progress bar.

    Returns:
        EdgeScores (scores: Float[Tensor, "writer reader"], float64, mean over pairs, 0 where
        graph.real is False); `attribute_nodes` sums them per node.

    Raises:
        ValueError: unknown method/direction, steps < 1, unequal pair lengths, a metric
            without one value per prompt or without a gradient, attention that is not causal
            softmax attention, a model whose weights are on the meta device.
        TypeError: a model that is not a TransformerLens model.
        RuntimeError: hook_pattern outside the autograd graph (exact methods need R there).
        NotImplementedError: readers this cannot rewrite (post-norm blocks on a
            HookedTransformer or with an output bias, ungrouped key/value heads, shortformer
            positions); for the exact methods, attention they cannot replay (q/k norms,
            unreadable ALiBi slopes). Parallel attention/MLP blocks are supported.

    >>> from ra_lens.metrics import logit_diff
    >>> clean, corrupted = "The capital of France is", "The capital of Italy is"
    >>> scores = attribute(model, clean, corrupted, logit_diff([294], [52]), method="eap")
    >>> scores.scores.shape, bool(scores.scores[~scores.graph.real].eq(0).all())
    (torch.Size([11, 27]), True)
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {METHODS}")
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}: choose one of {DIRECTIONS}")
    check_count(steps, "steps")
    capture.check_model(model)
    facts = contract.model_facts(model)
    check_supported(model, facts)
    graph = Graph.from_model(model)
    clean_b, corrupted_b = pairs.paired(model, clean, corrupted)
    exact = method.startswith("exact")
    if exact:
        capture.require_live_patterns(
            model, list(range(graph.n_layers)), "the exact methods need R = dM/dA there"
        )
        for layer in range(graph.n_layers):  # refused before any pass, not after the first
            _refuse_unmodelled(facts, layer)
    n_steps = steps if "-ig" in method else 1
    per_batch = n_steps
    if method == "eap-ig-act":
        attn_only = not facts.layouts[0].has_mlp
        per_batch = n_steps * len(_ig_activations.nodes(graph, attn_only))
    base_b, other_b = (corrupted_b, clean_b) if direction == "denoise" else (clean_b, corrupted_b)
    n = base_b.tokens.shape[0]
    rows_list = pairs.chunks(n, batch_size)
    total = torch.zeros(len(graph.writers), len(graph.readers), dtype=torch.float64)
    kv_total: Tensor | None = None  # [writer layer kv head]: per query head, grouped-query only
    bar = tqdm(total=len(rows_list) * per_batch, desc=f"attribute {method}", disable=not progress)
    with capture.preserved_state(model):
        state.enable_mlp_in(model)
        weights = [layer_weights(model, layer, facts) for layer in range(graph.n_layers)]
        for rows in rows_list:
            part_metric = pairs.metric_rows(metric, rows, n)
            base, other = base_b.rows(rows), other_b.rows(rows)
            batch = _Batch(model, graph, weights, facts, base, other, part_metric, n_steps, bar)
            part, kv_part = batch.act_ig() if method == "eap-ig-act" else batch.input_ig(exact)
            total += part
            if kv_part is not None:
                kv_total = kv_part if kv_total is None else kv_total + kv_part
    bar.close()
    scores = (total / n) * graph.real
    copies = None if kv_total is None else _ungrouped(graph, scores, kv_total / n)
    return EdgeScores(graph, scores, method, direction, ungrouped_scores=copies)


@dataclass
class _Batch:
    """One batch of pairs: its scores summed over the IG path, and (grouped-query models) its
    key/value scores per query head, both on the CPU."""

    model: HookedModel
    graph: Graph
    weights: list[LayerWeights]
    facts: contract.ModelFacts
    base: capture.Batch  # the run the gradient is taken on
    other: capture.Batch  # the run the differences are taken to
    metric: MetricFn
    n_steps: int
    bar: Any

    def input_ig(self, exact: bool) -> tuple[Tensor, Tensor | None]:
        """eap, eap-ig, exact, exact-ig: the gradient at n_steps points between the two runs'
        embeddings, times each writer's difference."""
        with torch.no_grad():
            run = _edges.EdgeRun(self.graph, self.weights)
            with self.model.hooks(fwd_hooks=run.hooks(self.model)):
                self.model(self.other.tokens)
            other_out = run.outputs()
        total: Tensor | None = None
        kv_total: Tensor | None = None
        base_out: Tensor | None = None
        for k in range(self.n_steps, 0, -1):  # k = steps first: the run itself gives base_out
            point = None
            if k < self.n_steps:
                assert base_out is not None
                point = other_out[0] + (k / self.n_steps) * (base_out[0] - other_out[0])
            step = _Step(self.model, self.graph, self.weights, self.facts, self.base, self.metric, point, exact)  # fmt: skip
            if base_out is None:
                base_out = step.outputs
            diffs = step.run.residual_effects(other_out - base_out.to(other_out.device))
            part, kv_part = step.scores(diffs, self.base.real_mask())
            part = part.cpu() / self.n_steps
            total = part if total is None else total + part
            if kv_part is not None:
                kv_part = kv_part.cpu() / self.n_steps
                kv_total = kv_part if kv_total is None else kv_total + kv_part
            self.bar.update(1)
        assert total is not None
        return total, kv_total

    def act_ig(self) -> tuple[Tensor, Tensor | None]:
        """eap-ig-act: integrated gradients along each node's activations (`_ig_activations`)."""

        def make_step(point: Tensor | None, replace: list[tuple[str, Any]]) -> _Step:
            return _Step(self.model, self.graph, self.weights, self.facts, self.base, self.metric, point, False, replace)  # fmt: skip

        part, kv_part = _ig_activations.batch_scores(
            self.model, self.graph, self.facts.shape, self.weights, self.base.tokens, self.other.tokens,
            make_step, self.n_steps, self.base.real_mask(), on_pass=lambda: self.bar.update(1),
        )  # fmt: skip
        return part.cpu(), None if kv_part is None else kv_part.cpu()


def _ungrouped(
    graph: Graph,
    scores: Float[Tensor, "writer reader"],
    kv: Float[Tensor, "writer layer kv head"],
) -> Float[Tensor, "writer ureader"]:
    """The scores over EAP-IG's ungrouped readers (`Graph.ungrouped_readers`): each query
    head's own key (kv=0) and value (kv=1) scores, the other readers' as they are."""
    out = scores[:, graph.ungrouped_target].clone()
    for u, (name, r) in enumerate(graph.ungrouped_readers):
        reader = graph.reader(graph.readers[r])
        if reader.kind in ("k", "v"):
            head = int(name[name.index(".h") + 2 : name.index("<")])
            out[:, u] = kv[:, reader.layer, 0 if reader.kind == "k" else 1, head]
    return out * graph.real[:, graph.ungrouped_target]


class _Step:
    """One forward and backward pass at one point of the path: gradients at every reader's
    input, and (exact) the residual stream, rotated q/k, A and R of every layer."""

    def __init__(
        self,
        model: HookedModel,
        graph: Graph,
        weights: list[LayerWeights],
        facts: contract.ModelFacts,
        batch: capture.Batch,
        metric: MetricFn,
        point: Tensor | None,
        exact: bool,
        replace: list[tuple[str, Any]] | None = None,
    ):
        self.model, self.graph, self.weights, self.exact = model, graph, weights, exact
        self.facts = facts
        layers = range(graph.n_layers)
        grouped = graph.group > 1  # per-query-head key/value gradients (`_kv_copies`)
        patterns = [PATTERN.format(la) for la in layers]
        names = list(patterns)
        names += [capture.query_hook_name(model, la) for la in layers]
        names += [capture.key_hook_name(model, la) for la in layers]
        names += attention.rotation_hooks(layers)
        # grouped-query: every layer's pattern as the model uses it (in the autograd graph), and
        # the gradients at hook_pattern and hook_z (`_kv_copies`)
        live: dict[str, Tensor] = {}

        def keep_live(value: Tensor, hook: Any) -> None:
            live.setdefault(hook.name, value)

        run = _edges.EdgeRun(graph, weights, leaves=True, input_value=point)
        fwd = list(replace or []) + run.hooks(model)  # a replaced output is what writers see
        grad_names = patterns if exact or grouped else []
        if grouped:
            fwd = fwd + [(name, keep_live) for name in patterns]
            grad_names = grad_names + [capture.Z.format(la) for la in layers]
        with (
            torch.enable_grad(),
            model.hooks(fwd_hooks=fwd),
            capture.recorded(model, names if exact else []) as acts,
            capture.recorded(model, grad_names, grad=True) as grads,
        ):
            logits = model(batch.tokens)
            values = pairs.metric_values(metric, logits, batch)
            if not values.requires_grad:
                raise ValueError(
                    "the metric's values have no gradient path to the logits: edge scores "
                    "differentiate the metric, so compute it from the logits without .detach(), "
                    ".item(), argmax or torch.no_grad()"
                )
            leaves = run.leaves_in_order()
            found = torch.autograd.grad(
                values.sum(), leaves, allow_unused=True, retain_graph=grouped
            )
        self.grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, found)]
        self.firsts = sorted(run.leaf)
        self.run = run
        self.outputs = run.outputs()
        self.resid = {la: x.detach() for la, x in run.resid.items()}
        attention.fill_rotated(model, acts, layers)
        self.acts, self.pattern_grads = acts, grads
        # layer -> (key copies, value copies), each [kv_head * (group - 1) batch pos d_model]:
        # the gradient at the input of the key (value) head that query head h reads, through
        # head h alone, for the heads h of `_copy_heads` (the last of each group is the rest)
        self.kv_copies: dict[int, tuple[Tensor | None, Tensor]] = {}
        if grouped:
            for layer in layers:
                pattern, z = PATTERN.format(layer), capture.Z.format(layer)
                self.kv_copies[layer] = self._kv_copies(
                    layer, live.get(pattern), grads.get(pattern), grads.get(z)
                )

    def _copy_heads(self) -> list[int]:
        """The query heads whose key/value copies get their own backward pass: all but the last
        of each group, whose copy is the grouped score less the others' (the copies add up to
        it, so one pass per group is saved)."""
        group = self.graph.group
        return [h for h in range(self.graph.n_heads) if h % group != group - 1]

    def _kv_copies(
        self, layer: int, pattern: Tensor | None, r_grad: Tensor | None, z_grad: Tensor | None
    ) -> tuple[Tensor | None, Tensor]:
        """Query head h reads its key/value head's key only through its own pattern A_h and
        the value only through z_h = A_h v: dM/d(h's copy of the key input) is the backward pass
        of R_h = dM/dA_h alone (through the model's own softmax, soft-cap, norms and rotation),
        dM/d(h's copy of the value input) the backward pass of A_h^T dM/dz_h through v's
        projection. One pass per position r < group - 1 in the group serves head r of every
        key/value head (`_copy_heads`)."""
        g, group = self.graph, self.graph.group
        k_in, _ = self.run.kv_inputs[(layer, "k")]
        v_in, v_out = self.run.kv_inputs[(layer, "v")]
        need_k = not self.exact  # exact takes each query head's key score from the softmax
        if pattern is None or (r_grad is not None and not pattern.requires_grad):
            raise RuntimeError(
                f"layer {layer}: hook_pattern is not in the autograd graph, so the key inputs' "
                "gradients cannot be split among the query heads of a group"
            )
        shape = (g.n_kv_heads * (group - 1), *k_in.shape[1:])
        k_copies = torch.zeros(shape, dtype=k_in.dtype, device=k_in.device)
        v_copies = torch.zeros(shape, dtype=v_in.dtype, device=v_in.device)
        for r in range(group - 1):
            heads = torch.arange(r, g.n_heads, group, device=k_in.device)  # one per kv head
            rows = slice(r, None, group - 1)  # their places among `_copy_heads`
            outputs, inputs, grad_outputs = [], [], []
            if z_grad is not None:
                a_r = pattern.detach()[:, heads].to(z_grad.dtype)
                dv = torch.einsum("bhts,bthe->bshe", a_r, z_grad[:, :, heads])
                outputs.append(v_out)
                inputs.append(v_in)
                grad_outputs.append(dv.to(v_out))
            if need_k and r_grad is not None:
                mask = torch.zeros(g.n_heads, dtype=r_grad.dtype, device=r_grad.device)
                mask[heads] = 1
                outputs.append(pattern)
                inputs.append(k_in)
                grad_outputs.append((r_grad * mask[None, :, None, None]).to(pattern))
            if not outputs:
                continue
            found = torch.autograd.grad(
                outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True
            )
            for got, want, t in zip(found, grad_outputs, inputs):
                if got is None and bool(want.ne(0).any()):  # else the last copy takes it all
                    raise RuntimeError(
                        f"layer {layer}: the {'value' if t is v_in else 'key'} inputs do not "
                        "reach hook_pattern/hook_z in the autograd graph, so their gradient "
                        "cannot be split among the query heads of a group"
                    )
                if got is not None:
                    (v_copies if t is v_in else k_copies)[rows] = got
        return (k_copies if need_k else None), v_copies

    @torch.no_grad()  # the recorded activations may still require grad: build no graph from them
    def scores(
        self, diffs: Tensor, real: Tensor
    ) -> tuple[Float[Tensor, "writer reader"], Float[Tensor, "writer layer kv head"] | None]:
        """Edge scores summed over the batch: diffs . gradient, and the exact softmax for q/k;
        on a grouped-query model also each query head's copy of the key (kv=0) and value (kv=1)
        edges (None otherwise)."""
        g = self.graph
        out = torch.zeros(len(g.writers), len(g.readers), dtype=torch.float64, device=diffs.device)
        copies = None
        if self.kv_copies:
            shape = (len(g.writers), g.n_layers, 2, g.n_heads)
            copies = torch.zeros(shape, dtype=torch.float64, device=diffs.device)
        # The dot products run in the model's precision (float32 at least), summed in float64.
        dtype = torch.float64 if diffs.dtype == torch.float64 else torch.float32
        flat = diffs.to(dtype).flatten(1)
        per_layer = g.n_heads + 2 * g.n_kv_heads + 1
        for first, grad in zip(self.firsts, self.grads):
            n_before = int(g.real[:, first].sum())  # writers feeding this block of readers
            layer, at = divmod(first, per_layer)
            extra = []  # the copies' gradients ride on the same product: flat is read once
            if copies is not None and at == 0 and layer in self.kv_copies:  # q/k/v readers
                extra = [c for c in self.kv_copies[layer] if c is not None]
            columns = torch.cat([grad, *extra]).to(diffs.device, dtype).flatten(1)
            block = (flat[:n_before] @ columns.T).double()
            out[:n_before, first : first + grad.shape[0]] = block[:, : grad.shape[0]]
            if extra:
                assert copies is not None
                self._copy_scores(layer, block, grad.shape[0], copies)
        if self.exact:
            for layer in range(g.n_layers):
                self._exact_layer(layer, diffs, real, out, copies)
        return out, copies

    def _copy_scores(self, layer: int, block: Tensor, n_readers: int, copies: Tensor) -> None:
        """Fill copies[:, layer] from `block`: this layer's q/k/v readers' scores (n_readers
        columns) followed by those of the key copies (not with exact) and the value copies of
        `_copy_heads`; the last head of each group gets the grouped score less the others'."""
        g, group = self.graph, self.graph.group
        heads = self._copy_heads()
        last = list(range(group - 1, g.n_heads, group))
        n, width = block.shape[0], len(heads)
        at = n_readers
        for kv, grads in enumerate(self.kv_copies[layer]):
            if grads is None:  # exact keys: every head's own score comes from the softmax
                continue
            own = block[:, at : at + width]
            at += width
            copies[:n, layer, kv, heads] = own
            first = g.n_heads + kv * g.n_kv_heads
            whole = block[:, first : first + g.n_kv_heads]
            copies[:n, layer, kv, last] = whole - own.reshape(n, g.n_kv_heads, group - 1).sum(-1)

    def _exact_layer(
        self, layer: int, diffs: Tensor, real: Tensor, out: Tensor, copies: Tensor | None
    ) -> None:
        g, model, w = self.graph, self.model, self.weights[layer]
        acts = self.acts
        names = [capture.query_hook_name(model, layer), capture.key_hook_name(model, layer)]
        attention.require_fired(
            names, acts, "the exact methods cannot redo its softmax; use method='eap' or 'eap-ig'"
        )
        facts = _refuse_unmodelled(self.facts, layer)
        q = acts[capture.query_hook_name(model, layer)].double()
        k = acts[capture.key_hook_name(model, layer)].double()
        pattern = acts[PATTERN.format(layer)].double()
        grad = self.pattern_grads.get(PATTERN.format(layer))
        if grad is None:  # the metric does not depend on this layer's attention
            grad = torch.zeros_like(pattern)
        grad = grad.double()
        turn = _rotation(model, layer, acts)
        group = g.n_heads // g.n_kv_heads
        n_pos = q.shape[1]
        causal = facts.mask(n_pos, q.device)
        rows = real.to(q.device)[:, None, :, None]
        k_rep = attention.per_query_head(k, group)
        raw = torch.einsum("bthe,bshe->bhts", q, k_rep)
        base_pattern = facts.logits(raw).softmax(-1)
        attention.check_recomputed(
            layer,
            base_pattern,
            acts[PATTERN.format(layer)],
            rows,
            facts,
            "use method='eap' or 'eap-ig'",
        )
        weight = grad.masked_fill(~causal, 0.0) * rows  # R on real rows only
        # The projections of every writer's change are most of the cost: they run in the
        # model's precision (float32 at least), with the rotary embedding folded into W_Q and
        # W_K per position; the logit changes and the softmax then run in float64.
        x = self.resid[layer]
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        w_q, w_k = _rotated_weight(w.W_Q, turn, dtype), _rotated_weight(w.W_K, turn, dtype)
        q_low, k_low = q.to(dtype), k_rep.to(dtype)
        normed = w.ln1(x)
        first = layer * (g.n_heads + 2 * g.n_kv_heads + 1)
        n_before = int(g.real[:, first].sum())
        for start in range(0, n_before, _WRITER_CHUNK):
            chunk = diffs[start : min(start + _WRITER_CHUNK, n_before)].to(x.device, x.dtype)
            change = (w.ln1(x[None] + chunk) - normed[None]).to(dtype)
            dq = _project(change, w_q)
            dlog = torch.einsum("wbthe,bshe->wbhts", dq, k_low).double()
            new = facts.logits(raw[None] + dlog).softmax(-1)
            query = ((new - base_pattern[None]) * weight[None]).sum((-1, -2)).sum(1)  # [w h]
            dk = _project(change, w_k)
            dk = attention.per_query_head(dk, group, dim=3)
            dlog = torch.einsum("bthe,wbshe->wbhts", q_low, dk).double()
            new = facts.logits(raw[None] + dlog).softmax(-1)
            key = ((new - base_pattern[None]) * weight[None]).sum((-1, -2)).sum(1)  # [w h]
            writers = slice(start, start + chunk.shape[0])
            if copies is not None:  # query head h's softmax reads the key through head h only
                copies[writers, layer, 0] = key.to(copies.device)
            key = einops.reduce(key, "w (g r) -> w g", "sum", r=group)
            out[writers, first : first + g.n_heads] = query.to(out.device)
            out[writers, first + g.n_heads : first + g.n_heads + g.n_kv_heads] = key.to(out.device)


def _refuse_unmodelled(model_facts: contract.ModelFacts, layer: int) -> contract.AttentionFacts:
    """The layer's `AttentionFacts`, or NotImplementedError naming what the exact methods
    cannot replay (q/k norms, unreadable ALiBi slopes)."""
    facts = model_facts.attention[layer]
    cause = facts.refusal()
    if cause is not None:
        raise NotImplementedError(
            f"layer {layer}: {cause}, so the exact methods cannot redo this softmax; use "
            "method='eap' or 'eap-ig'"
        )
    return facts


def _project(
    change: Float[Tensor, "writer batch pos d_model"], weight: Tensor
) -> Float[Tensor, "writer batch pos head d_head"]:
    """change @ W at every position, W from `_rotated_weight`."""
    if weight.shape[0] == 1:
        return torch.einsum("wbpd,dhe->wbphe", change, weight[0])
    return torch.einsum("wbpd,pdhe->wbphe", change, weight)


def _rotated_weight(
    weight: Float[Tensor, "head d_model d_head"], turn: Tensor | None, dtype: torch.dtype
) -> Float[Tensor, "n d_model head d_head"]:
    """W_Q (W_K) followed by the rotary embedding at each position (no rotary: one copy)."""
    if turn is None:
        return einops.rearrange(weight, "h d e -> 1 d h e").to(dtype)
    return torch.einsum("hde,pef->pdhf", weight.double(), turn).to(dtype)


def _rotation(model: HookedModel, layer: int, acts: dict[str, Tensor]) -> Tensor | None:
    """The layer's rotary embedding as one d_head x d_head matrix per position, Float[Tensor,
    "pos d_head d_head"] (rotate(v) at position p is v @ M[p]; None without one), checked
    against the model's own rotated queries."""
    rotated = capture.ROT_Q.format(layer)
    if rotated not in acts:
        return None
    rotate = attention.rotary_function(model, layer, acts)
    if rotate is None:
        raise ValueError(
            f"layer {layer}: the rotary embedding could not be read (no cos/sin tables, no "
            "known rotation); use method='eap'"
        )
    q = acts[capture.Q.format(layer)]
    attention.check_rotation(layer, rotate, q, acts[rotated], "use method='eap'")
    q = q.double()
    return attention.rotation_matrices(rotate, q.shape[-3], q.shape[-1], q.device)
