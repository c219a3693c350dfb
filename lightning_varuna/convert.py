"""``python -m lightning_varuna.convert``: the command line of :mod:`lightning_varuna.checkpoint.convert`."""

import sys

from lightning_varuna.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
