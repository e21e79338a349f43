"""Errors that carry their CLI exit code, so every verb reports bad input the same way."""

from __future__ import annotations


class EdgetuneError(Exception):
    """A failure the user should read; exit code 1."""

    exit_code = 1


class BadInput(EdgetuneError):
    """The user gave a value we cannot use; exit code 2. The message names the value and what is allowed."""

    exit_code = 2
