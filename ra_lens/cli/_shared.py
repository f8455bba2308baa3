"""What every `ra-lens` command shares: loading the model of --model, checking --out / --json
before the work, the --json writer, printing next to a JSON report, and parsing numbers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ra_lens.files import check_writable, check_writable_folder, is_stream, write_file
from ra_lens.types import HookedModel

if TYPE_CHECKING:
    from ra_lens.toy_models import Architecture


def _load(name: str, backend: str = "auto") -> HookedModel:
    """The model behind --model: a tiny random one (``tiny-ARCH``) or `load_model`'s."""
    if name.startswith("tiny-"):
        from ra_lens.toy_models import tiny_model

        # tiny_model checks the name itself (an unknown one gets an error listing the names)
        return tiny_model(cast("Architecture", name.removeprefix("tiny-")))
    from ra_lens.models import load_model

    return load_model(name, backend=backend, device="cpu")


def _model(args: argparse.Namespace) -> HookedModel:
    """The model of --model and --backend, loaded by `ra_lens.cli._load`, looked up there on every
    call: tests hand a command a model they already have by replacing that attribute."""
    from ra_lens import cli

    return cli._load(args.model, args.backend)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before the computation (which can take many minutes), not after it, when --out or
    --json cannot be written, or when --json names a file --out writes (the report would
    replace it: `args.out_files`, the names a command writes under --out, or a function of the
    arguments giving them where they depend on the arguments)."""
    out: Path | None = getattr(args, "out", None)
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file: give a folder (it is created if missing)")
        check_writable_folder(out, "--out")
    target = getattr(args, "json", None)
    if target is None or target == "-":
        return
    check_writable(target, "--json")
    if out is not None and not is_stream(target):
        written = os.path.realpath(target)
        if written == os.path.realpath(out):
            raise ValueError(
                f"--json {target} is the --out folder: give a file name such as {out}/report.json"
            )
        names = getattr(args, "out_files", ())
        for name in names(args) if callable(names) else names:
            if written == os.path.realpath(out / name):
                raise ValueError(
                    f"--json {target} is the {name} that --out {out} writes: give the report "
                    f"another name, such as {out}/report.json"
                )


def _emit_json(target: str | None, payload: dict[str, Any]) -> None:
    """Print the report (`-`), or write it with the library's one writer: through symlinks,
    keeping an existing file's mode, directly into a FIFO or /dev/stdout, atomically otherwise."""
    if target is None:
        return
    text = json.dumps(payload, indent=2)
    if target == "-":
        print(text)
        return
    sys.stdout.flush()  # /dev/stdout may be the terminal the tables went to: keep the order
    write_file(target, text + "\n", make_folders=True)


def _say(args: argparse.Namespace, message: str) -> None:
    # With --json - the JSON owns stdout; everything else goes to stderr.
    print(message, file=sys.stderr if args.json == "-" else sys.stdout)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
