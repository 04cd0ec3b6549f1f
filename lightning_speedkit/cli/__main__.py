"""``python -m lightning_speedkit.cli``: the ``speedkit`` command."""

import sys

from lightning_speedkit.cli import main

sys.exit(main())
