# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     notebook_metadata_filter: kernelspec,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Circuits, the query/key side: exact-softmax attribution against activation patching
#
# **What this shows.** Attribution patching estimates, from one backward pass, what patching a
# node from a clean run into a corrupted run would do to a metric. For a head's *queries* and
# *keys* the usual estimate is linear through the softmax, and it goes blind where attention is
# saturated (a one-hot row has almost no gradient, however much moving its key would change).
# `ra_lens.attention_attribution` recomputes the changed attention rows exactly (AtP*'s "QK
# fix"; one closed form per key node) and multiplies by the gradient at `hook_pattern`, the
# quantity ra-lens already captures. On one indirect-object-identification (IOI) pair on
# SmolLM2-135M we
#
# 1. compute the exact and the linear estimate for every head's queries, keys and pattern, and
#    the RA norms, each from one forward+backward pass;
# 2. compute the truth by activation patching every head's queries (270 heads) and every
#    key/value head's keys (90: SmolLM2 has grouped-query attention, 3 KV heads per layer);
# 3. put them side by side, scatter estimate against truth, and look at the heads the linear
#    estimate and the RA norms underrate;
# 4. draw the query-key links that carry the effect on the tokens, and export the result as
#    TransformerLens 4's `AttributionResult`.
#
# **Runtime:** about 3 minutes on a 2-core CPU (the activation-patching scan is ~99% of it).

# %%
# %matplotlib inline
import warnings

from IPython.display import HTML

import ra_lens
from ra_lens import viz
from ra_lens.experiments.attention_attribution import node_patching
from ra_lens.ranking import pearson, top_recall
from ra_lens.tasks import ioi
from ra_lens.timing import timed

# tqdm warns once when ipywidgets is missing; progress bars still work as plain text
warnings.filterwarnings("ignore", message="IProgress not found")

model = ra_lens.load_model(device="cpu")
n_layers, n_heads, n_kv = model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads

pair = ioi.ioi_pairs(1)[0]
clean, corrupted, metric = ioi.paired_batch(model, [pair])
print("clean:    ", repr(pair.clean), "->", repr(pair.answer))
print("corrupted:", repr(pair.corrupted))
print(f"metric:    logit({pair.answer!r}) - logit({pair.wrong!r})")

# %% [markdown]
# ## The estimates: exact, linear, RA norms
#
# `attention_attribution(model, clean, corrupted, metric)` runs the corrupted prompt forward
# and backward (gradient R = dM/dA at every `hook_pattern`, rotated queries and keys at
# `hook_rot_q`/`hook_rot_k`) and the clean prompt forward. Direction "denoise" (TransformerLens
# 4's convention): a score estimates M(corrupted with this node taken from clean) -
# M(corrupted). `scores[kind]` sums over positions; `by_position[kind]` keeps them.

# %%
seconds = {}
with timed(seconds, "exact"):
    exact = ra_lens.attention_attribution(model, clean, corrupted, metric)
with timed(seconds, "linear"):
    linear = ra_lens.attention_attribution(model, clean, corrupted, metric, method="linear")
ra = ra_lens.reversed_attention(model, clean, metric)  # RA of the same metric, clean prompt
print(
    f"metric: clean {float(exact.clean_metric[0]):.2f}, corrupted {float(exact.corrupted_metric[0]):.2f}"
)
print(
    f"exact estimate of all {3 * n_layers * n_heads} q/k/pattern nodes x positions: "
    f"{seconds['exact']:.1f} s; linear: {seconds['linear']:.1f} s"
)
assert float(exact.clean_metric[0]) > float(exact.corrupted_metric[0]) + 1, (
    "clean should favour the answer"
)
print(
    "top query heads (exact):", [(la, h, round(v, 3)) for la, h, v in exact.top_heads(5, "query")]
)
print(
    "top KV heads by key (exact):", [(la, h, round(v, 3)) for la, h, v in exact.top_heads(5, "key")]
)

# %% [markdown]
# ## The truth: activation patching of every head's queries and keys
#
# A plain hook loop: the corrupted prompt runs with one head's queries (all positions,
# `hook_rot_q`) or one KV head's keys (`hook_rot_k`) replaced by their clean values, and the
# metric is read off. Jobs are stacked along the batch axis (64 per forward pass); it is 360
# patched runs against the estimate's one forward+backward pass.

# %%
with timed(seconds, "activation patching"):  # {"query": [layer head], "key": [layer kv_head]}
    truth = node_patching(model, clean, corrupted, metric, kinds=("query", "key"), max_rows=64)
truth = {kind: effect.float() for kind, effect in truth.items()}
print(
    f"activation patching: {seconds['activation patching']:.0f} s, "
    f"{seconds['activation patching'] / seconds['exact']:.0f}x the exact estimate"
)

# %% [markdown]
# ## Side by side
#
# Query nodes as layer x head maps: the truth, the two estimates, and the RA norm (which
# needs no corrupted prompt, but is unsigned and, like the linear estimate, shrinks on
# saturated rows). Then the key nodes, per KV head.

# %%
viz.ranking_maps(
    {
        "activation patching (q)": truth["query"],
        "exact (q)": exact.scores["query"],
        "linear (q)": linear.scores["query"],
        "RA norm": ra.head_norms(),
    }
)

# %%
viz.ranking_maps(
    {
        "activation patching (k)": truth["key"],
        "exact (k)": exact.scores["key"],
        "linear (k)": linear.scores["key"],
    }
)

# %% [markdown]
# ## Estimate against truth
#
# One point per head (query) or KV head (key). On the dashed diagonal an estimate equals the
# true effect. The exact estimate is still an estimate (the rest of the network after the
# pattern is linearised), but it does not lose the saturated rows.

# %%
stats = {}
for kind in ("query", "key"):
    stats[kind] = {
        "pearson exact": pearson(exact.scores[kind], truth[kind]),
        "pearson linear": pearson(linear.scores[kind], truth[kind]),
        "top-20 recall exact": top_recall(exact.scores[kind], truth[kind]),
        "top-20 recall linear": top_recall(linear.scores[kind], truth[kind]),
    }
    print(kind, {k: round(v, 3) for k, v in stats[kind].items()})
for kind in ("query", "key"):
    assert stats[kind]["pearson exact"] > stats[kind]["pearson linear"], kind
viz.estimate_scatter(
    truth,
    {
        "exact": {k: exact.scores[k] for k in truth},
        "linear": {k: linear.scores[k] for k in truth},
    },
)

# %% [markdown]
# ## Where the linear estimate and RA norms look away
#
# The heads with the largest true query/key effects, with their rank under each score and the
# largest attention weight of their last row (1.0 = saturated). A head whose row is nearly
# one-hot has a tiny softmax derivative, so the linear estimate and its RA map are small even
# when patching it moves the answer.


# %%
def rank_of(scores, index):
    return int((scores.flatten().abs() > scores.flatten().abs()[index]).sum()) + 1


last = int(clean.lengths[0]) - 1
ra_scores = ra.head_norms()
rows = []
for kind in ("query", "key"):
    width = truth[kind].shape[1]
    for flat in truth[kind].flatten().abs().argsort(descending=True)[:6].tolist():
        layer, head = divmod(flat, width)
        heads = (
            [head]
            if kind == "query"
            else range(head * (n_heads // n_kv), (head + 1) * (n_heads // n_kv))
        )
        row_max = max(float(exact.patterns[0, layer, h, last].max()) for h in heads)
        best_ra = min(rank_of(ra_scores, layer * n_heads + h) for h in heads)
        rows.append(
            (
                kind,
                layer,
                head,
                float(truth[kind][layer, head]),
                rank_of(exact.scores[kind], flat),
                rank_of(linear.scores[kind], flat),
                best_ra,
                row_max,
            )
        )
print(
    f"{'node':>6} {'L':>3} {'H':>3} {'truth':>8} {'exact rank':>10} {'linear rank':>11} "
    f"{'RA rank':>7} {'row max':>7}"
)
for kind, layer, head, value, r_exact, r_linear, r_ra, row_max in rows:
    print(
        f"{kind:>6} {layer:>3} {head:>3} {value:>+8.3f} {r_exact:>10} {r_linear:>11} "
        f"{r_ra:>7} {row_max:>7.3f}"
    )

# %% [markdown]
# ## The links that carry the effect
#
# `att.edges` is R * (A_clean - A_corrupted) per query-key link, the pattern node's terms:
# which links of which heads change the metric when the pattern is taken from the clean run.
# The arcs go from the key token to the query token. `viz.attribution_edges_page` writes the
# same maps as an offline circuitsvis page.

# %%
viz.top_edges_on_tokens(exact, k=8)

# %%
page = viz.attribution_edges_page(exact, [(la, h) for la, h, *_ in exact.top_edges(6)][:6])
HTML(page)

# %% [markdown]
# ## As a TransformerLens attribution result
#
# `to_transformer_lens()` keys the query and key nodes by TransformerLens 4's
# `Node(kind="q_input" | "k_input", layer, head, position)` (on this GQA model a k_input's
# head is the KV head), so `top_nodes`, and circuit tools that consume an `AttributionResult`,
# work on the exact estimate. (TransformerLens's own edge sweep and `faithfulness` refuse GQA
# models such as SmolLM2.)

# %%
try:
    result = exact.to_transformer_lens()
except ImportError as error:  # TransformerLens 2.x has no attribution module
    print(f"skipped: {error}")
    result = None
if result is not None:
    for node, score in result.top_nodes(6):
        token = exact.str_tokens[0][node.position]
        print(
            f"{node.kind:8} L{node.layer:<2} H{node.head}  pos {node.position:>2} {token!r:>10}  {score:+.3f}"
        )
    assert result.top_nodes(1)[0][1] == max(result.node_scores.values(), key=abs)
