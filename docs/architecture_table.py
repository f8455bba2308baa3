"""The architectures page's table (docs/concepts/architectures.md) of architectures x capabilities, written from the matrix tests' own
expectations (tests/test_architectures.py): every cell is what a test there asserts.

    python docs/architecture_table.py            # print the table
    python docs/architecture_table.py --check    # exit 1 unless docs/concepts/architectures.md holds it
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_architectures as matrix  # noqa: E402

from ra_lens.toy_models import HOOKED_MATRIX_ARCHITECTURES  # noqa: E402

NAMES = {
    "gpt2": "GPT-2", "gpt_neo": "GPT-Neo", "gptj": "GPT-J", "gpt_neox": "GPT-NeoX / Pythia",
    "opt": "OPT", "bloom": "BLOOM", "falcon": "Falcon", "llama": "Llama", "mistral": "Mistral",
    "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
    "gemma2": "Gemma-2", "gemma3": "Gemma-3", "phi": "Phi", "phi3": "Phi-3", "olmo": "OLMo",
    "olmo2": "OLMo-2", "stablelm": "StableLM",
}  # fmt: skip
FEATURES = {
    "gpt_neo": "no attention scale, local windows, attention delegated to HF",
    "gptj": "parallel blocks, interleaved partial rotary, attention delegated to HF",
    "gpt_neox": "parallel blocks (own ln2), partial rotary, joint qkv",
    "opt": "attention delegated to HF",
    "bloom": "ALiBi",
    "falcon": "parallel blocks (shared norm), multi-query, joint qkv",
    "llama": "GQA, rotary",
    "mistral": "GQA, sliding window",
    "mixtral": "mixture of experts (float32)",
    "qwen2": "GQA, q/k/v biases",
    "qwen3": "per-head q/k norms",
    "gemma": "GQA, (1 + w) norms",
    "gemma2": "attention and final soft-caps, post-norms, windows, query_pre_attn_scalar",
    "gemma3": "per-head q/k norms, post-norms, windows, one key/value head",
    "phi": "parallel blocks (shared norm), partial rotary",
    "phi3": "joint qkv, rotary without hook_rot_q",
    "olmo2": "cross-head q/k norm, post-norms only",
    "stablelm": "partial rotary",
}
CAPABILITIES = [
    "RA (`qk`, `scores`)",
    "layerwise RA",
    "attention patching",
    "exact attribution",
    "circuits (eap, faithfulness)",
    "learned mask",
    "eap-ig-act",
    "exact edges",
    "edit dynamics",
    "TL 2.18 HookedTransformer",
]


def cells(arch: str) -> list[str]:
    """One cell per capability: "exact", or the refusal's cause as the test asserts it."""
    patching = (
        "exact (your own runs: inside `live_attention`)" if arch in matrix.DELEGATED else "exact"
    )
    exact_edges = matrix.EXACT_REFUSALS.get(arch)
    dynamics = matrix.DYNAMICS_REFUSALS.get(arch)
    return [
        "exact",
        "exact",
        patching,
        "exact",
        "exact",
        "exact",  # learn_mask's masked run: clean, corrupted and 0/1 masks are edge patching
        "exact",  # eap-ig-act: eap's edges where no node is crossed; TL 2: EAP-IG written out
        f"refused: {exact_edges}" if exact_edges else "exact",
        f"refused: {dynamics}" if dynamics else "exact",
        "the same, edit dynamics refused (HookedTransformer)"
        if arch in HOOKED_MATRIX_ARCHITECTURES
        else "not built: TL 2.18 has no offline conversion",
    ]


def table() -> str:
    head = "| architecture | features | " + " | ".join(CAPABILITIES) + " |"
    rule = "|" + "---|" * (len(CAPABILITIES) + 2)
    rows = [
        f"| {NAMES[a]} | {FEATURES.get(a, '')} | " + " | ".join(cells(a)) + " |"
        for a in matrix.MATRIX_ARCHITECTURES
    ]
    return "\n".join([head, rule, *rows])


if __name__ == "__main__":
    text = table()
    if "--check" in sys.argv:
        sys.exit(0 if text in (ROOT / "docs" / "concepts" / "architectures.md").read_text() else 1)
    print(text)
