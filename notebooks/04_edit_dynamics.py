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
# # Edit dynamics: RA predicts how a gradient step moves the attention
#
# **What this shows.** Reversed Attention is not only a saliency map: it is the quantity
# through which gradient descent changes the attention. After one SGD step of size $\eta$
# on one layer's $W_q, W_k$ (with the layer input $X$ fixed), the attention logits
# $Z = QK^\top$ of every head change, to first order, by
#
# $$\Delta Z \approx -\eta\,\left(X X^\top\,\mathrm{RA}\,K K^\top + Q Q^\top\,\mathrm{RA}\,X X^\top\right),$$
#
# a Gram-weighted copy of RA (with rotary embeddings, biases and grouped-query attention the
# formula gains terms that `ra_lens.edit_dynamics` handles). `edit_dynamics` predicts
# $\Delta Z$ from RA and the forward activations, then takes the real step on a deep copy
# of the model and measures it. We
#
# 1. verify the prediction on a tiny offline float64 Llama-style model (rotary, GQA) over a
#    range of step sizes: the error shrinks linearly with $\eta$, as a first-order
#    prediction should;
# 2. compare predicted and actual changes on the real SmolLM2 model for one layer, as a
#    plot, for the logits and for the attention pattern.
#
# **Runtime.** 1 min 30 s (89 s), measured by executing the whole notebook once (`tests/notebooks/test_notebooks.py`, kernel start
# included) on a 2-core CPU VM shared with other jobs (load average about 7, so expect
# less on an idle machine).

# %%
# %matplotlib inline
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch

import ra_lens
from ra_lens import metrics
from ra_lens.toy_models import tiny_model

# tqdm warns once when ipywidgets is missing; progress bars still work as plain text
warnings.filterwarnings("ignore", message="IProgress not found")

start = time.perf_counter()

# %% [markdown]
# ## 1. An exact check on a tiny float64 model
#
# `tiny_model("llama", dtype=torch.float64)` is a 2-layer, 4-head Llama (2 key/value heads,
# rotary embeddings) with random weights, built offline. Float64 keeps rounding out of the
# way, so what we measure is the approximation itself. Two right-padded prompts, each with
# its own target token (random weights: the tokens are arbitrary).
#
# `EditDynamics` has
#
# * `predicted`, `actual`: $\Delta Z$ per `[prompt, layer, head, query, key]`;
# * `second_order`: the neglected term $\Delta Q\,\Delta K^\top$, so that
#   predicted + second order = actual *exactly* ($Z$ is bilinear in $W_q, W_k$);
# * `cosine`, `relative_error`: per head, over prompts and positions;
# * `grad_error`: how far the $W_q, W_k$ gradient rebuilt from RA is from autograd's.

# %%
toy = tiny_model("llama", dtype=torch.float64)
toy_prompts = ["I like Italy and France. I visited", "The quick brown fox jumps"]
toy_metric = metrics.target_nll([5, 7])

LRS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
runs = {lr: ra_lens.edit_dynamics(toy, toy_prompts, toy_metric, lr) for lr in LRS}

print("      lr   min cosine   mean rel. error   |pred + 2nd - actual| / |actual|")
for lr, dyn in runs.items():
    exact = ((dyn.predicted + dyn.second_order - dyn.actual).norm() / dyn.actual.norm()).item()
    print(
        f"{lr:>8g}   {dyn.cosine.min().item():.8f}   {dyn.relative_error.mean().item():.3e}"
        f"         {exact:.1e}"
    )
print(
    "gradient from RA vs autograd, max relative difference:",
    f"{max(d.grad_error.max().item() for d in runs.values()):.1e}",
)

# %% [markdown]
# What to look for: the relative error grows in proportion to $\eta$ (one decade per
# decade, parallel to the slope-1 reference line below), and $1 - \cos$ falls even faster,
# as $\eta^2$ (two decades per decade): for small steps the direction of the change is
# predicted essentially exactly. The last column stays tiny (about $10^{-8}$) whatever the step size:
# the only thing the first-order prediction leaves out is $\Delta Q\,\Delta K^\top$.
# Why $10^{-8}$ and not float64 rounding? ra-lens stores maps in float32, so the prediction
# and the gradient rebuilt from RA (last line, about $10^{-7}$ from autograd's) carry float32
# precision even on a float64 model.

# %%
errors = np.array([runs[lr].relative_error.mean().item() for lr in LRS])
one_minus_cos = np.array([1 - runs[lr].cosine.min().item() for lr in LRS])

fig, (ax_err, ax_cos) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
ax_err.loglog(LRS, errors, "o-", label="mean relative error of the prediction")
reference = 3 * errors[0] * np.array(LRS) / LRS[0]  # shifted up so both lines show
ax_err.loglog(LRS, reference, "--", color="0.5", label="slope 1 reference (O(lr))")
ax_err.set_xlabel("SGD step size lr")
ax_err.set_ylabel("||predicted - actual|| / ||actual||")
ax_err.set_title("First-order error is O(lr)")
ax_err.legend()
ax_err.grid(True, which="both", alpha=0.3)
ax_cos.loglog(LRS, np.maximum(one_minus_cos, 1e-16), "o-", color="C1")
ax_cos.set_xlabel("SGD step size lr")
ax_cos.set_ylabel("1 - cosine(predicted, actual), worst head")
ax_cos.set_title("Direction of the change")
ax_cos.grid(True, which="both", alpha=0.3)
fig.suptitle("Tiny float64 Llama (rotary, GQA), all layers, each stepped alone")
plt.show()

small = runs[1e-3]
assert small.cosine.min() > 0.999
assert small.relative_error.max() < 1e-2
assert errors[-1] > 10 * errors[0], "the error should grow with the step"

# %% [markdown]
# ## 2. The real model: one layer of SmolLM2
#
# Now the Florence prompt from notebook 01 on SmolLM2-135M-Instruct, stepping layer 23 (the
# layer of the head with the largest RA there). The model is float32, so at a small step the
# relative error (about $10^{-4}$ to $10^{-3}$ per head) is mostly float32 rounding of a
# small difference, not the approximation. With `lr=1e-3` the largest logit change is already of order 0.1-1,
# far from negligible.
#
# `edit_dynamics` never modifies `model`: it deep-copies it (about 0.5 GB for this model).

# %%
model = ra_lens.load_model(device="cpu")
prompt = "I like Italy and France. I visited the city of"
florence = model.to_single_token(" Florence")
metric = metrics.target_nll([florence])
LAYER = 23

dyn = ra_lens.edit_dynamics(model, prompt, metric, lr=1e-3, layers=[LAYER])
print(dyn)
print(f"largest |actual change| of a logit: {dyn.actual.abs().max():.3f}")
print("head   cosine     rel. error   pattern cosine")
for head in range(model.cfg.n_heads):
    print(
        f"L{LAYER}H{head}  {dyn.cosine[0, head]:.6f}   {dyn.relative_error[0, head]:.1e}"
        f"      {dyn.pattern_cosine[0, head]:.6f}"
    )

assert (dyn.cosine > 0.99).all(), dyn.cosine
assert (dyn.pattern_cosine > 0.99).all(), dyn.pattern_cosine

# %% [markdown]
# ### Predicted against actual, as a plot
#
# Each point is one (query, key) entry of one head in the causal triangle, coloured by head.
# Left: the logit change $\Delta Z$. Right: the pattern change $\Delta A$, where the
# prediction is the softmax Jacobian applied to $\Delta Z/s$. On the diagonal means the RA
# prediction is right.
#
# Then the same with a step 100 times larger (`lr=0.1`). What to look for: the logit
# prediction barely moves off the diagonal (the neglected term is quadratic in the step),
# but the *pattern* prediction bends: the softmax saturates, so a linearisation of
# $A$ in $Z$ overshoots for big logit changes. RA predicts the direction of the edit in
# logit space; how far the pattern actually moves is a nonlinear function of it.

# %%
big = ra_lens.edit_dynamics(model, prompt, metric, lr=0.1, layers=[LAYER])


def scatter(ax, predicted, actual, title):
    n = predicted.shape[-1]
    tri = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for head in range(predicted.shape[2]):
        ax.scatter(
            actual[0, 0, head][tri], predicted[0, 0, head][tri], s=9, alpha=0.7, label=f"H{head}"
        )
    lo = float(min(predicted.min(), actual.min()))
    hi = float(max(predicted.max(), actual.max()))
    ax.plot([lo, hi], [lo, hi], color="0.3", linewidth=0.8, linestyle="--")
    ax.set_xlabel("actual change")
    ax.set_ylabel("predicted from RA")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)


fig, axes = plt.subplots(2, 2, figsize=(11, 9.5), layout="constrained")
for row, (lr, run) in enumerate([(1e-3, dyn), (0.1, big)]):
    cos_z, cos_a = run.cosine.min().item(), run.pattern_cosine.min().item()
    scatter(
        axes[row, 0],
        run.predicted,
        run.actual,
        f"logits dZ, lr={lr:g} (worst-head cosine {cos_z:.4f})",
    )
    scatter(
        axes[row, 1],
        run.predicted_pattern,
        run.actual_pattern,
        f"pattern dA, lr={lr:g} (worst-head cosine {cos_a:.4f})",
    )
axes[0, 1].legend(fontsize=8, ncol=3, title=f"layer {LAYER} head")
fig.suptitle(f"One SGD step on W_q, W_k of layer {LAYER}: predicted vs actual attention change")
plt.show()
print(
    f"lr=0.1: logit cosine >= {big.cosine.min():.4f}, "
    f"pattern cosine >= {big.pattern_cosine.min():.4f}"
)

# %% [markdown]
# ### The change is not RA itself
#
# The prediction is a *Gram-weighted* copy of RA, not $-\eta\,\mathrm{RA}$. How similar
# are the two? The cosine between each head's actual $\Delta Z$ and $-\mathrm{RA}$ tells you
# how much the Gram matrices $XX^\top$, $KK^\top$, $QQ^\top$ reshape the edit. Only the
# *total* is guaranteed to go downhill: to first order the loss changes by
# $\sum_h \langle \mathrm{RA}_h, \Delta Z_h\rangle = -\eta\,\lVert\nabla_{W_q,W_k}L\rVert^2 < 0$
# (asserted below). Per head, expect small positive cosines and possibly a negative one: a
# step on shared weights also moves logits that RA leaves at zero (every query row, not
# only the loss position) and can move one head against its own RA while the layer as a
# whole improves. So RA tells you which way each logit is *pushed*; the edit a weight update
# actually makes is RA filtered through the geometry of the activations.

# %%
ra = ra_lens.reversed_attention(model, prompt, metric, layers=[LAYER])
minus_ra = -ra.maps[:, 0].double()
change = dyn.actual[:, 0].double()
cos = torch.nn.functional.cosine_similarity(change.flatten(2), minus_ra.flatten(2), dim=-1)[0]
print("cosine(actual dZ, -RA) per head:", [round(c, 3) for c in cos.tolist()])

first_order_loss_change = (ra.maps[:, 0].double() * dyn.predicted[:, 0].double()).sum()
print(f"predicted first-order change of the loss: {first_order_loss_change:.3e}")
assert first_order_loss_change < 0

# %%
print(f"notebook ran in {time.perf_counter() - start:.0f} s")
