"""`edgetune VERB`: one dispatcher; each package registers its own verbs.

Exit codes: 0 ok, 1 failure, 2 usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from edgetune import __version__
from edgetune.errors import EdgetuneError
from edgetune.output import emit, say

# Each module exposes register(subparsers); a verb's handler is set with set_defaults(func=...).
VERB_MODULES = ["hwprobe.cli", "kernels.cli", "kernels.cli_workloads", "tuner.cli", "daemon.cli", "fleet.cli"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too, but say it our way
        self.print_usage(sys.stderr)
        say(message, "error:", "red", err=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgetune", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"edgetune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    for name in VERB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that package has no verbs yet
                continue
            raise
        mod.register(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    """Run a parsed verb: logging as asked, an EdgetuneError as its message and exit code."""
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except EdgetuneError as e:
        say(str(e), "error:", "red", err=True)
        if getattr(args, "json", None) is True:  # a script reading stdout gets JSON it can parse, not nothing
            emit({"error": str(e), "exit_code": e.exit_code}, True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return _run(build_parser().parse_args(argv))


def run_module(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
               func: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """A developer tool that is not a verb (`python -m tuner.collect`), parsed and run as the verbs are."""
    parser = _Parser(prog=prog, description=description)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    add_arguments(parser)
    parser.set_defaults(func=func)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
