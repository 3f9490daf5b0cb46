"""Catalogs kept as data in configs/: interconnect links by name (nominal vendor figures).

`configs/interconnects.yaml` maps a name to bandwidth_gbps (per direction), latency_s, kind
(intra_node | inter_node | both) and a note on where the numbers come from. Every Link loaded from
it has source "catalog-assumed": a spec-sheet number, not a measurement. Files are read once per
path and cached; callers get their own dict.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import yaml

from models.registry import unknown_name_message
from tula_service.perfmodel.network import Link

INTERCONNECTS_PATH = Path(__file__).resolve().parents[1] / "configs" / "interconnects.yaml"
LINK_KINDS = ("intra_node", "inter_node", "both")
CATALOG_SOURCE = "catalog-assumed"


def load_interconnects(path: str | Path | None = None) -> dict[str, Link]:
    """Every interconnect of the catalog file (default: configs/interconnects.yaml) as a Link."""
    return dict(_read_interconnects(str(Path(path or INTERCONNECTS_PATH).resolve())))


def interconnect(name: str) -> Link:
    """One link of the default catalog; KeyError naming the known links when `name` is not one."""
    links = load_interconnects()
    if name not in links:
        raise KeyError(unknown_name_message("interconnect", name, links))
    return links[name]


@lru_cache(maxsize=8)
def _read_interconnects(path: str) -> dict[str, Link]:
    entries = yaml.safe_load(Path(path).read_text())
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: expected a mapping of interconnect names to entries")
    return {str(name): _link(path, str(name), entry) for name, entry in entries.items()}


def _link(path: str, name: str, entry: object) -> Link:
    where = f"{path}: interconnect '{name}'"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with bandwidth_gbps, latency_s, kind, note")
    for key in ("bandwidth_gbps", "latency_s"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    if entry.get("kind") not in LINK_KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(LINK_KINDS)}, got {entry.get('kind')!r}")
    if not isinstance(entry.get("note"), str) or not entry["note"].strip():
        raise ValueError(f"{where}: note must say where the numbers come from")
    return Link(
        latency_s=float(entry["latency_s"]),
        bandwidth_gbps=float(entry["bandwidth_gbps"]),
        source=CATALOG_SOURCE,
        name=name,
        kind=entry["kind"],
        note=entry["note"],
    )
