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
# # Reversed Attention through nnsight
#
# **What this shows.** ra-lens's functions take an [nnsight](https://nnsight.net) model as they
# take a TransformerLens one: `ra_lens.reversed_attention`, `attention_patch_hooks` (through
# `ra_lens.tasks.evaluate` or `ra_lens.nnsight.run_with_pattern_hooks`) and
# `ra_lens.ranking.ra_ranking`. We wrap the embedded SmolLM2-135M-Instruct, loaded with
# HuggingFace's eager attention, in `nnsight.TransformersModel`, compute RA of the paper's
# Figure-1 prompt, and check that it equals RA through the TransformerLens bridge on the same
# weights, then patch the attention with it through nnsight.
#
# **Runtime.** About 40 s on a 2-core CPU (two model loads, a few forward+backward passes).
# Needs the `nnsight` extra (`pip install "ra-lens[nnsight]"`, transformers >= 5); no GPU, no
# network.

# %%
# %matplotlib inline
import warnings

import nnsight
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ra_lens
from ra_lens import metrics
from ra_lens.models import smollm2_hf_dir
from ra_lens.nnsight import run_with_pattern_hooks
from ra_lens.patching import attention_patch_hooks

warnings.filterwarnings("ignore", message="IProgress not found")

# %% [markdown]
# ## Two routes to the same weights
#
# nnsight reads attention weights only where HuggingFace computes them: load the model with
# `attn_implementation="eager"` (SDPA and flash attention return none, and ra-lens says so).
# The TransformerLens route is `ra_lens.load_model()`, the same checkpoint.

# %%
folder = smollm2_hf_dir()
hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
model = nnsight.TransformersModel(hf.eval(), tokenizer=AutoTokenizer.from_pretrained(folder))
bridge = ra_lens.load_model(device="cpu")

prompt = "I like Italy and France. I visited the city of"
florence = bridge.to_single_token(" Florence")
metric = metrics.target_nll([florence])

# %% [markdown]
# ## RA through nnsight
#
# The same call, the same result type. Strings are tokenised as TransformerLens tokenises them
# (BOS first), so both routes see the same ids.

# %%
ra = ra_lens.reversed_attention(model, prompt, metric)
tl = ra_lens.reversed_attention(bridge, prompt, metric)
print(ra)
assert torch.equal(ra.tokens, tl.tokens)
rel = float((ra.maps - tl.maps).abs().max() / tl.maps.abs().max())
print(f"max |RA_nnsight - RA_TL| / max |RA_TL| = {rel:.1e}")
assert rel < 1e-5
assert torch.allclose(ra.maps.sum(-1), torch.zeros(()), atol=1e-6)  # RA rows sum to zero
print("top heads (nnsight):", ra.top_heads(5))
print("top heads (TL):     ", tl.top_heads(5))

# %%
ra.plot()

# %% [markdown]
# ## Keep only what you need
#
# `keep="norms"` reduces each layer's maps to per-head norms inside the trace (the shape of a
# request one would send to a remote model: layers x heads numbers per prompt).

# %%
norms = ra_lens.reversed_attention(model, prompt, metric, keep="norms")
assert norms.maps is None and torch.allclose(norms.norms, ra.norms, rtol=1e-5)
print(norms.norms.shape, norms.norms.numel(), "numbers")

# %% [markdown]
# ## Attention patching through nnsight
#
# `attention_patch_hooks` builds the paper's patch (A + eta RA after the softmax). On an nnsight
# model the hooks run inside the trace, on the softmax that ra-lens finds inside HuggingFace's
# attention; a step along -RA lowers the loss exactly as on the bridge.

# %%
tokens = ra.tokens
hooks = attention_patch_hooks(ra, -1.0)
patched = metric(run_with_pattern_hooks(model, tokens, hooks))
with bridge.hooks(fwd_hooks=hooks):
    patched_tl = metric(bridge(tokens))
print(
    f"loss {float(ra.metric_values[0]):.4f} -> {float(patched[0]):.4f} (TL: {float(patched_tl[0]):.4f})"
)
assert float(patched[0]) < float(ra.metric_values[0])
assert torch.allclose(patched, patched_tl, rtol=1e-4)
