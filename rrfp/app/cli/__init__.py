"""The ``rrfp`` command: argument parsing (``main``) and one module per command. The only part of
rrfp that prints.

``entry`` is named here because it is the console script's ``rrfp.app.cli:entry``."""

from rrfp.app.cli.main import entry

__all__ = ["entry"]
