"""``python -m slide_hf``: the `slide` command line, for launchers that start a module rather than a
console script (``torchrun --nproc-per-node N -m slide_hf train ...``)."""

import sys

from slide_hf.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
