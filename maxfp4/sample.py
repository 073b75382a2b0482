"""``python -m maxfp4.sample``: :mod:`maxfp4.interop.sample` as a command."""

import sys

from maxfp4.interop.sample import main

if __name__ == "__main__":
    sys.exit(main())
