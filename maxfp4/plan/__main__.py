"""``python -m maxfp4.plan``: :mod:`maxfp4.plan.command` as a command."""

import sys

from maxfp4.plan.command import main

if __name__ == "__main__":
    sys.exit(main())
