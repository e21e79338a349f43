"""Argument types the bench scripts share. A bench measures for minutes and writes its results at the end: a value
it cannot use is refused when parsed, naming the value (argparse's usage error, exit 2), not met as a traceback
once the measuring is done and its results are lost."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable


def output_file(text: str) -> str:
    """A file the script writes later (--json, --refs): its directory must exist and be writable now."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer of at least `minimum` (a count of runs, rounds, configs or cases)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below the minimum of {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in some messages
    return parse


def positive(text: str) -> float:
    """A positive number of seconds (a timing window)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value
