"""Catalogs kept as data in configs/: interconnect links and GPUs by name (nominal vendor figures).

`configs/interconnects.yaml` maps a name to bandwidth_gbps (per direction), latency_s, kind
(intra_node | inter_node | both) and a note on where the numbers come from. Every Link loaded from
it has source "catalog-assumed": a spec-sheet number, not a measurement.

`configs/gpus.yaml` maps a GPU name to memory_gib (as the driver reports it), an assumed
default_price_usd_per_hour, its intra_node_link (an interconnect name, or null), peak_bf16_tflops
(dense), memory_bandwidth_gbps (Gbit/s) and a note; a job spec's `cluster.gpu_type` takes its
defaults from it. Every Gpu has source "catalog-assumed" too.

Files are read once per path and cached; callers get their own dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import yaml

from models.registry import unknown_name_message

if TYPE_CHECKING:
    from tula_service.fit.perfmodel.network import Link

INTERCONNECTS_PATH = Path(__file__).resolve().parents[1] / "configs" / "interconnects.yaml"
GPUS_PATH = Path(__file__).resolve().parents[1] / "configs" / "gpus.yaml"
LINK_KINDS = ("intra_node", "inter_node", "both")
CATALOG_SOURCE = "catalog-assumed"
Entry = TypeVar("Entry")


def _load_catalog(path: str | Path, kind: str, parse_entry: Callable[[str, str, object], Entry]) -> dict[str, Entry]:
    """Every entry of a YAML catalog file (a mapping of names to entries), each checked and built by
    `parse_entry(path, name, entry)`; `kind` names an entry in the errors. Read once per file."""
    return dict(_read_catalog(str(Path(path).resolve()), kind, parse_entry))


@lru_cache(maxsize=16)
def _read_catalog(path: str, kind: str, parse_entry: Callable[[str, str, object], Entry]) -> dict[str, Entry]:
    entries = yaml.safe_load(Path(path).read_text())
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: expected a mapping of {kind} names to entries")
    return {str(name): parse_entry(path, str(name), entry) for name, entry in entries.items()}


def _named(kind: str, name: str, entries: Mapping[str, Entry]) -> Entry:
    if name not in entries:
        raise KeyError(unknown_name_message(kind, name, entries))
    return entries[name]


def load_interconnects(path: str | Path | None = None) -> dict[str, Link]:
    """Every interconnect of the catalog file (default: configs/interconnects.yaml) as a Link."""
    return _load_catalog(path or INTERCONNECTS_PATH, "interconnect", _link)


def interconnect(name: str) -> Link:
    """One link of the default catalog; KeyError naming the known links when `name` is not one."""
    return _named("interconnect", name, load_interconnects())


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _note(where: str, entry: dict) -> str:
    if not isinstance(entry.get("note"), str) or not entry["note"].strip():
        raise ValueError(f"{where}: note must say where the numbers come from")
    return entry["note"]


def _link(path: str, name: str, entry: object) -> Link:
    # Imported here: the perfmodel package loads scipy, and the CLI reads the spec (which reads this
    # module) for its choices; only building a link needs it.
    from tula_service.fit.perfmodel.network import Link

    where = f"{path}: interconnect '{name}'"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with bandwidth_gbps, latency_s, kind, note")
    for key in ("bandwidth_gbps", "latency_s"):
        if not _positive_number(entry.get(key)):
            raise ValueError(f"{where}: {key} must be a positive number, got {entry.get(key)!r}")
    if entry.get("kind") not in LINK_KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(LINK_KINDS)}, got {entry.get('kind')!r}")
    note = _note(where, entry)
    return Link(
        latency_s=float(entry["latency_s"]),
        bandwidth_gbps=float(entry["bandwidth_gbps"]),
        source=CATALOG_SOURCE,
        name=name,
        kind=entry["kind"],
        note=note,
    )


@dataclass(frozen=True)
class Gpu:
    """One GPU of the catalog: spec-sheet figures and an assumed price, never a measurement."""

    name: str
    memory_gib: float  # total device memory as the driver reports it (nvidia-smi MiB / 1024)
    default_price_usd_per_hour: float  # one provider's on-demand list price per GPU-hour (see note)
    intra_node_link: str | None  # interconnect catalog name; None when that catalog lacks the link
    peak_bf16_tflops: float | None  # dense; None without BF16 tensor cores
    memory_bandwidth_gbps: float  # Gbit/s
    note: str
    source: str = CATALOG_SOURCE


GPU_NUMBERS = ("memory_gib", "default_price_usd_per_hour", "memory_bandwidth_gbps")


def load_gpus(path: str | Path | None = None) -> dict[str, Gpu]:
    """Every GPU of the catalog file (default: configs/gpus.yaml); links are checked against the
    default interconnect catalog."""
    return _load_catalog(path or GPUS_PATH, "GPU", _gpu)


def gpu(name: str) -> Gpu:
    """One GPU of the default catalog; KeyError naming the known GPUs when `name` is not one."""
    return _named("GPU type", name, load_gpus())


def gpu_catalog_listing() -> list[dict[str, object]]:
    """The body of GET /v1/catalog/gpus: every GPU as a dict (with its source), sorted by name."""
    return [asdict(entry) for _, entry in sorted(load_gpus().items())]


def _gpu(path: str, name: str, entry: object) -> Gpu:
    where = f"{path}: GPU '{name}'"
    fields = {*GPU_NUMBERS, "intra_node_link", "peak_bf16_tflops", "note"}
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with {', '.join(sorted(fields))}")
    if set(entry) != fields:
        missing, unknown = sorted(fields - set(entry)), sorted(set(entry) - fields)
        raise ValueError(f"{where}: missing {missing or 'none'}, unexpected {unknown or 'none'} (write null if unknown)")
    for key in GPU_NUMBERS:
        if not _positive_number(entry[key]):
            raise ValueError(f"{where}: {key} must be a positive number, got {entry[key]!r}")
    bf16 = entry["peak_bf16_tflops"]
    if bf16 is not None and not _positive_number(bf16):
        raise ValueError(f"{where}: peak_bf16_tflops must be a positive number or null, got {bf16!r}")
    link = entry["intra_node_link"]
    if link is not None:
        links = load_interconnects()
        if link not in links:
            raise ValueError(f"{where}: intra_node_link: {unknown_name_message('interconnect', str(link), links)}")
        if links[link].kind == "inter_node":
            raise ValueError(f"{where}: intra_node_link '{link}' is an inter-node link")
    note = _note(where, entry)
    return Gpu(
        name=name,
        memory_gib=float(entry["memory_gib"]),
        default_price_usd_per_hour=float(entry["default_price_usd_per_hour"]),
        intra_node_link=link,
        peak_bf16_tflops=None if bf16 is None else float(bf16),
        memory_bandwidth_gbps=float(entry["memory_bandwidth_gbps"]),
        note=note,
    )
