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
from rich.text import Text

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


def say(message: str, label: str = "", style: str = "", err: bool = False) -> None:
    """Print `message` verbatim after an optional styled `label`. Messages carry user values (paths, workload
    names, TOML tables such as `[power]`) that rich would otherwise read as markup: dropped, or a MarkupError."""
    text = Text.assemble((label, style), " " if label and message else "", message)
    (err_console if err else console).print(text)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    """A table whose cells and title print verbatim (no rich markup: they hold user values)."""
    t = Table(title=None if title is None else Text(title))
    for c in columns:
        t.add_column(Text(c))
    for r in rows:
        t.add_row(*[Text("" if v is None else str(v)) for v in r])
    console.print(t)


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_ms(x: float | None) -> str:
    """A kernel time in ms to 4 significant digits: a 20 ns kernel reads 2e-05, not 0.0000."""
    return "-" if x is None else f"{x:.4g}"


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
