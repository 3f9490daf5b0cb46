"""The API docs and the dashboard in a real browser with no network beyond the server: Debian's chromium,
headless, driven by Playwright (as tests/test_dashboard.py), against a real `tula serve` (API only) on an
SQLite file holding a job finished from hand-made measurements. Every request that leaves the server is
aborted and recorded, and so is every Content-Security-Policy violation the page reports.
"""

from __future__ import annotations

import httpx
import pytest

from tests.api_fixtures import finished_job, store_for
from tests.browser import launched_chromium
from tests.conftest import LiveServer
from tula_service.api.dashboard import DOCS_ASSETS, docs_asset_url, docs_assets_dir

playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")

pytestmark = pytest.mark.e2e

RECORD_CSP_VIOLATIONS = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation",
  (event) => window.cspViolations.push(`${event.violatedDirective} ${event.blockedURI}`));
"""
# ReDoc's sidebar shows "API docs by Redocly" with a logo from cdn.redoc.ly; the page's img-src stops
# it before any request leaves, and the docs render without it.
REDOC_LOGO_BLOCKED = "img-src https://cdn.redoc.ly/redoc/logo-mini.svg"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs-offline")
    live = LiveServer(folder / "tula.db", folder / "server.log", ("--executor", "none"))
    live.done_id = finished_job(store_for(live.database_url))
    yield live.start()
    live.stop()


@pytest.fixture(scope="module")
def browser():
    yield from launched_chromium()


class OfflineTab:
    """A page that may reach the server and nothing else; it records what it tried beyond it."""

    def __init__(self, browser, server: LiveServer):
        self.context = browser.new_context()
        self.context.add_init_script(RECORD_CSP_VIOLATIONS)
        self.server = server
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._only_the_server)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.set_default_timeout(30_000)

    def _only_the_server(self, route) -> None:
        url = route.request.url
        if url.startswith(self.server.url + "/") or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def open(self, path: str):
        self.page.goto(self.server.url + path)
        return self.page

    def csp_violations(self) -> list[str]:
        return self.page.evaluate("window.cspViolations")


@pytest.fixture
def tab(browser, server):
    opened = OfflineTab(browser, server)
    yield opened
    opened.context.close()


def _operations(server: LiveServer) -> list[tuple[str, str]]:
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    return sorted((method.upper(), path) for path, item in paths.items() for method in item)


def test_swagger_ui_renders_every_operation_with_no_network(tab, server):
    page = tab.open("/docs")
    page.locator(".opblock-summary-path", has_text="/v1/jobs").first.wait_for()
    blocks = page.locator(".opblock-summary")
    shown = sorted(
        (block.locator(".opblock-summary-method").inner_text().strip(), block.locator(".opblock-summary-path").inner_text().strip())
        for block in blocks.all()
    )  # fmt: skip
    assert shown == _operations(server)
    assert ("POST", "/v1/jobs/{job_id}/plan") in shown
    assert tab.outside == [] and tab.csp_violations() == [] and tab.errors == []


def test_swagger_ui_tries_an_operation_against_this_server(tab, server):
    page = tab.open("/docs")
    operation = page.locator("#operations-jobs-get_job_v1_jobs__job_id__get")
    operation.locator(".opblock-summary").click()
    operation.locator("button.try-out__btn").click()
    operation.locator("input[placeholder='job_id']").fill(server.done_id)
    operation.locator("button.execute").click()
    operation.locator(".live-responses-table .response-col_status", has_text="200").wait_for()
    assert server.done_id in operation.locator(".live-responses-table .microlight").first.inner_text()
    assert tab.outside == [] and tab.csp_violations() == [] and tab.errors == []


def test_redoc_renders_the_operations_with_no_network(tab, server):
    page = tab.open("/redoc")
    page.locator("h2", has_text="What If").wait_for()
    assert page.locator("[data-section-id^='tag/jobs/operation/']").count() == sum(
        1 for _, path in _operations(server) if path.startswith("/v1/jobs")
    )  # fmt: skip
    assert tab.outside == [] and tab.errors == []
    assert set(tab.csp_violations()) <= {REDOC_LOGO_BLOCKED}


def test_the_docs_assets_are_the_installed_package_files_with_a_long_cache(server):
    for name in DOCS_ASSETS:
        response = httpx.get(server.url + docs_asset_url(name), timeout=30)
        assert response.status_code == 200 and response.content == (docs_assets_dir() / name).read_bytes(), name
        assert "immutable" in response.headers["cache-control"], name
    for page in ("/docs", "/redoc"):
        html = httpx.get(server.url + page, timeout=30).text
        assert "http://" not in html and "https://" not in html, f"{page} links something off this server"


def test_dashboard_pages_run_under_their_content_security_policy(tab, server):
    for path, ready in (("/", f"tr[data-job-id='{server.done_id}']"), ("/jobs/new", "#job-form[data-ready='true']"),
                        (f"/jobs/{server.done_id}", "#job-result[data-plan='stored']")):  # fmt: skip
        page = tab.open(path)
        page.wait_for_selector(ready, state="attached")
        if path.startswith("/jobs/") and path != "/jobs/new":
            page.wait_for_function("document.getElementById('plot-pareto').data?.length > 0")
        assert tab.csp_violations() == [], path
    assert tab.outside == [] and tab.errors == []
