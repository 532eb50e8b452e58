"""``python -m bench``: the benchmark suite (see :mod:`bench.cli`)."""

import sys

from bench.cli import run

sys.exit(run())
