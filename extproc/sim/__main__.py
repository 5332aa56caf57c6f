"""``python -m extproc.sim ...``: same as ``sluice sim ...``."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
