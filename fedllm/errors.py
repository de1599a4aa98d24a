"""The one base class of errors caused by what the user gave (exit code 2 on the CLI)."""


class InputError(ValueError):
    """Bad input: a recipe key, a missing file, an impossible value. The message names what and where."""
