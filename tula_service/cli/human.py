"""Numbers for people: three significant digits in a unit chosen for the size (--json is exact)."""

from __future__ import annotations

import math

from tula_service.units import GIB, KIB, MIB, TIB


def human_number(value: float, digits: int = 3) -> str:
    """`digits` significant digits, thousands separated, no exponent and no trailing zeros:
    22.48828125 -> 22.5, 140.4 -> 140, 40.0 -> 40, 0.006123 -> 0.00612, 12440 -> 12,440."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{round(value, decimals):,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, units: tuple[tuple[float, str], ...]) -> str:
    """value in the largest unit it reaches (the first when it reaches none), or the next one when it
    rounds up to that: 1023.9 MiB is 1 GiB, 59.99 min is 1 h."""
    index = max((i for i, (size, _) in enumerate(units) if abs(value) >= size), default=0)
    text = human_number(value / units[index][0])
    if index + 1 < len(units) and abs(float(text.replace(",", ""))) * units[index][0] >= units[index + 1][0]:
        index += 1
        text = human_number(value / units[index][0])
    return f"{text} {units[index][1]}"


def human_bytes(count: float) -> str:
    """6.5e6 -> 6.2 MiB; 2.4147e10 -> 22.5 GiB."""
    return _scaled(count, ((1, "B"), (KIB, "KiB"), (MIB, "MiB"), (GIB, "GiB"), (TIB, "TiB")))


def human_bandwidth(gbit_per_s: float) -> str:
    """In bytes per second, as datasheets give it: 12440 Gbit/s -> 1.56 TB/s."""
    return _scaled(gbit_per_s * 1e9 / 8, ((1e6, "MB/s"), (1e9, "GB/s"), (1e12, "TB/s")))


def human_duration(seconds: float) -> str:
    """0.3215 -> 322 ms; 3747 -> 1.04 h; a day and more in days."""
    if seconds == 0:
        return "0 s"
    return _scaled(seconds, ((1e-3, "ms"), (1, "s"), (60, "min"), (3600, "h"), (86400, "d")))


def human_usd(amount: float) -> str:
    """Cents, thousands separated ($1,234.57; $1.01 for 1.006); under a cent, two significant digits."""
    if 0 < abs(amount) < 0.01:
        return f"${human_number(amount, 2)}"
    return f"${amount:,.2f}"
