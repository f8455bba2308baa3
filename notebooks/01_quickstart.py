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
# # ra-lens quickstart: Reversed Attention maps for one prompt
#
# **What this shows.** Reversed Attention (RA, Katz & Wolf, NAACL 2025) is the gradient of a
# loss with respect to the attention logits, $\mathrm{RA} = \partial L / \partial (QK^\top)$:
# an attention-shaped map, one per head, that the backward pass builds anyway. We compute it
# for the paper's Figure-1 prompt *"I like Italy and France. I visited the city of"* with
# target *" Florence"* on the default model (SmolLM2-135M-Instruct, 30 layers x 9 heads), then
#
# 1. check the properties that make RA an attention-like object (rows sum to zero, causal);
# 2. draw a layer x head heat map of RA norms next to forward-attention norms;
# 3. look at the top heads, first as static matplotlib figures, then interactively with
#    circuitsvis (works offline: the JavaScript is inlined);
# 4. compare the three gradient conventions ra-lens offers (`"pattern"`, `"scores"`, `"qk"`).
#
# **Runtime.** 31 s, measured by executing the whole notebook once (`tests/notebooks/test_notebooks.py`, kernel start
# included) on a 2-core CPU VM shared with other jobs (load average about 7, so expect
# less on an idle machine); model load ~5 s, then four forward+backward passes. No GPU
# and no network needed: the model ships with the package.

# %%
# %matplotlib inline
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML, display

import ra_lens
from ra_lens import metrics, viz

# tqdm warns once when ipywidgets is missing; progress bars still work as plain text
warnings.filterwarnings("ignore", message="IProgress not found")

start = time.perf_counter()
torch.set_printoptions(precision=4, sci_mode=False, linewidth=120)

# %% [markdown]
# ## Load the model
#
# `ra_lens.load_model()` returns a TransformerLens model (a `TransformerBridge` under
# TransformerLens 4) of the embedded SmolLM2-135M-Instruct (converted once into a local cache,
# then loaded in seconds); everything below is public ra_lens API and works on either. We pin it
# to the CPU so the notebook behaves the same everywhere. Note the grouped-query attention:
# 9 query heads share 3 key/value heads, but the attention pattern, and therefore RA, is
# per *query* head.

# %%
model = ra_lens.load_model(device="cpu")
cfg = model.cfg
print(
    f"{cfg.n_layers} layers x {cfg.n_heads} heads "
    f"({cfg.n_key_value_heads} key/value heads), d_head = {cfg.d_head}"
)

# %% [markdown]
# ## The prompt and what the model predicts
#
# RA explains a *metric*, so first look at the prediction we are going to explain. The loss is
# $L = -\log p(\text{" Florence"})$ at the last position (`metrics.target_nll`). It is worth
# knowing whether the target is already the model's top guess: here it need not be, and RA
# then tells us how attention would have to move to make it more likely.

# %%
prompt = "I like Italy and France. I visited the city of"
florence = model.to_single_token(" Florence")
tokens = model.to_tokens(prompt)  # prepends the BOS token <|im_start|>
print(model.to_str_tokens(tokens))

with torch.no_grad():
    probs = model(tokens)[0, -1].softmax(-1)
top = probs.topk(5)
for p, t in zip(top.values.tolist(), top.indices.tolist()):
    print(f"{model.to_string([t])!r:>14}  p = {p:.3f}")
print(f"p(' Florence') = {probs[florence]:.3f}")

# %% [markdown]
# ## Reversed Attention of every head, in one backward pass
#
# `reversed_attention(model, tokens, metric)` runs one forward and one backward pass with
# hooks on every `hook_pattern` and returns a `ReversedAttention` with
# `maps[batch, layer, head, query, key]` (on the CPU, float32), the forward `patterns` of
# the same shape, and per-head Frobenius norms. The default convention is the paper's,
# $\partial L/\partial(QK^\top)$ (`convention="qk"`).

# %%
metric = metrics.target_nll([florence])
ra = ra_lens.reversed_attention(model, prompt, metric)
print(ra)
print("maps:", tuple(ra.maps.shape), " attention scale per layer:", ra.scales[0])

# %% [markdown]
# ### Sanity checks: what makes RA attention-shaped
#
# Because RA is the softmax's vector-Jacobian product, $\mathrm{RA}_{ij} = A_{ij}(R_{ij} -
# \sum_k A_{ik}R_{ik})/s$ with $R = \partial L/\partial A$, it inherits the forward
# pattern's structure:
#
# * it is zero above the diagonal (where $A$ is zero) and in row 0 (where $A_{00}=1$);
# * **every row sums to zero**, so adding $\eta\cdot\mathrm{RA}$ to a pattern keeps rows
#   summing to one (this is what makes attention patching in notebook 02 possible);
# * in the last layer only the row of the loss position is non-zero: no other query there
#   can influence the logits at that position.
#
# The cell below asserts all four on the real maps; if one fails, something upstream broke.

# %%
maps = ra.maps[0]  # [layer, head, query, key]
n = maps.shape[-1]
above = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)

checks = {
    "max |row sum|": maps.sum(-1).abs().max().item(),
    "max |entry above the diagonal|": maps[..., above].abs().max().item(),
    "max |row 0|": maps[..., 0, :].abs().max().item(),
    "max |last layer, rows before the last|": maps[-1, :, :-1].abs().max().item(),
    "largest |entry| anywhere (for scale)": maps.abs().max().item(),
}
for name, value in checks.items():
    print(f"{name:>40}: {value:.2e}")

assert checks["max |row sum|"] < 1e-6
assert checks["max |entry above the diagonal|"] == 0
assert checks["max |row 0|"] < 1e-6
assert checks["max |last layer, rows before the last|"] < 1e-9

# %% [markdown]
# ## Which heads does the gradient flow through? Head-norm heat map
#
# The Frobenius norm of each head's RA is the paper's head-importance score: one
# forward+backward pass scores all 270 heads at once (notebook 03 compares it with causal
# methods). Next to it, the norm of the forward pattern, which is dominated by how many
# tokens a head spreads its attention over, not by relevance to the target.
#
# What to look for: the RA panel is sparse, with one or a few bright heads and most of the
# 270 near zero, while forward norms vary within a narrow band (less than a factor of two)
# and say nothing about this particular target. Bright cells in late layers are heads that
# read the answer-relevant tokens directly. Early layers (0-2) often show up in the top ten
# as well: everything downstream depends on them, so gradients through them are sizeable
# without being specific to the target. Treat them with suspicion.

# %%
viz.head_norm_heatmaps(ra)

# %%
forward = ra.forward_norms()
print("rank  head     |RA|    |A|")
for rank, (layer, head, norm) in enumerate(ra.top_heads(8), 1):
    print(f"{rank:>4}  L{layer:<2}H{head}  {norm:.4f}  {forward[layer, head]:.3f}")

# %% [markdown]
# ## The top head: forward attention beside its Reversed Attention (the paper's Figure 1)
#
# `viz.head_pair` draws one head's forward pattern (left, on [0, 1]) beside its RA (right,
# diverging colours with a symmetric range; the masked upper triangle is grey).
#
# **Reading the signs.** RA is the gradient of the *loss*, and gradient descent moves along
# $-\mathrm{RA}$. So with `target_nll`, a **negative (blue)** entry marks a query/key pair
# whose attention logit should *grow* to make " Florence" more likely, and a **positive
# (red)** entry one that should shrink. (Use `metrics.target_prob` or `logit_diff` if you
# prefer "positive = helps"; the map just flips sign.)
#
# At the time of writing, the top head is L23H4 and its last row (query " of") is the
# interesting one: strongly negative at " Italy" and positive at " France", while the rest of
# the map is close to zero. That reads naturally: Florence is in Italy, so the gradient asks
# this head to move attention from " France" to " Italy". The forward pattern alone could
# not tell you this: the head already attends to both countries. The next cell prints the row
# and asserts that the story still holds, so this text cannot silently go stale.

# %%
layer, head, _ = ra.top_heads(1)[0]
viz.head_pair(ra, layer, head)

# %%
last_row = ra.head(layer, head)[-1]
attention = ra.patterns[0, ra.layers.index(layer), head, -1]
keys = ra.str_tokens[0]
print(f"L{layer}H{head}, query {keys[-1]!r}, the 5 largest |RA| entries of its row:")
print(f"{'key':>16}  {'RA':>8}  attention")
for i in last_row.abs().argsort(descending=True)[:5].tolist():
    print(f"{keys[i]!r:>16}  {last_row[i]:+.4f}  {attention[i]:.3f}")

assert keys[int(last_row.argmin())] == " Italy", "the story in the text above is stale"
assert keys[int(last_row.argmax())] == " France", "the story in the text above is stale"

# %% [markdown]
# ## Interactive view with circuitsvis
#
# `viz.circuitsvis_heads(ra, heads)` returns one self-contained HTML page: the chosen heads'
# RA maps (signed, red = positive, blue = negative, one shared symmetric colour range), then
# the same heads' forward patterns. Hover over a cell to read its value; click a head to
# enlarge it. The circuitsvis JavaScript bundle (about 1 MB) is inlined once, so the view
# renders offline. Pass `save="heads.html"` to write a standalone page.
#
# Gotchas: the view needs a front end that runs JavaScript in outputs (Jupyter Lab/Notebook,
# VS Code); GitHub's static notebook preview shows nothing here. Jupyter only runs output
# scripts of *trusted* notebooks, which a notebook you executed yourself is.

# %%
display(HTML(viz.circuitsvis_heads(ra, ra.top_heads(6))))

# %% [markdown]
# ## Three conventions: $\partial L/\partial A$, $\partial L/\partial S$ and RA
#
# There are three related gradients at an attention layer, and papers and codebases mix them
# up, so ra-lens lets you pick (`convention=`):
#
# | convention | matrix | relation |
# |---|---|---|
# | `"pattern"` | $R = \partial L/\partial A$, gradient at the pattern | not weighted by $A$; rows do **not** sum to zero |
# | `"scores"` | $\partial L/\partial S = A \odot (R - \mathrm{rowsum}(A \odot R))$ | gradient at the scaled scores (`hook_attn_scores`) |
# | `"qk"` (default) | $\mathrm{RA} = \partial L/\partial (QK^\top) = (\partial L/\partial S)/s$ | the paper's RA; $s = \sqrt{d_{head}} = 8$ here |
#
# The cell below computes the other two and checks the relations exactly, from the maps and
# the stored forward patterns.

# %%
results = {"qk": ra}
for convention in ("scores", "pattern"):
    results[convention] = ra_lens.reversed_attention(model, prompt, metric, convention=convention)

scale = torch.tensor(ra.scales)[None, :, None, None, None]
A, R = ra.patterns, results["pattern"].maps
from_pattern = A * (R - (A * R).sum(-1, keepdim=True))

print("max |scores - s * qk|    :", (results["scores"].maps - scale * ra.maps).abs().max().item())
print("max |scores - VJP(A, R)| :", (results["scores"].maps - from_pattern).abs().max().item())
print("max |row sum| of dL/dA   :", R.sum(-1).abs().max().item())
assert torch.allclose(results["scores"].maps, scale * ra.maps, rtol=1e-4, atol=1e-7)
assert torch.allclose(results["scores"].maps, from_pattern, rtol=1e-3, atol=1e-6)

for convention, result in results.items():
    ranked = ", ".join(f"L{la}H{h}" for la, h, _ in result.top_heads(4))
    print(f"top heads by {convention!r:>9}: {ranked}")

# %% [markdown]
# Side by side for the top head (each panel on its own symmetric colour range: the
# conventions differ in scale, so compare shapes, not colours across panels). Things to
# notice:
#
# * `"scores"` and `"qk"` are the same picture up to the factor $s$; with one scale for every
#   layer (true here) they rank heads identically.
# * `"pattern"` is different in kind: it is not multiplied by $A$, so entries where the head
#   barely attends (e.g. far-back tokens) can be large, rows do not sum to zero, and the
#   head ranking by its norm can change (compare the lists printed above).

# %%
labels = [viz.visible_token(t) for t in ra.str_tokens[0]]
fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), layout="constrained")
titles = {
    "pattern": "dL/dA  (convention='pattern')",
    "scores": "dL/dS  (convention='scores')",
    "qk": "RA = dL/d(QK^T)  (convention='qk')",
}
for ax, convention in zip(axes, ("pattern", "scores", "qk")):
    m = results[convention].head(layer, head).numpy()
    m = np.ma.masked_where(np.triu(np.ones_like(m, dtype=bool), k=1), m)
    limit = float(np.abs(m).max())
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
    image = ax.imshow(m, cmap=cmap, vmin=-limit, vmax=limit)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("key")
    ax.set_title(titles[convention], fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
axes[0].set_ylabel("query")
fig.suptitle(f"Three gradients of -log p(' Florence') at L{layer}H{head}")
plt.show()

# %% [markdown]
# ## Where next
#
# * `02_attention_patching.ipynb`: average RA over prompts of an in-context-learning task
#   and add it to the forward attention: zero-shot accuracy rises with no weight change.
# * `03_circuits.ipynb`: RA norms as a head ranking, next to activation patching.
# * `04_edit_dynamics.ipynb`: RA predicts how one gradient step moves the attention.

# %%
print(f"notebook ran in {time.perf_counter() - start:.0f} s")
