"""Where file datasets (and a job's initial weights) may be read: only under the data roots the server operator configured.

A job's `dataset.path` is read by a profiling worker, so without a bound any client could make the
worker walk its whole file system (`image_folder` at `../../`) or read any file (`token_file` at
`/etc/passwd`). The operator names the folders that hold training data (`tula serve --data-root DIR`,
or TULA_DATA_ROOTS, os.pathsep-separated); with none, file datasets are refused.

Checked twice:
- at submit (`check_submitted_path`, no file-system access: the server may not see the worker's disk):
  the path is absolute, has no `..` component, and its normalized form lies under a root;
- on the worker (`resolve_confined`), after resolving symlinks: the real path still lies under a
  root's real path, so a symlink inside a root cannot lead out of it.
Errors name the path and the roots, never what a folder contains.
This module never imports torch (the server uses it).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

DATA_ROOTS_ENV = "TULA_DATA_ROOTS"


def _how_to_allow(path: str) -> str:
    folder = PurePosixPath(path).parent if path.startswith("/") else "DIR"
    return f"the server operator can allow a folder with `tula serve --data-root {folder}` (or {DATA_ROOTS_ENV})"


def _under(path: PurePosixPath, root: PurePosixPath) -> bool:
    return path == root or root in path.parents


def check_submitted_path(path: str, roots: list[str]) -> str | None:
    """Why the server refuses `path` for a file dataset, or None when it lies under one of `roots`."""
    if not roots:
        return f"files (datasets, initial weights) are off on this server: no data root is configured; {_how_to_allow(path)}"
    if not path.startswith("/"):
        return f"path '{path}' must be absolute (the worker's working folder is not yours)"
    if ".." in PurePosixPath(path).parts:
        return f"path '{path}' must not contain '..'"
    normalized = PurePosixPath(os.path.normpath(path))
    if not any(_under(normalized, PurePosixPath(os.path.normpath(root))) for root in roots):
        return f"path '{path}' is outside the data roots ({', '.join(roots)}); {_how_to_allow(path)}"
    return None


def resolve_confined(path: str, roots: list[str]) -> Path:
    """The real path of `path` on this worker, when it exists and lies under a root's real path.

    Raises PermissionError (outside every root, also through a symlink) or FileNotFoundError.
    """
    problem = check_submitted_path(path, roots)
    if problem:
        raise PermissionError(problem)
    try:
        real = Path(path).resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"path '{path}' does not exist on this worker") from None
    real_roots = [Path(root).resolve() for root in roots]
    if not any(real == root or root in real.parents for root in real_roots):
        raise PermissionError(f"path '{path}' leads outside the data roots ({', '.join(roots)}) through a symlink")
    return real
