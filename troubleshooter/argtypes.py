"""argparse types shared by the CLI and the doctor.

Why a module of its own: the CLI imports the doctor (to add its options) and the doctor needs the
same types; with the types here neither imports the other for them, so there is no import cycle.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """An integer >= 1 (0 or a word is an argument error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, minutes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value
