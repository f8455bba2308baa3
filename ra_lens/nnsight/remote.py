"""Running the Reversed Attention trace on NDIF (remote=True) or, offline, in a fresh process
that stands in for an NDIF model server (remote="local").

Both send the same request: nnsight's `RemoteBackend` serializes the trace of
`_trace.ra_in_trace` with `RequestModel.serialize` (the with-block's source plus the names it
reads). ra-lens is not installed on NDIF, so while the request is serialized the `ra_lens`
package is registered with cloudpickle for pickling by value: `_trace`'s helpers and a metric
from `ra_lens.metrics` travel as source. remote="local" replaces only the transport:
`LocalProcessBackend.request` hands the serialized request to `_server.py` in a fresh
`python -I` process that refuses to import ra_lens, on a `save_pretrained` copy of the model.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from ra_lens.nnsight import adapter
from ra_lens.nnsight.adapter import NnsightModel

HOSTED = "https://nnsight.net/status (or nnsight.ndif.status())"


def check(model: NnsightModel, remote: Any) -> None:
    """Refuse, before any network call, what NDIF cannot run."""
    if remote == "local":
        return
    if remote is not True:
        raise ValueError(f"remote must be False, True or 'local', got {remote!r}")
    from nnsight import CONFIG

    if not (CONFIG.API.APIKEY or os.environ.get("NDIF_API_KEY")):
        raise ValueError(
            "remote=True needs an NDIF API key: get one at https://login.ndif.us, then "
            "`export NDIF_API_KEY=<key>` or call nnsight.CONFIG.set_default_api_key('<key>') "
            "(remote='local' runs the same request offline)"
        )
    if not getattr(model, "repo_id", ""):
        raise ValueError(
            "remote=True runs a model NDIF hosts, named by its Hugging Face id: wrap it as "
            "nnsight.TransformersModel('meta-llama/Llama-3.1-8B', attn_implementation='eager') "
            f"(hosted models: {HOSTED}); a model built in this process runs with remote='local'"
        )


def trace_kwargs(model: NnsightModel, remote: Any) -> dict[str, Any]:
    """`model.trace` keyword arguments for `remote` (checked by `check`)."""
    if remote == "local":
        return {"backend": LocalProcessBackend(model)}
    return {"remote": True}


@contextlib.contextmanager
def shipped_by_value() -> Iterator[None]:
    """ra_lens pickled by value (as source) while a request is serialized, then as before.

    nnsight ships a function by value as its source (`inspect.getsource`, which follows
    `__wrapped__`) run against the function's own globals. A function wrapped by jaxtyping's
    import hook (the test run type-checks ra_lens that way) would travel as the inner source
    against jaxtyping's globals, and jaxtyping is not on NDIF; so for the serialization the
    wrapped functions of ra_lens's modules and classes are swapped for the inner ones.
    """
    import cloudpickle
    import cloudpickle.cloudpickle as registry

    # The package this module belongs to, already imported (an import here would run the
    # package's __init__ from inside one of its modules: a circle in the import graph).
    ra_lens = sys.modules[__name__.partition(".")[0]]
    before = "ra_lens" in registry._PICKLE_BY_VALUE_MODULES
    cloudpickle.register_pickle_by_value(ra_lens)
    swapped = _unwrap_type_checks()
    try:
        yield
    finally:
        for namespace, name, wrapper in swapped:
            setattr(namespace, name, wrapper)
        if not before:
            cloudpickle.unregister_pickle_by_value(ra_lens)


def _unwrap_type_checks() -> list[tuple[Any, str, Any]]:
    """Swap each jaxtyping-wrapped function of ra_lens's modules (and of their classes) for the
    function it wraps; returns (namespace, name, wrapper) to put back."""
    swapped = []
    modules = [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "ra_lens" and m]
    namespaces: list[Any] = list(modules)
    for module in modules:
        namespaces += [
            c
            for c in vars(module).values()
            if isinstance(c, type) and c.__module__.split(".")[0] == "ra_lens"
        ]
    for namespace in namespaces:
        for name, value in list(vars(namespace).items()):
            code = getattr(value, "__code__", None)
            inner = getattr(value, "__wrapped__", None)
            if code is not None and inner is not None and "jaxtyping" in code.co_filename:
                swapped.append((namespace, name, value))
                setattr(namespace, name, inner)
    return swapped


class ServerProcessError(RuntimeError):
    """The request failed in the stand-in server process (remote="local"); its traceback."""


def explained(error: Exception) -> Exception | None:
    """NDIF's refusal, with the fix named; the stand-in server's failure as it is; None for
    other errors."""
    if isinstance(error, ServerProcessError):
        return error
    if not isinstance(error, RemoteError):
        return None
    return RuntimeError(
        f"NDIF refused or failed the request ({str(error)[:500]}): check that NDIF hosts this "
        f"model now ({HOSTED}), that the API key is valid, and that the model was wrapped "
        "with attn_implementation='eager'"
    )


class LocalProcessBackend(RemoteBackend):  # type: ignore[misc]  # nnsight is untyped
    """nnsight's RemoteBackend with the network replaced by a fresh local process
    (`run_request`): the same `__call__`, serialization and push of the results."""

    def __init__(self, model: NnsightModel) -> None:
        super().__init__("local", env=cast(Any, model)._remoteable_get_env())
        self.model = model

    def request(self, request: Any, tracer: Any) -> dict[str, Any]:
        return run_request(self._serialize(tracer), self.model, compress=self.compress)


def run_request(blob: bytes, model: NnsightModel, *, compress: bool) -> dict[str, Any]:
    """Execute a serialized request in a fresh `python -I` process that cannot import ra_lens,
    on a `save_pretrained` copy of `model`; returns the trace's saved values by name, as an
    NDIF server returns them."""
    import json

    hf = adapter.hf_module(model)
    dtype = str(next(hf.parameters()).dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="ra_lens_server_") as folder:
        cast(Any, hf).save_pretrained(folder)  # a PreTrainedModel, typed as a Module
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        settings = {"dtype": dtype, "compress": compress, "tokenizer": tokenizer is not None}
        Path(folder, "ra_request.json").write_text(json.dumps(settings))
        request, result = Path(folder, "request.bin"), Path(folder, "result.pt")
        request.write_bytes(blob)
        server = Path(__file__).with_name("_server.py")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(
            [sys.executable, "-I", str(server), str(request), folder, str(result)],
            env=env,
            capture_output=True,
            text=True,
        )
        error = Path(str(result) + ".error")
        if done.returncode != 0:
            text = error.read_text() if error.exists() else done.stderr[-2000:]
            raise ServerProcessError(f"the request failed in the server process:\n{text}")
        found: dict[str, Any] = torch.load(result, map_location="cpu", weights_only=False)
        return found
