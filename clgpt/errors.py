"""One error type for everything a user can get wrong; the CLI and stage scripts print it as one line."""


class ClgptError(Exception):
    """A user-facing error: the message names the file, key or value and says what to do."""
