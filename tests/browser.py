"""Debian's chromium, headless, driven by Playwright: the browser the dashboard and docs tests share.

`make test` installs chromium at /usr/bin/chromium (Playwright's own browser download is not used).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip


def launched_chromium() -> Iterator[object]:
    """Yield a launched headless chromium (for a module-scoped `browser` fixture); fail clearly without it."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make chromium` installs Debian's chromium", pytrace=False)
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
