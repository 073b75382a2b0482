"""User-facing errors: reported as one line, exit code 2, no traceback."""

import reprlib
from typing import Any


class UserError(Exception):
    """Bad input from the user (config, data, tokenizer, paths)."""


class ConfigError(UserError):
    """A configuration problem, reported as one line to the user."""


class DataError(UserError):
    """A data file, tokenizer or dataset that cannot be used, named in the message."""


# Bounded repr: a value named in an error message is never expanded past a few items, however
# large or deeply shared the structure behind it (YAML aliases) is.
def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()  # keyword arguments need Python 3.12
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 3, 4, 4, 4, 4
    r.maxstring, r.maxlong, r.maxother = 60, 40, 60
    return r


_SHORT_REPR = _short_repr()


def describe(value: Any) -> str:
    """A short repr for error messages, bounded however large ``value`` is."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def exit_code_of(action, *args, **kwargs) -> int:
    """Run a command-line action: 0 on success; a UserError becomes one line on stderr and 2."""
    import sys

    try:
        action(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
