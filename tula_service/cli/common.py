"""What both halves of the CLI share: the exit statuses, the error a user can act on, argument types
and plain-text tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

EXIT_JOB_NOT_DONE = 1  # `submit --wait`: the job failed or was cancelled; `show`: the job failed
EXIT_MISTAKE = 2  # a bad argument or file, a refusal by the server, a server that cannot be reached
EXIT_WAIT_TIMEOUT = 124  # `submit --wait --timeout-s`: the job is still running (as timeout(1) exits)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout closed early, `tula ... | head -1` (128 + SIGPIPE, as `yes | head -1`)


class CliError(Exception):
    """A mistake on the command line: printed as `error: ...`, exit status 2."""


Number = TypeVar("Number", int, float)


def positive(number: Callable[[str], Number]) -> Callable[[str], Number]:
    """An argparse type: `positive(int)` takes a whole number >= 1, `positive(float)` a number > 0."""
    noun, bound = ("a whole number", "at least 1") if number is int else ("a number", "greater than 0")

    def parse(text: str) -> Number:
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not {noun}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"'{text}' must be {bound}")
        return value

    return parse


positive_int, positive_float = positive(int), positive(float)


def table(headers: list[str], rows: list[list[Any]], align: str = "<") -> str:
    """Columns as wide as their widest cell; align ">" right-aligns every column (numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join(
        "  ".join(f"{str(cell):{align}{width}}" for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]
    )


def when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def one_line(text: str | None, width: int = 90) -> str:
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."
