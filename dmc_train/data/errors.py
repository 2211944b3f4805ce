"""User-facing data errors: each message is one line naming the cause and the fix."""


class DataError(ValueError):
    """Bad input, missing or inconsistent data files, or a tokenizer that does not fit."""


class MissingPrefixError(DataError, FileNotFoundError):
    """An indexed-dataset prefix (``<prefix>.bin`` / ``<prefix>.idx``) does not exist."""
