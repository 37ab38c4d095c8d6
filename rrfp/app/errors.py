"""Bad input from the user: the CLI prints one line and exits 2."""


class UsageError(Exception):
    """A command line, flag or value that cannot be used; the message says which."""


class ConfigError(UsageError, ValueError):
    """A config file or override that cannot be used; the message says which key."""
