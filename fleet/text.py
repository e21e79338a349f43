"""Parsing of the numbers people type into the fleet's flags, query strings, forms and ids."""

from __future__ import annotations


def whole_number(text: str) -> int | None:
    """`text` as a non-negative integer if it is ASCII digits only, else None. Not str.isdigit() then int():
    isdigit() accepts '²', which int() then refuses with a ValueError, and int() alone takes ' 7', '+7', '1_0'
    and other scripts' digits, which no flag, query or id here means."""
    return int(text) if text.isascii() and text.isdigit() else None
