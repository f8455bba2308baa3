# ruff: noqa: E501  (cell sources hold markdown tables and LaTeX)
"""Write the tutorial notebooks (01-04) from the cell sources below, with no outputs.

The .ipynb files are generated: edit this script, then run

    .venv/bin/python notebooks/build_notebooks.py

and commit both. Outputs are never committed (every code cell has execution_count null and no
outputs); `make notebooks` executes them (tests/test_notebooks.py). Cell ids are fixed so that a
rebuild without changes gives byte-identical files.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str) -> nbformat.NotebookNode:
    return new_code_cell(textwrap.dedent(text).strip("\n"))


def notebook(stem: str, cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells, metadata=METADATA)
    for i, cell in enumerate(nb.cells):
        cell.id = f"{stem[:2]}-{i:02d}"
    return nb


# ------------------------------------------------------------------------------------------------
# 01 quickstart

QUICKSTART = [
    md(
        """
        # ra-lens quickstart: Reversed Attention maps for one prompt

        **What this shows.** Reversed Attention (RA, Katz & Wolf, NAACL 2025) is the gradient of a
        loss with respect to the attention logits, $\\mathrm{RA} = \\partial L / \\partial (QK^\\top)$:
        an attention-shaped map, one per head, that the backward pass builds anyway. We compute it
        for the paper's Figure-1 prompt *"I like Italy and France. I visited the city of"* with
        target *" Florence"* on the default model (SmolLM2-135M-Instruct, 30 layers x 9 heads), then

        1. check the properties that make RA an attention-like object (rows sum to zero, causal);
        2. draw a layer x head heat map of RA norms next to forward-attention norms;
        3. look at the top heads, first as static matplotlib figures, then interactively with
           circuitsvis (works offline: the JavaScript is inlined);
        4. compare the three gradient conventions ra-lens offers (`"pattern"`, `"scores"`, `"qk"`).

        **Runtime.** About 20 s on a laptop CPU (model load ~5 s, four forward+backward passes);
        no GPU and no network needed: the model ships with the package.
        """
    ),
    code(
        """
        %matplotlib inline
        import time
        import warnings

        # tqdm warns once when ipywidgets is missing; progress bars still work as plain text
        warnings.filterwarnings("ignore", message="IProgress not found")

        import matplotlib.pyplot as plt
        import numpy as np
        import torch
        from IPython.display import HTML, display

        import ra_lens
        from ra_lens import metrics, viz

        start = time.perf_counter()
        torch.set_printoptions(precision=4, sci_mode=False, linewidth=120)
        """
    ),
    md(
        """
        ## Load the model

        `ra_lens.load_model()` returns a TransformerLens `TransformerBridge` around the embedded
        SmolLM2-135M-Instruct (converted once into a local cache, then loaded in seconds). We pin it
        to the CPU so the notebook behaves the same everywhere. Note the grouped-query attention:
        9 query heads share 3 key/value heads, but the attention pattern, and therefore RA, is
        per *query* head.
        """
    ),
    code(
        """
        model = ra_lens.load_model(device="cpu")
        cfg = model.cfg
        print(
            f"{cfg.n_layers} layers x {cfg.n_heads} heads "
            f"({cfg.n_key_value_heads} key/value heads), d_head = {cfg.d_head}"
        )
        """
    ),
    md(
        """
        ## The prompt and what the model predicts

        RA explains a *metric*, so first look at the prediction we are going to explain. The loss is
        $L = -\\log p(\\text{" Florence"})$ at the last position (`metrics.target_nll`). It is worth
        knowing whether the target is already the model's top guess: here it need not be, and RA
        then tells us how attention would have to move to make it more likely.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Reversed Attention of every head, in one backward pass

        `reversed_attention(model, tokens, metric)` runs one forward and one backward pass with
        hooks on every `hook_pattern` and returns a `ReversedAttention` with
        `maps[batch, layer, head, query, key]` (on the CPU, float32), the forward `patterns` of
        the same shape, and per-head Frobenius norms. The default convention is the paper's,
        $\\partial L/\\partial(QK^\\top)$ (`convention="qk"`).
        """
    ),
    code(
        """
        metric = metrics.target_nll([florence])
        ra = ra_lens.reversed_attention(model, prompt, metric)
        print(ra)
        print("maps:", tuple(ra.maps.shape), " attention scale per layer:", ra.scales[0])
        """
    ),
    md(
        """
        ### Sanity checks: what makes RA attention-shaped

        Because RA is the softmax's vector-Jacobian product, $\\mathrm{RA}_{ij} = A_{ij}(R_{ij} -
        \\sum_k A_{ik}R_{ik})/s$ with $R = \\partial L/\\partial A$, it inherits the forward
        pattern's structure:

        * it is zero above the diagonal (where $A$ is zero) and in row 0 (where $A_{00}=1$);
        * **every row sums to zero**, so adding $\\eta\\cdot\\mathrm{RA}$ to a pattern keeps rows
          summing to one (this is what makes attention patching in notebook 02 possible);
        * in the last layer only the row of the loss position is non-zero: no other query there
          can influence the logits at that position.

        The cell below asserts all four on the real maps; if one fails, something upstream broke.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Which heads does the gradient flow through? Head-norm heat map

        The Frobenius norm of each head's RA is the paper's head-importance score: one
        forward+backward pass scores all 270 heads at once (notebook 03 compares it with causal
        methods). Next to it, the norm of the forward pattern, which is dominated by how many
        tokens a head spreads its attention over, not by relevance to the target.

        What to look for: the RA panel is sparse, with one or a few bright heads and most of the
        270 near zero, while forward norms vary within a narrow band (less than a factor of two)
        and say nothing about this particular target. Bright cells in late layers are heads that
        read the answer-relevant tokens directly. Early layers (0-2) often show up in the top ten
        as well: everything downstream depends on them, so gradients through them are sizeable
        without being specific to the target. Treat them with suspicion.
        """
    ),
    code(
        """
        viz.head_norm_heatmaps(ra)
        """
    ),
    code(
        """
        forward = ra.forward_norms()
        print("rank  head     |RA|    |A|")
        for rank, (layer, head, norm) in enumerate(ra.top_heads(8), 1):
            print(f"{rank:>4}  L{layer:<2}H{head}  {norm:.4f}  {forward[layer, head]:.3f}")
        """
    ),
    md(
        """
        ## The top head: forward attention beside its Reversed Attention (the paper's Figure 1)

        `viz.head_pair` draws one head's forward pattern (left, on [0, 1]) beside its RA (right,
        diverging colours with a symmetric range; the masked upper triangle is grey).

        **Reading the signs.** RA is the gradient of the *loss*, and gradient descent moves along
        $-\\mathrm{RA}$. So with `target_nll`, a **negative (blue)** entry marks a query/key pair
        whose attention logit should *grow* to make " Florence" more likely, and a **positive
        (red)** entry one that should shrink. (Use `metrics.target_prob` or `logit_diff` if you
        prefer "positive = helps"; the map just flips sign.)

        At the time of writing, the top head is L23H4 and its last row (query " of") is the
        interesting one: strongly negative at " Italy" and positive at " France", while the rest of
        the map is close to zero. That reads naturally: Florence is in Italy, so the gradient asks
        this head to move attention from " France" to " Italy". The forward pattern alone could
        not tell you this: the head already attends to both countries. The next cell prints the row
        and asserts that the story still holds, so this text cannot silently go stale.
        """
    ),
    code(
        """
        layer, head, _ = ra.top_heads(1)[0]
        viz.head_pair(ra, layer, head)
        """
    ),
    code(
        """
        last_row = ra.head(layer, head)[-1]
        attention = ra.patterns[0, ra.layers.index(layer), head, -1]
        keys = ra.str_tokens[0]
        print(f"L{layer}H{head}, query {keys[-1]!r}, the 5 largest |RA| entries of its row:")
        print(f"{'key':>16}  {'RA':>8}  attention")
        for i in last_row.abs().argsort(descending=True)[:5].tolist():
            print(f"{keys[i]!r:>16}  {last_row[i]:+.4f}  {attention[i]:.3f}")

        assert keys[int(last_row.argmin())] == " Italy", "the story in the text above is stale"
        assert keys[int(last_row.argmax())] == " France", "the story in the text above is stale"
        """
    ),
    md(
        """
        ## Interactive view with circuitsvis

        `viz.circuitsvis_heads(ra, heads)` returns one self-contained HTML page: the chosen heads'
        RA maps (signed, red = positive, blue = negative, one shared symmetric colour range), then
        the same heads' forward patterns. Hover over a cell to read its value; click a head to
        enlarge it. The circuitsvis JavaScript bundle (about 1 MB) is inlined once, so the view
        renders offline. Pass `save="heads.html"` to write a standalone page.

        Gotchas: the view needs a front end that runs JavaScript in outputs (Jupyter Lab/Notebook,
        VS Code); GitHub's static notebook preview shows nothing here. Jupyter only runs output
        scripts of *trusted* notebooks, which a notebook you executed yourself is.
        """
    ),
    code(
        """
        display(HTML(viz.circuitsvis_heads(ra, ra.top_heads(6))))
        """
    ),
    md(
        """
        ## Three conventions: $\\partial L/\\partial A$, $\\partial L/\\partial S$ and RA

        There are three related gradients at an attention layer, and papers and codebases mix them
        up, so ra-lens lets you pick (`convention=`):

        | convention | matrix | relation |
        |---|---|---|
        | `"pattern"` | $R = \\partial L/\\partial A$, gradient at the pattern | not weighted by $A$; rows do **not** sum to zero |
        | `"scores"` | $\\partial L/\\partial S = A \\odot (R - \\mathrm{rowsum}(A \\odot R))$ | gradient at the scaled scores (`hook_attn_scores`) |
        | `"qk"` (default) | $\\mathrm{RA} = \\partial L/\\partial (QK^\\top) = (\\partial L/\\partial S)/s$ | the paper's RA; $s = \\sqrt{d_{head}} = 8$ here |

        The cell below computes the other two and checks the relations exactly, from the maps and
        the stored forward patterns.
        """
    ),
    code(
        """
        results = {"qk": ra}
        for convention in ("scores", "pattern"):
            results[convention] = ra_lens.reversed_attention(
                model, prompt, metric, convention=convention
            )

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
        """
    ),
    md(
        """
        Side by side for the top head (each panel on its own symmetric colour range: the
        conventions differ in scale, so compare shapes, not colours across panels). Things to
        notice:

        * `"scores"` and `"qk"` are the same picture up to the factor $s$; with one scale for every
          layer (true here) they rank heads identically.
        * `"pattern"` is different in kind: it is not multiplied by $A$, so entries where the head
          barely attends (e.g. far-back tokens) can be large, rows do not sum to zero, and the
          head ranking by its norm can change (compare the lists printed above).
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Where next

        * `02_attention_patching.ipynb`: average RA over prompts of an in-context-learning task
          and add it to the forward attention: zero-shot accuracy rises with no weight change.
        * `03_circuits.ipynb`: RA norms as a head ranking, next to activation patching.
        * `04_edit_dynamics.ipynb`: RA predicts how one gradient step moves the attention.
        """
    ),
    code(
        """
        print(f"notebook ran in {time.perf_counter() - start:.0f} s")
        """
    ),
]


# ------------------------------------------------------------------------------------------------
# 02 attention patching

PATCHING = [
    md(
        """
        # Attention patching: steering a model with Reversed Attention

        **What this shows.** The paper's in-context-learning experiment on the antonym task.
        Average the Reversed Attention (RA) of $-\\log p(\\text{answer})$ over a few training
        prompts, then *add* it to the forward attention of held-out prompts,
        $A' = A + \\eta\\cdot\\overline{\\mathrm{RA}}$, in every head of every layer, with no weight
        change and no renormalisation. We

        1. run the experiment zero-shot ("Q: hot\\nA:" with no demonstrations) over a sweep of
           scales $\\eta$, next to the paper's baseline (adding the mean *forward* pattern instead);
        2. plot accuracy against $\\eta$;
        3. look at what the patched model actually answers;
        4. combine the patch with other TransformerLens hooks: a recording hook, a restriction to
           some heads, and head ablation.

        **Runtime.** About 1 minute on a laptop CPU. To keep it short we use 12 training prompts
        (the paper uses 25) and 7 scales (the paper sweeps 24; `PAPER_SCALES` and
        `DEFAULT_SCALES` in `ra_lens.experiments` have the full grids).
        """
    ),
    code(
        """
        %matplotlib inline
        import time
        import warnings

        # tqdm warns once when ipywidgets is missing; progress bars still work as plain text
        warnings.filterwarnings("ignore", message="IProgress not found")

        import torch

        import ra_lens
        from ra_lens import tasks
        from ra_lens.experiments import attention_patching
        from ra_lens.experiments.patching import evaluate_by_length, task_prompts

        start = time.perf_counter()
        model = ra_lens.load_model(device="cpu")
        """
    ),
    md(
        """
        ## The task and its prompts

        ICL word-pair tasks in the style of Todd et al.'s function vectors, with the paper's
        template `Q: {x}\\nA: {y}\\n\\n ... Q: {query}\\nA:` and target `" {answer}"`. Two filters
        matter (both done by `task_prompts`, as in the paper's code):

        * only pairs whose answer is a single token for this tokenizer are kept (accuracy is
          measured on the first answer token, top-1/2/3 among the whole vocabulary);
        * training prompts are restricted to the most common token length, because RA maps are
          averaged position by position. Test prompts of other lengths are patched right-aligned
          (the last positions, where the answer is predicted, line up).

        Split: 70% train / 21% test / 9% validation, seed 42.
        """
    ),
    code(
        """
        task = tasks.load("antonym")
        train, test = task_prompts(model, task, shots=0)
        print(f"{len(task.pairs)} antonym pairs; {len(train)} equal-length training prompts, "
              f"{len(test)} single-token test prompts")
        print("example prompt:", repr(test[0].text), "  answer:", repr(test[0].answer))
        """
    ),
    md(
        """
        ## The scale sweep

        `attention_patching` does the whole experiment: RA of each training prompt's own loss
        (batched, one backward pass per batch), the mean map, then top-k accuracy on the test
        prompts at each scale for both RA patching and the forward baseline.

        **Sign convention.** RA is the gradient of the loss, so **negative $\\eta$ is the
        gradient-descent direction** (towards the answer); positive $\\eta$ should hurt. The best
        magnitude is much larger than a learning rate because RA entries are small (the cell
        prints the largest entry of the mean map) and attention entries live in [0, 1].
        """
    ),
    code(
        """
        SCALES = (2, 0, -4, -8, -16, -32, -64)
        result = attention_patching(
            model, "antonym", shots=0, n_train=12, scales=SCALES, progress=False
        )
        print(result.table())
        print({name: round(seconds, 1) for name, seconds in result.seconds.items()}, "seconds")
        print(f"largest |entry| of the mean RA map: {result.ra_maps.mean_maps().abs().max():.3f}")
        """
    ),
    md(
        """
        What to look for in the table and the plot below:

        * **Unpatched zero-shot accuracy is low.** Without demonstrations the model does not know
          the task is "antonym"; it usually continues with something else.
        * **RA patching at negative scales lifts accuracy far above it**, with a plateau over a
          range of scales and a decline again when $|\\eta|$ gets so large that the patch swamps
          the original attention. The best scale depends on the task (and the model): sweep it.
        * **$\\eta = 0$ reproduces the unpatched model** and positive scales do not help.
        * **The forward baseline does not help**: adding $\\eta$ times the mean forward pattern
          only rescales each row (rows then sum to $1+\\eta$). The information is in the
          gradient's *direction*, not in "more attention".

        The assertion checks the central claim on the real numbers.
        """
    ),
    code(
        """
        best_scale, best_top3 = result.best(3, "ra")
        forward_scale, forward_top3 = result.best(3, "forward")
        print(f"best RA scale {best_scale:g}: top-3 {best_top3:.0%}; "
              f"best forward scale {forward_scale:g}: top-3 {forward_top3:.0%}; "
              f"unpatched top-3 {result.unpatched.top3:.0%}")

        assert best_scale < 0, "RA should help in the gradient-descent direction"
        assert best_top3 >= result.unpatched.top3 + 0.3, "RA patching should beat the unpatched model"
        assert best_top3 > forward_top3, "RA patching should beat the forward baseline"
        """
    ),
    code(
        """
        result.plot()
        """
    ),
    md(
        """
        ## What does the patched model say?

        Accuracy numbers hide *how* the model is wrong. Here are the top-3 next tokens for a few
        test prompts, unpatched and with the RA patch at the best scale. The hooks come from
        `ra_lens.attention_patch_hooks(ra, scale)`: a plain list of `(hook_name, hook_fn)` pairs
        for `model.hooks(...)` or `model.run_with_hooks(...)`. Passing the `ReversedAttention`
        itself uses its mean maps at its own layers.

        Things to look for: unpatched, the model's top guesses are usually generic continuations
        (a space, a newline, "The"); patched, they become words related to the query. A typical
        failure is echoing the query word itself (or a morphological variant) above the antonym,
        which top-3 accuracy forgives and top-1 does not.
        """
    ),
    code(
        """
        ra = result.ra_maps  # the ReversedAttention of the training prompts (maps kept)
        patch = ra_lens.attention_patch_hooks(ra, best_scale, model=model)


        def top3_tokens(prompt, hooks=()):
            logits = model.run_with_hooks(model.to_tokens(prompt.text), fwd_hooks=list(hooks))
            return [model.to_string([t]) for t in logits[0, -1].topk(3).indices.tolist()]


        with torch.no_grad():
            for prompt in test[:6]:
                before, after = top3_tokens(prompt), top3_tokens(prompt, patch)
                print(f"{prompt.query!r:>14} -> {prompt.answer!r:<12} "
                      f"unpatched {before}   patched {after}")
        """
    ),
    md(
        """
        ## Combining the patch with other TransformerLens hooks

        Because the patch is just a list of hooks, it composes with anything else you hook.

        ### 1. A recording hook on the same point

        Hooks on one hook point run in the order they were added, so a hook appended after the
        patch sees the patched pattern. We use that to check the property the method relies on:
        with RA the rows still sum to one (RA rows sum to zero), while the forward baseline makes
        them sum to $1+\\eta$. Individual entries of the patched pattern *can* go negative: it is
        no longer a probability distribution, just a row-normalised mixing matrix.
        """
    ),
    code(
        """
        LAYER = 15
        hook_name = f"blocks.{LAYER}.attn.hook_pattern"
        seen = {}


        def record(pattern, hook):
            seen[hook.name] = pattern.detach().clone()


        baseline = ra_lens.forward_patch_hooks(ra, best_scale, model=model)
        tokens = model.to_tokens(test[0].text)
        row_sums = {}
        for label, hooks in {"RA patch": patch, "forward patch": baseline}.items():
            with torch.no_grad(), model.hooks(fwd_hooks=hooks + [(hook_name, record)]):
                model(tokens)
            pattern = seen[hook_name]
            row_sums[label] = pattern.sum(-1)
            print(f"{label:>13}, layer {LAYER}: row sums in [{row_sums[label].min():.4f}, "
                  f"{row_sums[label].max():.4f}], smallest entry {pattern.min():+.3f}")

        assert torch.allclose(row_sums["RA patch"], torch.ones(()), atol=1e-4)
        assert torch.allclose(row_sums["forward patch"], torch.tensor(1.0 + best_scale), atol=1e-3)
        """
    ),
    md(
        """
        ### 2. Patching only some heads

        `heads=` restricts the patch to a list of `(layer, head)` pairs (or a boolean
        `[layer, head]` mask). Do a few heads carry the effect? We patch only the k heads with the
        largest mean RA norm over the training prompts, the k heads with the smallest, and, as a
        control, k random heads (three draws, since one draw is noisy).

        What to look for: the bottom heads should do next to nothing, since their maps are nearly
        zero. The interesting comparison is top-k against random-k: when k is small the top heads
        should carry clearly more of the effect; as k grows random draws catch up, because the
        patch's effect is spread over many heads rather than concentrated in a few. RA norms rank
        heads for free; notebook 03 compares that ranking with causal methods.
        """
    ),
    code(
        """
        n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
        norms = ra.head_norms().flatten()  # mean RA norm of each head over the training prompts
        by_norm = [divmod(int(i), n_heads) for i in norms.argsort(descending=True)]


        def random_heads(k, seed):
            generator = torch.Generator().manual_seed(seed)
            chosen = torch.randperm(norms.numel(), generator=generator)[:k]
            return [divmod(int(i), n_heads) for i in chosen]


        def patched_top3(heads):
            hooks = ra_lens.attention_patch_hooks(ra, best_scale, heads=heads)
            return evaluate_by_length(model, test, hooks).top3


        print(f"patching all {n_layers * n_heads} heads: top-3 {best_top3:.0%}")
        subset_top3 = {}
        for k in (20, 40):
            subset_top3[k] = {
                "top": patched_top3(by_norm[:k]),
                "bottom": patched_top3(by_norm[-k:]),
                "random": [patched_top3(random_heads(k, seed)) for seed in range(3)],
            }
            r = subset_top3[k]
            print(f"only {k} heads: top-RA {r['top']:.0%}, bottom-RA {r['bottom']:.0%}, "
                  f"random {', '.join(f'{a:.0%}' for a in r['random'])}")
        """
    ),
    md(
        """
        ### 3. Patching plus head ablation

        `ra_lens.head_ablation_hooks(heads)` zeroes chosen heads' outputs at `hook_z`. Adding those
        hooks to the patch asks the reverse question: if the model is patched everywhere but the
        top-RA heads are silenced, does the gain survive? Compare with silencing as many random
        heads (three draws). Because the unpatched model is already near zero on this task, this
        isolates how much of the *patch's* effect goes through those heads. Look for a much larger
        drop when the top heads are silenced than for any random draw.
        """
    ),
    code(
        """
        def ablated_top3(heads):
            return evaluate_by_length(model, test, patch + ra_lens.head_ablation_hooks(heads)).top3


        silenced_top = ablated_top3(by_norm[:20])
        silenced_random = [ablated_top3(random_heads(20, seed)) for seed in range(3)]
        print(f"RA patch, nothing silenced:      top-3 {best_top3:.0%}")
        print(f"RA patch, top-20 RA heads zeroed: top-3 {silenced_top:.0%}")
        print(f"RA patch, 20 random heads zeroed: top-3 "
              f"{', '.join(f'{a:.0%}' for a in silenced_random)}")
        """
    ),
    md(
        """
        ## Gotchas

        * **Scale sign and size.** Negative = gradient descent. A positive scale or a tiny one
          does nothing useful; sweep, and expect a different optimum per task and per shot count.
        * **Equal lengths.** Maps are averaged position by position, so training prompts must
          share a token length (`tasks.same_length`); `attention_patch_hooks(..., align="strict")`
          refuses prompts of another length instead of right-aligning them.
        * **Per-prompt loss.** RA must be the gradient of each prompt's own loss (the sum, not the
          batch mean), or every map shrinks by the batch size and moves the best scale with it;
          `reversed_attention` does this for you.
        * **Adapters.** Patching edits `hook_pattern`, which must be in the forward computation.
          On TransformerLens adapters that delegate attention to HuggingFace (OPT, for one) it is
          not; pass `model=` to the hook builders and they raise instead of silently doing nothing.
        """
    ),
    code(
        """
        print(f"notebook ran in {time.perf_counter() - start:.0f} s")
        """
    ),
]


# ------------------------------------------------------------------------------------------------
# 04 edit dynamics

DYNAMICS = [
    md(
        """
        # Edit dynamics: RA predicts how a gradient step moves the attention

        **What this shows.** Reversed Attention is not only a saliency map: it is the quantity
        through which gradient descent changes the attention. After one SGD step of size $\\eta$
        on one layer's $W_q, W_k$ (with the layer input $X$ fixed), the attention logits
        $Z = QK^\\top$ of every head change, to first order, by

        $$\\Delta Z \\approx -\\eta\\,\\left(X X^\\top\\,\\mathrm{RA}\\,K K^\\top + Q Q^\\top\\,\\mathrm{RA}\\,X X^\\top\\right),$$

        a Gram-weighted copy of RA (with rotary embeddings, biases and grouped-query attention the
        formula gains terms that `ra_lens.edit_dynamics` handles). `edit_dynamics` predicts
        $\\Delta Z$ from RA and the forward activations, then takes the real step on a deep copy
        of the model and measures it. We

        1. verify the prediction on a tiny offline float64 Llama-style model (rotary, GQA) over a
           range of step sizes: the error shrinks linearly with $\\eta$, as a first-order
           prediction should;
        2. compare predicted and actual changes on the real SmolLM2 model for one layer, as a
           plot, for the logits and for the attention pattern.

        **Runtime.** About 20 s on a laptop CPU.
        """
    ),
    code(
        """
        %matplotlib inline
        import time
        import warnings

        # tqdm warns once when ipywidgets is missing; progress bars still work as plain text
        warnings.filterwarnings("ignore", message="IProgress not found")

        import matplotlib.pyplot as plt
        import numpy as np
        import torch

        import ra_lens
        from ra_lens import metrics
        from ra_lens.toy_models import tiny_model

        start = time.perf_counter()
        """
    ),
    md(
        """
        ## 1. An exact check on a tiny float64 model

        `tiny_model("llama", dtype=torch.float64)` is a 2-layer, 4-head Llama (2 key/value heads,
        rotary embeddings) with random weights, built offline. Float64 keeps rounding out of the
        way, so what we measure is the approximation itself. Two right-padded prompts, each with
        its own target token (random weights: the tokens are arbitrary).

        `EditDynamics` has

        * `predicted`, `actual`: $\\Delta Z$ per `[prompt, layer, head, query, key]`;
        * `second_order`: the neglected term $\\Delta Q\\,\\Delta K^\\top$, so that
          predicted + second order = actual *exactly* ($Z$ is bilinear in $W_q, W_k$);
        * `cosine`, `relative_error`: per head, over prompts and positions;
        * `grad_error`: how far the $W_q, W_k$ gradient rebuilt from RA is from autograd's.
        """
    ),
    code(
        """
        toy = tiny_model("llama", dtype=torch.float64)
        toy_prompts = ["I like Italy and France. I visited", "The quick brown fox jumps"]
        toy_metric = metrics.target_nll([5, 7])

        LRS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
        runs = {lr: ra_lens.edit_dynamics(toy, toy_prompts, toy_metric, lr) for lr in LRS}

        print("      lr   min cosine   mean rel. error   |pred + 2nd - actual| / |actual|")
        for lr, dyn in runs.items():
            exact = ((dyn.predicted + dyn.second_order - dyn.actual).norm() / dyn.actual.norm()).item()
            print(f"{lr:>8g}   {dyn.cosine.min().item():.8f}   {dyn.relative_error.mean().item():.3e}"
                  f"         {exact:.1e}")
        print("gradient from RA vs autograd, max relative difference:",
              f"{max(d.grad_error.max().item() for d in runs.values()):.1e}")
        """
    ),
    md(
        """
        What to look for: the relative error grows in proportion to $\\eta$ (one decade per
        decade, parallel to the slope-1 reference line below), and $1 - \\cos$ falls even faster,
        as $\\eta^2$ (two decades per decade): for small steps the direction of the change is
        predicted essentially exactly. The last column stays tiny (about $10^{-8}$) whatever the step size:
        the only thing the first-order prediction leaves out is $\\Delta Q\\,\\Delta K^\\top$.
        Why $10^{-8}$ and not float64 rounding? ra-lens stores maps in float32, so the prediction
        and the gradient rebuilt from RA (last line, about $10^{-7}$ from autograd's) carry float32
        precision even on a float64 model.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## 2. The real model: one layer of SmolLM2

        Now the Florence prompt from notebook 01 on SmolLM2-135M-Instruct, stepping layer 23 (the
        layer of the head with the largest RA there). The model is float32, so at a small step the
        relative error (about $10^{-4}$ to $10^{-3}$ per head) is mostly float32 rounding of a
        small difference, not the approximation. With `lr=1e-3` the largest logit change is already of order 0.1-1,
        far from negligible.

        `edit_dynamics` never modifies `model`: it deep-copies it (about 0.5 GB for this model).
        """
    ),
    code(
        """
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
            print(f"L{LAYER}H{head}  {dyn.cosine[0, head]:.6f}   {dyn.relative_error[0, head]:.1e}"
                  f"      {dyn.pattern_cosine[0, head]:.6f}")

        assert (dyn.cosine > 0.99).all(), dyn.cosine
        assert (dyn.pattern_cosine > 0.99).all(), dyn.pattern_cosine
        """
    ),
    md(
        """
        ### Predicted against actual, as a plot

        Each point is one (query, key) entry of one head in the causal triangle, coloured by head.
        Left: the logit change $\\Delta Z$. Right: the pattern change $\\Delta A$, where the
        prediction is the softmax Jacobian applied to $\\Delta Z/s$. On the diagonal means the RA
        prediction is right.

        Then the same with a step 100 times larger (`lr=0.1`). What to look for: the logit
        prediction barely moves off the diagonal (the neglected term is quadratic in the step),
        but the *pattern* prediction bends: the softmax saturates, so a linearisation of
        $A$ in $Z$ overshoots for big logit changes. RA predicts the direction of the edit in
        logit space; how far the pattern actually moves is a nonlinear function of it.
        """
    ),
    code(
        """
        big = ra_lens.edit_dynamics(model, prompt, metric, lr=0.1, layers=[LAYER])


        def scatter(ax, predicted, actual, title):
            n = predicted.shape[-1]
            tri = torch.tril(torch.ones(n, n, dtype=torch.bool))
            for head in range(predicted.shape[2]):
                ax.scatter(actual[0, 0, head][tri], predicted[0, 0, head][tri], s=9, alpha=0.7,
                           label=f"H{head}")
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
            scatter(axes[row, 0], run.predicted, run.actual,
                    f"logits dZ, lr={lr:g} (worst-head cosine {cos_z:.4f})")
            scatter(axes[row, 1], run.predicted_pattern, run.actual_pattern,
                    f"pattern dA, lr={lr:g} (worst-head cosine {cos_a:.4f})")
        axes[0, 1].legend(fontsize=8, ncol=3, title=f"layer {LAYER} head")
        fig.suptitle(f"One SGD step on W_q, W_k of layer {LAYER}: predicted vs actual attention change")
        plt.show()
        print(f"lr=0.1: logit cosine >= {big.cosine.min():.4f}, "
              f"pattern cosine >= {big.pattern_cosine.min():.4f}")
        """
    ),
    md(
        """
        ### The change is not RA itself

        The prediction is a *Gram-weighted* copy of RA, not $-\\eta\\,\\mathrm{RA}$. How similar
        are the two? The cosine between each head's actual $\\Delta Z$ and $-\\mathrm{RA}$ tells you
        how much the Gram matrices $XX^\\top$, $KK^\\top$, $QQ^\\top$ reshape the edit. Only the
        *total* is guaranteed to go downhill: to first order the loss changes by
        $\\sum_h \\langle \\mathrm{RA}_h, \\Delta Z_h\\rangle = -\\eta\\,\\lVert\\nabla_{W_q,W_k}L\\rVert^2 < 0$
        (asserted below). Per head, expect small positive cosines and possibly a negative one: a
        step on shared weights also moves logits that RA leaves at zero (every query row, not
        only the loss position) and can move one head against its own RA while the layer as a
        whole improves. So RA tells you which way each logit is *pushed*; the edit a weight update
        actually makes is RA filtered through the geometry of the activations.
        """
    ),
    code(
        """
        ra = ra_lens.reversed_attention(model, prompt, metric, layers=[LAYER])
        minus_ra = -ra.maps[:, 0].double()
        change = dyn.actual[:, 0].double()
        cos = torch.nn.functional.cosine_similarity(change.flatten(2), minus_ra.flatten(2), dim=-1)[0]
        print("cosine(actual dZ, -RA) per head:", [round(c, 3) for c in cos.tolist()])

        first_order_loss_change = (ra.maps[:, 0].double() * dyn.predicted[:, 0].double()).sum()
        print(f"predicted first-order change of the loss: {first_order_loss_change:.3e}")
        assert first_order_loss_change < 0
        """
    ),
    code(
        """
        print(f"notebook ran in {time.perf_counter() - start:.0f} s")
        """
    ),
]


# ------------------------------------------------------------------------------------------------
# 03 circuits

CIRCUITS = [
    md(
        """
        # Circuits: ranking heads with RA next to activation patching

        **What this shows.** Which attention heads matter for a task? Reversed Attention answers
        with one forward and one backward pass: rank heads by the norm of their RA map. The usual
        causal answer is activation patching: run a corrupted prompt, patch one head's output from
        the clean run, and measure how much of the answer comes back, one forward pass per head.
        On the same task (antonyms, 2-shot) we

        1. rank all 270 heads of SmolLM2 by RA (`ra_lens.ranking.ra_ranking`);
        2. rank them by activation patching with `transformer_lens.patching` itself, plus its
           gradient approximation (attribution patching) and the forward-attention baseline;
        3. measure where the rankings agree (Spearman correlation, top-10 overlap, heat maps) and
           look at the heads where they disagree;
        4. ablate heads in each ranking's order and watch task accuracy (ablation curves).

        **Runtime.** About 1-2 minutes on a laptop CPU, more than half of it activation patching
        (270 forward passes; the rest takes well under a minute). To keep it short, activation
        patching uses a single prompt pair (`N_PAIRS = 1`) and accuracy is measured on 12 test
        prompts: enough to see the method and the kind of disagreement, not to settle which
        ranking is better. The paper's full experiment is one call, shown at the end.
        """
    ),
    code(
        """
        %matplotlib inline
        import time
        import warnings

        # tqdm warns once when ipywidgets is missing; progress bars still work as plain text
        warnings.filterwarnings("ignore", message="IProgress not found")

        import matplotlib.pyplot as plt
        import torch
        from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

        import ra_lens
        from ra_lens import ranking, tasks, viz
        from ra_lens.experiments.patching import task_prompts
        from ra_lens.experiments.ranking import shuffled_label_prompts

        start = time.perf_counter()
        model = ra_lens.load_model(device="cpu")
        n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

        TASK, SHOTS = "antonym", 2
        N_PAIRS = 1  # activation patching: 270 forward passes per batch of pairs; raise it if you can wait
        N_RA = 16  # RA is cheap: also rank on more prompts
        N_TEST = 12  # held-out prompts for the ablation curves
        """
    ),
    md(
        """
        ## Clean and corrupted prompts

        Activation patching needs a *corrupted* twin of each prompt. We use Todd et al.'s
        corruption, as the paper's code does: the same prompt with the demonstrations' labels
        shuffled (`Q: hot / A: small`, ...), so the task is no longer shown but the query and
        the answer stay the same. Patching goes position by position, so a pair must have the
        same token length. For a clean signal we keep pairs that the model answers correctly when
        clean (the cell checks that the shuffle does lower $p(\\text{answer})$).

        Metric: $p(\\text{answer})$ at the last position, averaged over the pairs; a head's
        activation-patching score is how much patching its clean output into the corrupted run
        raises it.
        """
    ),
    code(
        """
        train, test = task_prompts(model, TASK, shots=SHOTS)
        test = test[:N_TEST]
        corrupted = shuffled_label_prompts(train, seed=0)
        lengths = tasks.prompt_lengths(train, model)
        same = [i for i, n in enumerate(tasks.prompt_lengths(corrupted, model)) if n == lengths[i]]

        candidates = same[:12]  # enough to find N_PAIRS that the model gets right
        clean_ranks = tasks.evaluate(model, [train[i] for i in candidates]).ranks
        chosen = [i for i, r in zip(candidates, clean_ranks.tolist()) if r == 0][:N_PAIRS]
        assert len(chosen) == N_PAIRS, "too few correctly answered prompts: raise the candidates"
        clean_texts = [train[i].text for i in chosen]
        corrupted_texts = [corrupted[i].text for i in chosen]
        targets = torch.tensor([tasks.answer_token(model, train[i].answer) for i in chosen])
        print("clean:    ", repr(clean_texts[0]))
        print("corrupted:", repr(corrupted_texts[0]))

        clean_tokens = model.to_tokens(clean_texts)  # equal lengths: no padding
        corrupted_tokens = model.to_tokens(corrupted_texts)
        rows = torch.arange(len(chosen))


        def p_answer(logits):
            return logits[:, -1].softmax(-1)[rows, targets].mean()


        with torch.no_grad():
            p_clean, p_corrupted = p_answer(model(clean_tokens)), p_answer(model(corrupted_tokens))
        print(f"p(answer): clean {p_clean:.3f}, corrupted {p_corrupted:.3f}")
        assert p_corrupted < p_clean
        """
    ),
    md(
        """
        ## Ranking 1: Reversed Attention norms

        `ranking.ra_ranking(model, prompts, targets)` is the mean Frobenius norm of each head's RA
        of $-\\log p(\\text{answer})$, over prompts: `Float[Tensor, "layer head"]`, larger = more
        important. It only needs the clean prompts, no corruption, and costs one forward and one
        backward pass per batch for all heads. We compute it on the same clean prompt(s) as activation
        patching (for a like-for-like comparison), and on 16 prompts to see how stable it is.
        """
    ),
    code(
        """
        scores, seconds = {}, {}

        began = time.perf_counter()
        scores["RA"] = ranking.ra_ranking(model, clean_texts, targets)
        seconds["RA"] = time.perf_counter() - began

        many = train[:N_RA]
        many_targets = [tasks.answer_token(model, p.answer) for p in many]
        began = time.perf_counter()
        scores[f"RA ({N_RA} prompts)"] = ranking.ra_ranking(model, [p.text for p in many], many_targets)
        seconds[f"RA ({N_RA} prompts)"] = time.perf_counter() - began

        stability = ranking.spearman(scores["RA"], scores[f"RA ({N_RA} prompts)"])
        print(f"RA on the patching prompt(s): {seconds['RA']:.1f} s;  on {N_RA} prompts: "
              f"{seconds[f'RA ({N_RA} prompts)']:.1f} s;  Spearman between the two: {stability:.2f}")
        assert stability > 0.5, "the RA ranking should not hinge on which prompts are used"
        """
    ),
    md(
        """
        ## Ranking 2: activation patching, with `transformer_lens.patching`

        TransformerLens's `get_act_patch_attn_head_out_all_pos` takes the corrupted tokens, a cache
        of the clean run and a metric, and for every (layer, head) runs the corrupted prompt with
        that head's output (`hook_z`, all positions) replaced by its clean value. It works
        unchanged on the `TransformerBridge` that `load_model` returns. We subtract the corrupted
        baseline so that a score is the gain in $p(\\text{answer})$.

        This is the expensive step: 270 forward passes (watch the progress bar), against one
        forward and one backward pass for RA. `ranking.activation_patching` wraps this same call
        with batching and averaging over any number of pairs.
        """
    ),
    code(
        """
        began = time.perf_counter()
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(
                clean_tokens, names_filter=lambda name: name.endswith("attn.hook_z")
            )
            patched = get_act_patch_attn_head_out_all_pos(
                model, corrupted_tokens, clean_cache, p_answer
            )
        scores["activation patching"] = (patched - p_corrupted).float()
        seconds["activation patching"] = time.perf_counter() - began
        print(f"activation patching: {seconds['activation patching']:.1f} s "
              f"({seconds['activation patching'] / seconds['RA']:.0f}x the RA ranking)")
        assert seconds["activation patching"] > 5 * seconds["RA"]
        """
    ),
    md(
        """
        ## Two more rankings for context

        * **Attribution patching** (`ranking.attribution_patching`): the first-order Taylor
          estimate of activation patching, $\\partial p/\\partial z \\cdot (z_\\text{clean} -
          z_\\text{corrupted})$ at `hook_z`, from two forward passes and one backward pass. It is
          gradient-based like RA, but it asks activation patching's question.
        * **Forward-attention norm** (`ranking.forward_ranking`): the paper's naive baseline.
        """
    ),
    code(
        """
        began = time.perf_counter()
        scores["attribution patching"] = ranking.attribution_patching(
            model, clean_texts, corrupted_texts, targets
        )
        seconds["attribution patching"] = time.perf_counter() - began
        scores["forward norm"] = ranking.forward_ranking(model, clean_texts)
        print({name: round(s, 1) for name, s in seconds.items()}, "seconds")
        """
    ),
    md(
        """
        ## Where do the rankings agree?

        Two summaries per pair of rankings: Spearman's rank correlation over all 270 heads, and the
        fraction of one ranking's top-10 heads that are also in the other's top 10. Spearman
        weighs the long tail of unimportant heads as much as the top, and the tail is mostly
        noise, so the top-10 overlap is the more relevant number for circuit finding.
        """
    ),
    code(
        """
        names = ["RA", f"RA ({N_RA} prompts)", "activation patching", "attribution patching",
                 "forward norm"]
        print(f"{'':>22}" + "".join(f"{n[:14]:>16}" for n in names))
        for a in names:
            cells = [
                f"{ranking.spearman(scores[a], scores[b]):>7.2f} /"
                f"{ranking.top_k_overlap(scores[a], scores[b], 10):>4.0%}"
                for b in names
            ]
            print(f"{a:>22}" + "".join(f"{c:>16}" for c in cells))
        print("(each cell: Spearman / top-10 overlap)")

        ap_vs_attr = ranking.spearman(scores["activation patching"], scores["attribution patching"])
        assert ap_vs_attr > 0.5, "attribution patching should approximate activation patching"
        """
    ),
    code(
        """
        viz.ranking_maps(
            {name: scores[name] for name in ("RA", "activation patching", "attribution patching")}
        )
        """
    ),
    md(
        """
        What to look for, in the table and the heat maps:

        * **Attribution patching tracks activation patching closely**: both measure the effect of
          the clean-vs-corrupted *difference* in each head's output, one exactly, one to first
          order.
        * **RA agrees with them at the top, much less overall.** Expect a part of the top 10 in
          common but a Spearman correlation near zero: RA gives every head a non-negative score
          (a norm), activation patching gives most heads an effect of about zero, and the two
          orderings of that long tail are unrelated.
        * **Where the mass sits differs.** RA norms are spread over early and middle layers;
          the large patching effects sit in a few heads, mostly in later layers. In our run,
          several heads that only RA puts in its top 10 were in layers 2-8, and the heads only
          patching found were later heads (layers 16-25) with RA norms well below RA's own top 10
          (the scatter plot below).
        * **The forward-attention norm is no proxy for either**: its correlation with RA was
          even negative in our run.
        * **RA is stable**: ranking on the patching prompt alone or on 16 prompts gives similar
          orders.

        The two methods ask different questions. RA measures how sensitive the loss is to each
        head's *attention pattern* on the clean prompt: the query-key side. Activation patching
        measures what a head's *output* carries that differs between clean and corrupted prompts:
        the value side, and only what this particular corruption changes. A head that must attend
        to the right place for the answer but does the same on both prompts (it reads the query
        word, say, which the shuffle leaves intact) scores high on RA and zero on patching.
        """
    ),
    code(
        """
        ra_s, ap_s = scores["RA"], scores["activation patching"]
        top_ra, top_ap = set(ranking.head_order(ra_s)[:10]), set(ranking.head_order(ap_s)[:10])

        fig, ax = plt.subplots(figsize=(7.5, 5), layout="constrained")
        ax.scatter(ra_s.flatten(), ap_s.flatten(), s=12, color="0.6", label="all heads")
        groups = {"top 10 of both": top_ra & top_ap, "top 10 by RA only": top_ra - top_ap,
                  "top 10 by patching only": top_ap - top_ra}
        for (label, heads), color in zip(groups.items(), ("C2", "C0", "C3")):
            if heads:
                ax.scatter([ra_s[h] for h in heads], [ap_s[h] for h in heads], s=40,
                           color=color, label=label)
                for layer, head in heads:
                    ax.annotate(f"L{layer}H{head}", (ra_s[layer, head], ap_s[layer, head]),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="0.8", linewidth=0.8, zorder=0)
        ax.set_xlabel("RA norm on the clean prompt(s)")
        ax.set_ylabel("activation patching: gain in p(answer)")
        ax.set_title(f"{TASK}, {SHOTS}-shot: RA ranking against activation patching")
        ax.legend(fontsize=8)
        plt.show()

        for label, heads in groups.items():
            listed = ", ".join(f"L{la}H{h}" for la, h in sorted(heads))
            print(f"{label:>24}: {listed or '-'}")
        """
    ),
    md(
        """
        ## Ablation curves

        Agreement between rankings says nothing about which ranking is *right*. The paper's test:
        keep only the top p% of heads under a ranking, zero the outputs of all the others at
        `hook_z`, and measure accuracy on held-out prompts (`ranking.ablation_curve`). A better
        ranking keeps accuracy with fewer heads (a larger area under the curve). The mirror test
        removes only each ranking's top heads: a better ranking breaks the task with fewer
        removals. Random order is the floor. We use the RA ranking from 16 prompts (it costs
        next to nothing) and a few points per curve to keep the runtime down; each distinct set
        of ablated heads is evaluated once and shared between curves.
        """
    ),
    code(
        """
        memo = {}


        def evaluate(ablated):
            key = tuple(ablated)
            if key not in memo:
                hooks = ra_lens.head_ablation_hooks(ablated) if ablated else []
                memo[key] = tasks.evaluate(model, test, fwd_hooks=hooks)
            return memo[key]


        curve_scores = {
            "RA": scores[f"RA ({N_RA} prompts)"],
            "activation patching": scores["activation patching"],
            "random": ranking.random_ranking(n_layers, n_heads, seed=0),
        }
        unablated = evaluate([])
        FRACTIONS = (0.0, 0.85, 0.95, 1.0)
        curves = {
            name: ranking.ablation_curve(model, test, s, FRACTIONS, evaluate=evaluate)
            for name, s in curve_scores.items()
        }
        REMOVED = (0, 3, 10)
        removal = {
            name: [evaluate(sorted(ranking.head_order(s)[:k])).top3 for k in REMOVED]
            for name, s in curve_scores.items()
        }
        print(f"no ablation: top-1 {unablated.top1:.0%}, top-3 {unablated.top3:.0%} "
              f"on {len(test)} test prompts")
        for name in curve_scores:
            kept = ", ".join(f"{p:.0%}: {a:.0%}" for p, a in zip(FRACTIONS, curves[name].top3))
            removed = ", ".join(f"{k}: {a:.0%}" for k, a in zip(REMOVED, removal[name]))
            print(f"{name:>20} | top-3 keeping the top p of heads {kept} | removing the top k {removed}")

        ra_auc, ap_auc = curves["RA"].auc_top3, curves["activation patching"].auc_top3
        print(f"keep-top AUC (top-3): RA {ra_auc:.3f}, activation patching {ap_auc:.3f}, "
              f"random {curves['random'].auc_top3:.3f}")
        print("in this run, RA's order did at least as well as activation patching on both tests:",
              ra_auc >= ap_auc and removal["RA"][1] <= removal["activation patching"][1])
        """
    ),
    code(
        """
        viz.ablation_curves(
            FRACTIONS, {name: c.top3 for name, c in curves.items()}, ylabel="top-3 accuracy",
            title=f"Keeping only the top-ranked heads ({TASK}, {SHOTS}-shot)",
        )
        """
    ),
    code(
        """
        fig, ax = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
        for name, accuracies in removal.items():
            ax.plot(REMOVED, accuracies, marker="o", label=name)
        ax.set_xlabel("top-ranked heads removed (outputs zeroed)")
        ax.set_ylabel("top-3 accuracy")
        ax.set_title(f"Removing each ranking's top heads ({TASK}, {SHOTS}-shot)")
        ax.set_xticks(REMOVED)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
        ax.legend()
        plt.show()

        assert removal["RA"][-1] < unablated.top3, "removing the top RA heads should hurt"
        assert removal["RA"][-1] <= min(removal["random"][1:]), "RA's top heads should matter more"
        """
    ),
    md(
        """
        ### Is it the task, or are these heads needed for everything?

        Ablation measures *necessity*: a head whose removal breaks every prompt would look just
        as "important" here. A cheap control: remove the same top-3 RA heads (ranked on antonym
        prompts) and measure two *other* tasks. If accuracy there barely moves while antonyms
        collapse, the heads are specific to this task rather than generally load-bearing.
        """
    ),
    code(
        """
        top3 = ranking.head_order(curve_scores["RA"])[:3]
        print("top-3 RA heads for antonyms:", ", ".join(f"L{la}H{h}" for la, h in top3))
        print(f"{TASK:>15}: top-3 {unablated.top3:.0%} -> {evaluate(sorted(top3)).top3:.0%} without them")
        for other in ("present-past", "capitalize"):
            _, other_test = task_prompts(model, other, shots=SHOTS)
            other_test = other_test[:N_TEST]
            before = tasks.evaluate(model, other_test).top3
            after = tasks.evaluate(model, other_test, fwd_hooks=ra_lens.head_ablation_hooks(top3)).top3
            print(f"{other:>15}: top-3 {before:.0%} -> {after:.0%} without them")
        """
    ),
    md(
        """
        How to read all this, and its limits:

        * With 30 layers, zeroing even 15% of the heads breaks this small model under most
          orderings, so the keep-top curve separates the rankings only near p = 1, and the
          straight segments between the few points we measured are not data. Look for which
          curve stays up longest.
        * Removing a handful of top heads is the sharper test here: a few heads matter a lot,
          and random removals rarely hit them.
        * At the time of writing, the RA order did at least as well as activation patching on
          both tests (the last line printed above the plots says whether that still holds).
          That is not a fair verdict: the patching ranking comes from one prompt pair and one
          kind of corruption, and it answers a different question (what the corruption changes,
          not what the task needs). With more pairs it gets less noisy, at 270 forward passes per
          batch; RA needs no corruption at all and costs one backward pass per batch.
        * Zero-ablation pushes activations off their usual distribution; mean-ablation
          (`head_ablation_hooks(heads, mode="mean", means=...)`) is a gentler alternative.

        ## The full experiment in one call

        `ra_lens.experiments.head_ranking` runs the paper's version end to end: 25 prompts,
        5 shots, all baselines (forward norm, random, layer index, causal mediation, activation
        and attribution patching), keep-top and keep-bottom curves at 0, 10, ..., 100%, timings,
        Spearman and top-10 overlaps with RA. On a laptop CPU it takes a long time (causal
        mediation and activation patching are 270 forward passes each per batch), so it is not
        run here:

        ```python
        from ra_lens.experiments import head_ranking
        result = head_ranking(model, "antonym", shots=5, n_prompts=25)
        print(result.table())
        result.plot("figures/")
        ```

        or from the shell: `ra-lens rank --task antonym --out figures/`.
        """
    ),
    code(
        """
        print(f"notebook ran in {time.perf_counter() - start:.0f} s")
        """
    ),
]


NOTEBOOKS = {
    "01_quickstart": QUICKSTART,
    "02_attention_patching": PATCHING,
    "03_circuits": CIRCUITS,
    "04_edit_dynamics": DYNAMICS,
}


def build(names: list[str] | None = None) -> list[Path]:
    written = []
    for stem, cells in NOTEBOOKS.items():
        if names and stem not in names:
            continue
        nb = notebook(stem, cells)
        nbformat.validate(nb)
        path = HERE / f"{stem}.ipynb"
        with path.open("w", encoding="utf-8") as handle:
            nbformat.write(nb, handle)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in build(sys.argv[1:] or None):
        print(f"wrote {path.relative_to(HERE.parent)}")
