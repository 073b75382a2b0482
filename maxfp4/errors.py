"""User-facing errors: reported as one line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input from the user (config, data, tokenizer, paths)."""


class DataError(UserError):
    """A data file, tokenizer or dataset that cannot be used, named in the message."""
