"""``python -m maxfp4.export``: :mod:`maxfp4.interop.export` as a command."""

import sys

from maxfp4.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
