"""The head-ranking study (issue 14): `python benchmarks/ranking_study.py --quick` or see
`ra_lens/experiments/ranking_study.py` for every option."""

import sys

from ra_lens.experiments.ranking_study import main

if __name__ == "__main__":
    sys.exit(main())
