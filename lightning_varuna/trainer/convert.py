"""``varuna-convert``: the command line of :mod:`lightning_varuna.checkpoint.plain_format`."""

import sys

from lightning_varuna.checkpoint.plain_format import main

if __name__ == "__main__":
    sys.exit(main())
