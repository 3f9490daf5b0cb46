"""The dashboard: server-rendered page shells and plain ES modules that read the `/v1` API.

The pages hold no data: the browser's JavaScript fetches jobs, recommendations and what-ifs from
`/v1` (sending the API token kept in localStorage), so `/`, `/jobs/...` and `/static/...` stay open
while `/v1` keeps its Bearer rule. plotly.js is the copy inside the installed `plotly` Python
package, served from this server with a versioned URL and a year-long cache: the dashboard works
without network access beyond this server and needs no front-end build step.

The API docs (/docs, Swagger UI; /redoc, ReDoc) load their scripts and styles the same way, from the
installed `fastapi-offline` package (FastAPI's own pages take them from a CDN and stay blank offline).
Swagger UI starts from an inline script, which the page's Content-Security-Policy allows by its hash;
the job page and ReDoc allow inline styles, which plotly.js and ReDoc set from script (tula_service.api.security).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from tula_service.api.security import content_security_policy, inline_script_hashes
from tula_service.store.states import TERMINAL_JOB_STATES

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # tula_service/: templates/ and static/
TEMPLATES = Jinja2Templates(directory=PACKAGE_DIR / "templates")
STATIC_DIR = PACKAGE_DIR / "static"
STATIC_PREFIX = "/static"
VENDOR_CACHE_CONTROL = "public, max-age=31536000, immutable"  # the URLs name the package versions
DOCS_PACKAGE = "fastapi-offline"
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
# No online validator badge: Swagger UI would fetch it from validator.swagger.io.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}


def plotly_js_path() -> Path:
    """plotly.min.js as shipped in the `plotly` Python package (found without importing plotly)."""
    found = importlib.util.find_spec("plotly")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError("the dashboard needs the 'plotly' package (pip install plotly): it ships plotly.js")
    return Path(next(iter(found.submodule_search_locations))) / "package_data" / "plotly.min.js"


def plotly_js_url() -> str:
    return f"{STATIC_PREFIX}/vendor/plotly-{importlib.metadata.version('plotly')}.min.js"


def docs_assets_dir() -> Path:
    """The Swagger UI and ReDoc files shipped in the `fastapi-offline` package (found without importing it)."""
    found = importlib.util.find_spec("fastapi_offline")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(f"the API docs need the '{DOCS_PACKAGE}' package (pip install {DOCS_PACKAGE}): it ships Swagger UI and ReDoc")
    return Path(next(iter(found.submodule_search_locations))) / "static"


def docs_asset_url(name: str) -> str:
    return f"{STATIC_PREFIX}/vendor/docs-{importlib.metadata.version(DOCS_PACKAGE)}/{name}"


router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


def _page(request: Request, template: str, title: str, headers: dict[str, str] | None = None, **context) -> HTMLResponse:
    return TEMPLATES.TemplateResponse(
        request, template, {"title": title, "plotly_js_url": plotly_js_url(), "static": STATIC_PREFIX, **context},
        headers=headers,
    )


@router.get("/")
def jobs_page(request: Request) -> HTMLResponse:
    return _page(request, "jobs.html", "Jobs")


@router.get("/jobs/new")
def new_job_page(request: Request) -> HTMLResponse:
    return _page(request, "new_job.html", "New job")


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str) -> HTMLResponse:
    plots_csp = {"Content-Security-Policy": content_security_policy(inline_styles=True)}  # plotly.js styles its plots
    return _page(request, "job.html", "Job", headers=plots_csp, job_id=job_id,
                 terminal_states=TERMINAL_JOB_STATES)  # the job page polls until the job is in one


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: str) -> HTMLResponse:
    plots_csp = {"Content-Security-Policy": content_security_policy(inline_styles=True)}  # plotly.js styles its plots
    return _page(request, "run.html", "Run", headers=plots_csp, run_id=run_id)


def _vendor_file(path: Path):
    media_type = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}[path.suffix]

    def vendor_file() -> FileResponse:
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": VENDOR_CACHE_CONTROL})

    return vendor_file


def _with_own_csp(page: HTMLResponse, **relaxed) -> HTMLResponse:
    """The page's policy: its inline scripts allowed by their hashes, and what `relaxed` allows."""
    page.headers["Content-Security-Policy"] = content_security_policy(inline_script_hashes(page.body.decode()), **relaxed)
    return page


def mount_api_docs(app: FastAPI) -> None:
    """/docs and /redoc with their scripts and styles from this server (versioned URLs, cached a year)."""
    assets = docs_assets_dir()
    missing = [name for name in DOCS_ASSETS if not (assets / name).is_file()]
    if missing:
        raise RuntimeError(f"the '{DOCS_PACKAGE}' package lacks {', '.join(missing)} in {assets}")
    for name in DOCS_ASSETS:
        app.add_api_route(docs_asset_url(name), _vendor_file(assets / name), methods=["GET"], include_in_schema=False)

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} API", swagger_js_url=docs_asset_url("swagger-ui-bundle.js"),
            swagger_css_url=docs_asset_url("swagger-ui.css"), swagger_favicon_url=docs_asset_url("favicon.png"),
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
        )  # fmt: skip
        return _with_own_csp(page)

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=app.openapi_url, title=f"{app.title} API", redoc_js_url=docs_asset_url("redoc.standalone.js"),
            redoc_favicon_url=docs_asset_url("favicon.png"), with_google_fonts=False,
        )  # fmt: skip
        return _with_own_csp(page, inline_styles=True, worker_src="'self' blob:")  # its search runs in a blob worker


def mount_dashboard(app: FastAPI) -> None:
    """The pages, plotly.js from the installed package, and the dashboard's own CSS and modules."""
    plotly_js = plotly_js_path()
    vendor_url = plotly_js_url()

    @app.get(vendor_url, include_in_schema=False)
    def plotly_bundle() -> FileResponse:
        return FileResponse(plotly_js, media_type="text/javascript", headers={"Cache-Control": VENDOR_CACHE_CONTROL})

    app.include_router(router)
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")
