"""Job specs from YAML or JSON files (the CLI and the server's example seed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def load_spec_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a job spec is a mapping of fields, got {type(data).__name__}")
    return data
