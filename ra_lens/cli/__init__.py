"""The `ra-lens` command: RA maps of a prompt, attention patching and head ranking on ICL tasks.

ra-lens maps --prompt "I like Italy and France. I visited the city of" --target " Florence"
ra-lens patch --task antonym --shots 0
ra-lens rank --task antonym --shots 5
ra-lens attribute --clean "When Mary and John went to the store, John gave a drink to" \
    --corrupted "When Alice and Bob went to the store, John gave a drink to" --target " Mary" --wrong " John"
ra-lens circuit --task ioi --method exact --sizes 0.01,0.05,0.2,1 --out circuit/

`main` is here; the parser in `_parser`, each command in its own module (`maps`, `patch_rank`,
`attribute`, `circuit`; `pairs` reads prompt pairs), what they share in `_shared`.
"""

from __future__ import annotations

import json as json  # tests replace ra_lens.cli.json.dumps (the json module every writer uses)
import sys
from typing import cast

from ra_lens.cli._parser import MODEL_HELP as MODEL_HELP
from ra_lens.cli._parser import build_parser as build_parser
from ra_lens.cli._shared import check_outputs
from ra_lens.cli._shared import emit_json as emit_json
from ra_lens.cli.pairs import CIRCUIT_TASKS as CIRCUIT_TASKS
from ra_lens.cli.pairs import PAIR_KEYS as PAIR_KEYS


def main(argv: list[str] | None = None) -> int:
    """Run the `ra-lens` command with `argv` (default: the process's arguments); returns the exit
    status: 0, or 2 after printing `ra-lens COMMAND: error: ...` to stderr.

    `--model tiny-gpt2` (TransformerLens >= 3) or `tiny-hooked` (TransformerLens 2) is a random
    tiny model, built in a second:

    >>> import contextlib, io, json, math
    >>> from ra_lens.models import bridge_available
    >>> tiny = "tiny-gpt2" if bridge_available() else "tiny-hooked"
    >>> args = ["--prompt", "The capital of France is", "--target", " Paris", "--top", "3"]
    >>> with contextlib.redirect_stdout(io.StringIO()) as out:
    ...     status = main(["maps", "--model", tiny, *args, "--json", "-"])
    >>> report = json.loads(out.getvalue())
    >>> nll = math.isclose(report["metric"], -math.log(report["target_prob"]), rel_tol=1e-5)
    >>> status, len(report["top_heads"]), nll  # the metric is -log p(target)
    (0, 3, True)
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_outputs(args)
        return cast(int, args.run(args))  # every command's run returns its exit status
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ra-lens {args.command}: error: {error}", file=sys.stderr)
        return 2
