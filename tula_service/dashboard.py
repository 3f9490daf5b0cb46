"""The dashboard: server-rendered page shells and plain ES modules that read the `/v1` API.

The pages hold no data: the browser's JavaScript fetches jobs, recommendations and what-ifs from
`/v1` (sending the API token kept in localStorage), so `/`, `/jobs/...` and `/static/...` stay open
while `/v1` keeps its Bearer rule. plotly.js is the copy inside the installed `plotly` Python
package, served from this server with a versioned URL and a year-long cache: the dashboard works
without network access beyond this server and needs no front-end build step.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES = Jinja2Templates(directory=PACKAGE_DIR / "templates")
STATIC_DIR = PACKAGE_DIR / "static"
STATIC_PREFIX = "/static"
VENDOR_CACHE_CONTROL = "public, max-age=31536000, immutable"  # the URL names the plotly version


def plotly_js_path() -> Path:
    """plotly.min.js as shipped in the `plotly` Python package (found without importing plotly)."""
    found = importlib.util.find_spec("plotly")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError("the dashboard needs the 'plotly' package (pip install plotly): it ships plotly.js")
    return Path(next(iter(found.submodule_search_locations))) / "package_data" / "plotly.min.js"


def plotly_js_url() -> str:
    return f"{STATIC_PREFIX}/vendor/plotly-{importlib.metadata.version('plotly')}.min.js"


router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


def _page(request: Request, template: str, title: str, **context) -> HTMLResponse:
    return TEMPLATES.TemplateResponse(
        request, template, {"title": title, "plotly_js_url": plotly_js_url(), "static": STATIC_PREFIX, **context}
    )


@router.get("/")
def jobs_page(request: Request) -> HTMLResponse:
    return _page(request, "jobs.html", "Jobs")


@router.get("/jobs/new")
def new_job_page(request: Request) -> HTMLResponse:
    return _page(request, "new_job.html", "New job")


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str) -> HTMLResponse:
    return _page(request, "job.html", "Job", job_id=job_id)


def mount_dashboard(app: FastAPI) -> None:
    """The pages, plotly.js from the installed package, and the dashboard's own CSS and modules."""
    plotly_js = plotly_js_path()
    vendor_url = plotly_js_url()

    @app.get(vendor_url, include_in_schema=False)
    def plotly_bundle() -> FileResponse:
        return FileResponse(plotly_js, media_type="text/javascript", headers={"Cache-Control": VENDOR_CACHE_CONTROL})

    app.include_router(router)
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")
