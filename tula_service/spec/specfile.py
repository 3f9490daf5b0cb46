"""Job specs from YAML or JSON files (the CLI and the server's example seed).

A spec file is plain data, read with limits so a mistake is a message and never a hang or a
traceback:

- only a regular file of at most `MAX_SPEC_BYTES` is read (the server's request cap: a larger spec
  could not be sent anyway); a device (`/dev/zero`), a FIFO or a directory is refused before any
  byte is read, and at most the limit plus one byte is ever read;
- YAML is read with the safe loader, and any tag beyond plain mappings, lists, strings, numbers,
  booleans and null (`!!python/object/apply:os.system`, `!!binary`, `!custom`) is refused by name;
- a parse error names the line and column (`spec.yaml line 3, column 9: not YAML: ...`);
- numbers must be finite, and YAML aliases may not expand the data past what a file of the size
  limit could write out (`MAX_SPEC_VALUES`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from tula_service.limits import DEFAULT_MAX_REQUEST_BYTES

MAX_SPEC_BYTES = DEFAULT_MAX_REQUEST_BYTES
# More values than a file of MAX_SPEC_BYTES can write out (each takes a byte and a separator): only
# YAML aliases expand that far.
MAX_SPEC_VALUES = MAX_SPEC_BYTES
YAML_TAG_PREFIX = "tag:yaml.org,2002:"


class FileRefused(ValueError):
    """A file not read: not a regular file, or larger than its limit; the message names it and the limit."""


class SpecFileError(ValueError):
    """A file that is not a spec: not YAML or JSON, a refused tag, not a mapping; the message names it."""


def _bytes(count: int) -> str:
    return f"{count / 2**20:.3g} MiB" if count >= 2**20 else f"{count / 2**10:.3g} KiB" if count >= 2**10 else f"{count} B"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_limited(path: str | Path, max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file of at most max_bytes; raises FileRefused for anything else
    (OSError when it cannot be opened). Opened non-blocking, so a FIFO without a writer does not
    hang the open; the type and size are those of the opened file, and at most max_bytes + 1 bytes
    are read, so a file that grows after the check is still refused."""
    path = Path(path)
    limit = f"the {_bytes(max_bytes)} limit for {what}"
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{path} is {_file_kind(info.st_mode)}; {what} must be a regular file")
        if info.st_size > max_bytes:
            raise FileRefused(f"{path} is {info.st_size:,} bytes, more than {limit}")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise FileRefused(f"{path} is more than {limit} (it grew while being read)")
    return data


def _mark(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "an unknown place"


class SpecLoader(yaml.SafeLoader):
    """The safe loader, plain data only: a timestamp stays the string it was written as, and every
    other tag is refused by its name rather than yaml's 'could not determine a constructor'."""


def _refuse_tag(loader: SpecLoader, node: yaml.Node) -> Any:
    tag = "!!" + node.tag.removeprefix(YAML_TAG_PREFIX) if node.tag.startswith(YAML_TAG_PREFIX) else node.tag
    raise yaml.constructor.ConstructorError(
        None, None, f"the tag '{tag}' is not allowed in a spec (plain mappings, lists, strings and numbers only)", node.start_mark
    )  # fmt: skip


for _tag in ("binary", "omap", "pairs", "set"):
    SpecLoader.add_constructor(YAML_TAG_PREFIX + _tag, _refuse_tag)
SpecLoader.add_constructor(YAML_TAG_PREFIX + "timestamp", SpecLoader.construct_yaml_str)
SpecLoader.add_constructor(None, _refuse_tag)


def _parsed(path: Path, text: str) -> Any:
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecFileError(f"{path} line {error.lineno}, column {error.colno}: not JSON: {error.msg}") from None
    try:
        return yaml.load(text, Loader=SpecLoader)  # noqa: S506 - SpecLoader is SafeLoader, narrowed further
    except yaml.MarkedYAMLError as error:
        context = f" ({error.context} at {_mark(error.context_mark)})" if error.context and error.context_mark else ""
        kind = "" if isinstance(error, yaml.constructor.ConstructorError) else "not YAML: "
        raise SpecFileError(f"{path} {_mark(error.problem_mark)}: {kind}{error.problem}{context}") from None
    except yaml.YAMLError as error:
        raise SpecFileError(f"{path}: not YAML: {error}") from None


def _check_plain(path: Path, data: Any) -> None:
    """Finite numbers only (JSON has no NaN or infinity; the server would refuse the request), and a
    bounded expansion: YAML aliases can make a small file stand for billions of values."""
    pending, seen = [data], 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > MAX_SPEC_VALUES:
            raise SpecFileError(f"{path} expands to more than {MAX_SPEC_VALUES} values (YAML anchors and aliases?)")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecFileError(f"{path}: '{value}' is not allowed in a spec: numbers must be finite (JSON has no NaN or infinity)")
        if isinstance(value, dict):
            pending += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            pending += value


def _type_name(value: Any) -> str:
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "nothing (the file is empty)" if value is None else names.get(type(value), type(value).__name__)


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """The spec in a YAML or JSON (`.json`) file; raises FileRefused or SpecFileError (ValueErrors)
    naming the file and where in it, OSError when it cannot be opened."""
    path = Path(path)
    try:
        text = read_limited(path, MAX_SPEC_BYTES, "a spec").decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecFileError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    data = _parsed(path, text)
    if not isinstance(data, dict):
        raise SpecFileError(f"{path}: a job spec is a mapping of fields, got {_type_name(data)}")
    _check_plain(path, data)
    return data
