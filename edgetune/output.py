"""One way for every verb to print: JSON for machines, rich tables and progress for people, quiet in a service."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

err_console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)
# piped output (logs, CI) gets wide tables instead of rich's 80-column default
console = Console() if sys.stdout.isatty() else Console(width=200)


def json_flag(p: argparse.ArgumentParser) -> None:
    """Every verb takes --json."""
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def emit(data: Any, as_json: bool, render: Callable[[Any], None] | None = None) -> None:
    """Print `data` as JSON, or through `render` for a person."""
    if as_json or render is None:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        sys.stdout.flush()
    else:
        render(data)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    console.print(t)


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


@contextmanager
def progress(enabled: bool) -> Iterator[Progress | None]:
    """A progress bar on a terminal (stderr), nothing in a service or under --json."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=False,
    ) as p:
        yield p
