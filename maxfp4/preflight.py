"""``python -m maxfp4.preflight CONFIG [overrides] [--gemm]``: the start-up checks as a command.
The checks themselves live in ``maxfp4/reliability/preflight.py``."""

import sys

from maxfp4.reliability.preflight import main

if __name__ == "__main__":
    sys.exit(main())
