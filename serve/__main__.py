"""``python -m serve --model-path DIR --port 30000 [engine options]``."""

import sys

from serve.cli import run

sys.exit(run())
