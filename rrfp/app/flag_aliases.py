"""Old spellings of renamed CLI flags, kept for one release: the old flag stores into the new
one's place and says on stderr, in one line, which flag replaces it, so a script that uses it
keeps working and learns the new name."""

from __future__ import annotations

import argparse

from rrfp.app.job_lines import say


class _Deprecated(argparse.Action):
    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        say(f"rrfp: warning: {option_string} is deprecated, use {self.new}")
        setattr(namespace, self.dest, values)


def add_deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """``old`` as an alias of the flag ``new`` (same ``type``): it fills ``new``'s dest."""
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(
        old,
        dest=dest,
        action=_Deprecated,
        new=new,
        default=argparse.SUPPRESS,  # the new flag's default stands when the old one is not given
        help=f"deprecated spelling of {new}",
        **kwargs,
    )
