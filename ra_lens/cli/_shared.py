"""What every `ra-lens` command shares: loading the model of --model, checking --out / --json
before the work, the --json writer, printing next to a JSON report, and parsing numbers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

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


def load_model_of(args: argparse.Namespace) -> HookedModel:
    """The model of --model and --backend, loaded by this module's `_load`, looked up on every
    call: tests hand a command a model they already have by replacing that attribute."""
    return _load(args.model, args.backend)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0 such as 0.8, got {text!r}")
    return value


#: What `--mib DIR` writes into DIR (`circuits.export_mib`): a trailing "/" is a whole folder.
MIB_FILES = ("importances.json", "circuits/")


#: How a message names what an option writes, and a name to suggest instead of a clash.
_WHAT = {"--json": ("the report", "report.json"), "--html": ("the page", "circuit.html"),
         "--out": ("the --out folder", "plots"), "--mib": ("the --mib folder", "mib")}  # fmt: skip


class _Place(NamedTuple):
    """A path one option of a command reads or writes."""

    flag: str  # the option: "--json"
    path: Path  # as given
    tree: bool  # a folder written as a whole (MIB's circuits/): everything under it is taken
    owner: tuple[str, Path, str] | None  # (folder option, its folder, the name) for a name in it


def _places(args: argparse.Namespace) -> list[_Place]:
    """Every place the command of `args` writes or reads: the files of --json and --html, the
    input --pairs, each folder option (--out, --mib) and each name it writes into its folder.
    Streams (``-``, /dev/stdout, FIFOs) are left out: written in place, they replace nothing."""
    places = []
    for flag in ("--json", "--html", "--pairs"):
        value = getattr(args, flag[2:], None)
        if value is not None and value != "-" and not is_stream(value):
            places.append(_Place(flag, Path(value), False, None))
    names = getattr(args, "out_files", ())
    folders = {"--out": names(args) if callable(names) else names, "--mib": MIB_FILES}
    for flag, inside in folders.items():
        folder = getattr(args, flag[2:], None)
        if folder is not None:
            places.append(_Place(flag, folder, False, None))
            for n in inside:
                places.append(_Place(flag, folder / n, n.endswith("/"), (flag, folder, n)))
    return places


def _check_overlaps(args: argparse.Namespace) -> None:
    """Refuse two options of one command naming the same file (one would replace the other's
    output, or the --pairs being read), or a path inside a folder another option writes whole.
    --out and --mib may share a folder: the names they write there are checked one by one."""
    places = _places(args)
    real = [Path(os.path.realpath(p.path)) for p in places]
    for i, a in enumerate(places):
        for j in range(i + 1, len(places)):
            b = places[j]
            folders = a.owner is None and b.owner is None and {a.flag, b.flag} == {"--out", "--mib"}
            if a.flag == b.flag or folders:
                continue
            inside = (a.tree and real[i] in real[j].parents) or (
                b.tree and real[j] in real[i].parents
            )
            if real[i] == real[j] or inside:
                raise ValueError(_clash_message(a, b))


def _clash_message(a: _Place, b: _Place) -> str:
    """One line naming both options (`a` is never a name inside a folder: `_places`'s order)."""
    what, suggest = _WHAT.get(a.flag, ("it", "another name"))
    if b.owner is not None:
        flag, folder, name = b.owner
        where = f"in the {name} folder" if b.tree else f"the {name}"
        return (
            f"{a.flag} {a.path} is {where} that {flag} {folder} writes: give {what} another "
            f"name, such as {folder}/{suggest}"
        )
    if b.flag in ("--out", "--mib"):
        return (
            f"{a.flag} {a.path} is the {b.flag} folder: give a file name such as {b.path}/{suggest}"
        )
    return f"{a.flag} {a.path} and {b.flag} {b.path} name the same file: give them different names"


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before the computation (which can take hours on a real model), not after it: an
    output that cannot be written (--out or --mib a file, --json or --html a folder, a parent
    that is not writable), or two options naming the same file (`_check_overlaps`). Every
    message names the option. `args.out_files` are the names a command writes under --out, or a
    function of the arguments giving them where they depend on the arguments."""
    for flag in ("--out", "--mib"):
        folder: Path | None = getattr(args, flag[2:], None)
        if folder is None:
            continue
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{flag} {folder} is a file: give a folder (it is created if missing)")
        check_writable_folder(folder, flag)
    for flag in ("--json", "--html"):
        target = getattr(args, flag[2:], None)
        if target is not None and target != "-":
            check_writable(target, flag)
    _check_overlaps(args)


def emit_json(target: str | None, payload: dict[str, Any]) -> None:
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


def say(args: argparse.Namespace, message: str) -> None:
    # With --json - the JSON owns stdout; everything else goes to stderr.
    print(message, file=sys.stderr if args.json == "-" else sys.stdout)


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
