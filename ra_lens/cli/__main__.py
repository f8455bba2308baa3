"""`python -m ra_lens.cli`: the `ra-lens` command."""

import sys

from ra_lens.cli import main

sys.exit(main())
