"""Run one serialized nnsight request the way an NDIF model server does, in this fresh process.

`python -I _server.py REQUEST MODEL_DIR RESULT` (started by `ra_lens.nnsight.remote`):
imports of `ra_lens` are refused before anything else runs, so a request that needs ra-lens's
code by reference fails here exactly as on NDIF, where ra-lens is not installed. Then it loads
the local copy of the model from MODEL_DIR (`save_pretrained` output), frozen as a shared server
model is, deserializes the request with nnsight's `RequestModel.deserialize` against that
model's persistent objects, executes the trace, and `torch.save`s the values the trace saved
(by name) to RESULT. A failure writes its traceback to RESULT + ".error" and exits with 1.

SERVER-SAFE: imports only the standard library, torch, transformers and nnsight.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import traceback
from typing import Any


class _NoRaLens(importlib.abc.MetaPathFinder):
    """Refuses `ra_lens` and its submodules, whatever else on sys.path could provide them."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "ra_lens" or name.startswith("ra_lens."):
            raise ModuleNotFoundError(
                f"No module named {name!r} (ra-lens is not installed on the server)", name=name
            )
        return None


def _model(model_dir: str, settings: dict[str, Any]) -> Any:
    """nnsight.TransformersModel of the saved copy: eager attention, frozen, eval mode."""
    import nnsight
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=getattr(torch, settings["dtype"])
    )
    hf.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if settings["tokenizer"] else None
    return nnsight.TransformersModel(hf, tokenizer=tokenizer)


def _run(request_path: str, model_dir: str, result_path: str) -> None:
    import torch
    from nnsight.schema.request import RequestModel
    from nnsight.tracing.tracer import _saves, dec, inc

    with open(f"{model_dir}/ra_request.json") as handle:
        settings = json.load(handle)
    model = _model(model_dir, settings)
    with open(request_path, "rb") as handle:
        blob = handle.read()
    tracer = RequestModel.deserialize(
        blob, model._remoteable_persistent_objects(), compress=settings["compress"]
    )
    # As the server brackets a request: one trace scope, so save() marks into this thread's
    # set; the saved values are the block's top-level names whose objects were marked.
    inc()
    try:
        tracer.execute(tracer.info.code)
        marked = _saves()
        saved = {k: v for k, v in tracer.info.frame.f_locals.items() if id(v) in marked}
    finally:
        dec()
    torch.save(
        {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in saved.items()}, result_path
    )


def main() -> int:
    sys.meta_path.insert(0, _NoRaLens())
    request_path, model_dir, result_path = sys.argv[1:4]
    try:
        _run(request_path, model_dir, result_path)
    except BaseException:
        with open(result_path + ".error", "w") as handle:
            handle.write(traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
