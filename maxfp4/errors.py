"""User-facing errors: reported as one line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input from the user (config, data, tokenizer, paths)."""


class ConfigError(UserError):
    """A configuration problem, reported as one line to the user."""


class DataError(UserError):
    """A data file, tokenizer or dataset that cannot be used, named in the message."""


def exit_code_of(action, *args, **kwargs) -> int:
    """Run a command-line action: 0 on success; a UserError becomes one line on stderr and 2."""
    import sys

    try:
        action(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
