"""The dashboard in a real browser: Debian's chromium, headless, driven by Playwright, against a real
`tula serve` (local executor, real profiling child processes) on an SQLite file that also holds a
job finished from hand-made measurements. The server has an API token, so every page proves that the
browser sends it.

`make test` installs chromium at /usr/bin/chromium (Playwright's own browser download is not used).
With TULA_WRITE_SCREENSHOTS=1 the tests also write docs/img/dashboard_jobs.png and dashboard_job.png.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
from sqlalchemy import update

from tests.api_fixtures import finished_job, store_for
from tests.browser import launched_chromium
from tests.conftest import REPO, LiveServer
from tests.handmade import measurement, spec_dict
from tula_service.api.dashboard import plotly_js_path, plotly_js_url
from tula_service.dispatch.dispatcher import Outcome, record_outcome
from tula_service.spec.job_spec import OPTIMIZER_NAMES, JobSpec, optimizer_setting_names
from tula_service.store.db import Job, make_engine, make_session_factory
from tula_service.store.states import TERMINAL_JOB_STATES
from tula_service.store.tokens import create_token

playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")

pytestmark = pytest.mark.e2e

LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = REPO / "docs" / "img" if os.environ.get("TULA_WRITE_SCREENSHOTS") == "1" else None
# Seconds, not minutes, per point: one warm-up and three timed iterations, capped at 0.3 s of sampling.
FAST_PROFILING = {"time_cap_s": 0.3, "warmup_iters": 1, "timed_iters": 3, "grad_iters": 2, "grad_microbatches": 2,
                  "measure_comm": False}  # fmt: skip


class Api:
    """httpx against the test server, with its token."""

    def __init__(self, server: LiveServer, token: str):
        self.url = server.url
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, path: str) -> dict:
        response = httpx.get(self.url + path, headers=self.headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=30)

    def wait(self, job_id: str, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while (job := self.get(f"/v1/jobs/{job_id}"))["state"] not in TERMINAL_JOB_STATES:
            assert time.monotonic() < deadline, f"job {job_id} still {job['state']} after {timeout_s} s"
            time.sleep(0.3)
        return job


def _noisy_finished_job(database_url: str) -> str:
    """A job whose every timing (and re-timing) scatters: its recommendation is marked unreliable."""
    store = store_for(database_url)
    job, _ = store.create_job(JobSpec.model_validate(spec_dict(name="noisy", batch_sizes=[8, 16, 32, 64])))
    slowdown = {8: 1.0, 16: 2.5, 32: 0.7, 64: 1.9}
    while (point := store.claim_next_point("handmade")) is not None:
        record = measurement(point.batch_size)
        record["iter_time"] = {**record["iter_time"], "cv": 0.8, "median_s": record["iter_time"]["median_s"] * slowdown[point.batch_size]}
        record_outcome(store, point.id, Outcome("done", record, None, False, 0.01, "handmade"))
    assert store.get_job(job.id).recommendation["reliability"]["verdict"] == "unreliable"
    return job.id


# A reference run at batch 32 logged past its target (10 epochs of 50 000 samples): |G|^2 falls as the loss does, so its
# noise scale grows along the run
REFERENCE_RUN = [{"samples": 16_000 * i, "batch": 32, "grad_sqr": 4.0 / i, "trace_sigma": 200.0, "loss": 2.3 / (1 + 0.1 * i)}
                 for i in range(1, 41)]  # fmt: skip
# a trace with a row every few epochs: two before the 10-epoch target, both short of the window's middle (7.5 epochs)
SPARSE_RUN = [{"samples": 50_000 * epoch, "batch": 32, "grad_sqr": 4.0 / epoch, "trace_sigma": 200.0} for epoch in (1, 4, 14, 20)]


def _job_planned_before_curves(database_url: str) -> str:
    """A finished job whose stored recommendation has no `curves` (and no knee index): planned by an older server."""
    store = store_for(database_url)
    job_id = finished_job(store)
    recommendation = store.get_job(job_id).recommendation
    recommendation.pop("curves")
    recommendation["knee"].pop("candidate")
    with store.session() as session, session.begin():
        session.execute(update(Job).where(Job.id == job_id).values(recommendation=recommendation))
    return job_id


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dashboard")
    database_url = f"sqlite:///{folder / 'tula.db'}"
    handmade_id = finished_job(store_for(database_url))
    noisy_id = _noisy_finished_job(database_url)  # before the server starts, so its executor never sees the points
    older_id = _job_planned_before_curves(database_url)
    trajectory_id = finished_job(store_for(database_url), training={"reference_run": {"gradient_stats": REFERENCE_RUN}})
    sparse_id = finished_job(store_for(database_url), training={"reference_run": {"gradient_stats": SPARSE_RUN}})
    with pytest.MonkeyPatch.context() as env:  # a fine-tuning job: its checkpoint lies under the server's data root
        env.setenv("TULA_DATA_ROOTS", "/nonexistent")
        weights_id = finished_job(store_for(database_url), initial_weights="/nonexistent/pretrained.pt")
    _, token = create_token(make_session_factory(make_engine(database_url)), "dashboard-tests")
    # /nonexistent is a data root, so a job reading a missing folder there is accepted and fails on the worker
    live = LiveServer(folder / "tula.db", folder / "server.log", env={"TULA_DATA_ROOTS": "/nonexistent"}).start()
    live.api = Api(live, token)
    live.token = token
    live.handmade_id = handmade_id
    live.noisy_id = noisy_id
    live.older_id = older_id
    live.trajectory_id = trajectory_id
    live.sparse_id = sparse_id
    live.weights_id = weights_id
    yield live
    live.stop()


@pytest.fixture(scope="module")
def browser():
    yield from launched_chromium()


class Tab:
    """A page in its own browser context, with the token saved, recording its requests and script errors."""

    def __init__(self, browser, server: LiveServer, viewport: dict, token: str | None):
        self.context = browser.new_context(viewport=viewport)
        if token:
            self.context.add_init_script(f"localStorage.setItem('tula.apiToken', {json.dumps(token)})")
        self.page = self.context.new_page()
        self.server = server
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.set_default_timeout(30_000)

    def open(self, path: str):
        self.page.goto(self.server.url + path)
        return self.page

    def plot_data(self, div_id: str) -> list[dict]:
        wait_until(self.page, f"document.getElementById('{div_id}').data?.length > 0")
        return self.page.evaluate(
            f"""() => document.getElementById('{div_id}').data.map((trace) => ({{
                name: trace.name, x: Array.from(trace.x || []), y: Array.from(trace.y || []),
                customdata: trace.customdata ? Array.from(trace.customdata) : null, fill: trace.fill || null}}))"""
        )

    def close(self) -> None:
        self.context.close()
        assert not self.errors, f"script errors on the page: {self.errors}"


@pytest.fixture
def tab(browser, server):
    opened = Tab(browser, server, LAPTOP, server.token)
    yield opened
    opened.close()


def trace(traces: list[dict], name: str) -> dict:
    found = [t for t in traces if t["name"] == name or t["name"].startswith(name + " (")]
    assert len(found) == 1, f"one trace named {name!r} expected, got {[t['name'] for t in traces]}"
    return found[0]


def wait_until(page, expression: str, timeout_s: float = 30.0) -> None:
    """Poll a JS expression from Python: Playwright's wait_for_function evaluates its predicate with
    eval inside the page, which the dashboard's Content-Security-Policy (no 'unsafe-eval') forbids."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"still false after {timeout_s} s: {expression}"
        page.wait_for_timeout(100)


def wait_for_plan(page, kind: str) -> None:
    wait_until(page, f"document.getElementById('job-result').dataset.plan === '{kind}'")


# --- a job submitted through the form and profiled for real ------------------------------------------


@pytest.fixture(scope="module")
def profiled_job(browser, server):
    """Submit small_cnn (batches 8, 16, 32; one node of 2 GPUs) through the form, then watch the job
    page until the job ends. Returns (job id, what the progress bar showed over time)."""
    tab = Tab(browser, server, LAPTOP, server.token)
    page = tab.open("/jobs/new")
    page.wait_for_selector("#job-form[data-ready='true']")
    page.fill("input[name=job_name]", "dashboard-form")
    page.select_option("select[name=model]", "small_cnn")
    page.select_option("select[name=dataset_name]", "synthetic_images")
    page.fill("input[name=num_samples]", "50000")
    page.fill("input[name=batch_sizes]", "8, 16, 32")
    page.fill("input[name=nodes]", "1")
    page.fill("input[name=gpus_per_node]", "2")
    page.fill("input[name=device_memory_gib]", "16")
    page.fill("input[name=price]", "2.5")
    page.fill("input[name=reference_batch]", "32")
    page.fill("input[name=reference_epochs]", "10")
    page.fill("input[name=reference_lr]", "0.05")
    page.fill("input[name=max_lr]", "0.2")
    page.click("#advanced summary")
    page.fill("textarea[name=advanced]", json.dumps({"profiling": FAST_PROFILING, "cluster": {"interconnect_gbps": 100}}))
    page.click("#submit-job")
    page.wait_for_url(lambda url: "/jobs/" in url and not url.endswith("/jobs/new"))
    job_id = page.url.rsplit("/", 1)[1]
    seen: list[tuple[int, int, str]] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        value, maximum, state = page.evaluate(
            "() => [document.getElementById('job-progress').value, document.getElementById('job-progress').max,"
            " document.getElementById('job-state').textContent]"
        )
        if state != "loading" and (not seen or seen[-1] != (value, maximum, state)):  # "loading": before the first answer
            seen.append((int(value), int(maximum), state))
        if state in TERMINAL_JOB_STATES:
            break
        time.sleep(0.25)
    tab.close()
    return job_id, seen


def test_a_job_submitted_through_the_form_shows_its_progress_until_done(server, profiled_job):
    job_id, seen = profiled_job
    job = server.api.get(f"/v1/jobs/{job_id}")
    assert job["name"] == "dashboard-form" and job["spec"]["batch_sizes"] == [8, 16, 32]
    cluster = job["spec"]["cluster"]
    assert (cluster["nodes"], cluster["gpus_per_node"], cluster["device_memory_gib"]) == (1, 2, 16)
    assert cluster["interconnect_gbps"] == 100  # the advanced JSON was merged into the form's cluster
    assert job["spec"]["profiling"]["time_cap_s"] == FAST_PROFILING["time_cap_s"]
    assert (job["spec"]["training"]["reference_lr"], job["spec"]["training"]["max_lr"]) == (0.05, 0.2)
    assert job["state"] == "done", job["error"]
    total = job["progress"]["points_total"]  # 3 planned, plus any noisy one timed again (tula_service.dispatch.reliability)
    assert seen[-1] == (total, total, "done") and total >= 3
    assert any(value < maximum for value, maximum, _ in seen), f"the bar never showed a job in progress: {seen}"
    values = [value for value, _, _ in seen]
    assert values == sorted(values), f"progress went backwards: {seen}"


def test_pareto_plot_has_one_marker_per_candidate_and_marks_the_knee(tab, server, profiled_job):
    job_id, _ = profiled_job
    rec = server.api.get(f"/v1/jobs/{job_id}/recommendation")
    page = tab.open(f"/jobs/{job_id}")
    traces = tab.plot_data("plot-pareto")
    candidates = trace(traces, "candidates")
    assert len(candidates["x"]) == len(rec["candidates"]) == 3 * 2 * 4  # batches x devices (1, 2) x accumulation
    unit_s = page.evaluate("document.getElementById('plot-pareto').layout.meta.time_unit_s")
    assert sorted(candidates["x"]) == pytest.approx(sorted(r["total_time_s"]["value"] / unit_s for r in rec["candidates"]))
    knee = trace(traces, "knee")
    knee_rows = [rec["candidates"][i] for i in rec["pareto_front"] if rec["candidates"][i]["global_batch"] == rec["knee"]["global_batch"]]
    fastest = min(knee_rows, key=lambda r: r["total_time_s"]["value"])
    assert knee["x"] == pytest.approx([fastest["total_time_s"]["value"] / unit_s])
    assert knee["y"] == pytest.approx([fastest["cost_usd"]["value"]])
    front = trace(traces, "Pareto front")
    assert len(front["x"]) == len(rec["pareto_front"])
    assert page.inner_text("#chosen-global-batch") == str(rec["chosen"]["global_batch"])
    for div in ("plot-iter-time", "plot-throughput", "plot-memory", "plot-efficiency"):
        names = [t["name"] for t in tab.plot_data(div)]
        assert any(name.startswith("measured") or name.startswith("fitted") for name in names), (div, names)
    if SCREENSHOTS:
        page.wait_for_timeout(500)
        page.screenshot(path=str(SCREENSHOTS / "dashboard_job.png"), full_page=True)


def test_what_if_with_twice_the_devices_replans_without_profiling_and_redraws(tab, server, profiled_job):
    job_id, _ = profiled_job
    profiled = server.api.get(f"/v1/jobs/{job_id}")["points"]  # 3 planned, plus any noisy one timed again
    page = tab.open(f"/jobs/{job_id}")
    wait_for_plan(page, "stored")
    before = trace(tab.plot_data("plot-pareto"), "candidates")
    devices_before = max(row[2] for row in before["customdata"])
    assert devices_before == 2
    page.fill("#what-if-form input[name=devices]", str(2 * devices_before))
    page.click("#what-if-submit")
    wait_for_plan(page, "what-if")
    after = trace(tab.plot_data("plot-pareto"), "candidates")
    assert max(row[2] for row in after["customdata"]) == 2 * devices_before
    replanned = server.api.post(f"/v1/jobs/{job_id}/plan", {"cluster": {"nodes": 2}}).json()
    assert len(after["x"]) == len(replanned["candidates"]) > len(before["x"])
    assert "devices 2 → 4" in page.inner_text("#recommendation-body")
    assert page.inner_text("[data-copy-text='CLI command']").startswith(f"tula plan {job_id} --server {server.url} --nodes 2")
    points = server.api.get(f"/v1/jobs/{job_id}")["points"]
    assert points == profiled and len(points) >= 3 and {p["state"] for p in points} == {"done"}  # no new profiling
    page.click("#what-if-reset")
    wait_for_plan(page, "stored")
    assert len(trace(tab.plot_data("plot-pareto"), "candidates")["x"]) == len(before["x"])


# --- forms and errors -----------------------------------------------------------------------------------


def test_the_form_offers_the_losses_the_dataset_takes_and_sends_the_one_chosen(tab, server):
    page = tab.open("/jobs/new")
    page.wait_for_selector("#job-form[data-ready='true']")
    page.select_option("select[name=model]", "mlp1d")
    losses = "os => os.map((o) => [o.value, o.textContent])"
    page.select_option("select[name=dataset_name]", "mnist1d")
    assert page.eval_on_selector_all("select[name=loss] option", losses) == [["", "cross_entropy (the dataset's default)"]]
    page.select_option("select[name=dataset_name]", "diabetes")  # a regression: its float targets take mse or l1
    assert page.eval_on_selector_all("select[name=loss] option", losses) == [["", "mse (the dataset's default)"], ["l1", "l1"]]
    assert page.inner_text("#loss-description").startswith("Regression: mean squared error")
    page.select_option("select[name=loss]", "l1")
    assert page.inner_text("#loss-description").startswith("Regression: mean absolute error")
    page.fill("input[name=batch_sizes]", "8, 16")
    page.fill("input[name=price]", "1")
    page.fill("input[name=reference_batch]", "16")
    page.fill("input[name=reference_epochs]", "10")
    page.click("#advanced summary")
    page.fill("textarea[name=advanced]", json.dumps({"profiling": FAST_PROFILING}))
    page.click("#submit-job")
    page.wait_for_url(lambda url: "/jobs/" in url and not url.endswith("/jobs/new"))
    spec = server.api.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}")["spec"]
    assert spec["loss"] == "l1" and spec["dataset"] == {**spec["dataset"], "name": "diabetes", "num_samples": 353}


def test_a_bad_form_value_shows_the_api_message_next_to_its_field(tab, server):
    total_before = server.api.get("/v1/jobs?limit=1")["total"]
    page = tab.open("/jobs/new")
    page.wait_for_selector("#job-form[data-ready='true']")
    page.fill("input[name=price]", "-1")
    page.click("#submit-job")
    price_error = page.locator("label[data-field='pricing.price'] [data-error-for='pricing.price']")
    price_error.wait_for(state="visible")
    assert price_error.inner_text() == "Input should be greater than 0"
    assert page.locator("label[data-field='pricing.price'].has-error input[name=price]").count() == 1
    assert page.locator(".field-error .message").count() == 1  # only the bad field is marked
    assert page.url.endswith("/jobs/new")
    assert server.api.get("/v1/jobs?limit=1")["total"] == total_before


def test_initial_weights_outside_the_data_roots_show_the_api_message_next_to_their_field(tab, server):
    """A fine-tuning checkpoint is a file the worker reads: the form sends it as initial_weights, and the API's refusal
    (outside this server's data roots) appears next to the field."""
    page = tab.open("/jobs/new")
    page.wait_for_selector("#job-form[data-ready='true']")
    page.fill("input[name=price]", "1")
    page.fill("input[name=initial_weights]", "/etc/passwd")
    page.click("#submit-job")
    error = page.locator("label[data-field='initial_weights'] [data-error-for='initial_weights']")
    error.wait_for(state="visible")
    assert "path '/etc/passwd' is outside the data roots" in error.inner_text()
    assert page.locator(".field-error .message").count() == 1 and page.url.endswith("/jobs/new")


def test_what_if_errors_from_the_api_show_next_to_their_field(tab, server):
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    page.select_option("#what-if-form select[name=pricing_kind]", "node_hour")
    page.fill("#what-if-form input[name=price]", "0")
    page.click("#what-if-submit")
    error = page.locator("#what-if-form [data-error-for='pricing.price']")
    error.wait_for(state="visible")
    assert error.inner_text() == "Input should be greater than 0"
    assert page.evaluate("document.getElementById('job-result').dataset.plan") == "stored"


def test_a_failed_job_shows_its_failing_points_and_their_errors(tab, server):
    spec = {
        "name": "dashboard-missing-folder", "model": "small_cnn",
        "dataset": {"name": "image_folder", "path": "/nonexistent/tula-dashboard-test", "num_samples": 1000},
        "batch_sizes": [8, 16], "cluster": {"nodes": 1, "gpus_per_node": 1, "device_memory_gib": 16},
        "pricing": {"kind": "gpu_hour", "price": 1.0}, "training": {"reference_batch": 16, "reference_epochs": 5},
        "profiling": FAST_PROFILING,
    }  # fmt: skip
    response = server.api.post("/v1/jobs", spec)
    assert response.status_code == 202, response.text
    job = server.api.wait(response.json()["id"])
    assert job["state"] == "failed"
    failing = [p for p in job["points"] if p["state"] == "failed"]
    assert len(failing) == 2 and all("/nonexistent/tula-dashboard-test" in p["error"] for p in failing)
    page = tab.open(f"/jobs/{job['id']}")
    page.wait_for_selector("#job-failure:not([hidden])")
    assert page.inner_text("#job-error") == job["error"]
    rows = page.locator("#failed-points tbody tr")
    assert rows.count() == 2
    for row, point in zip(rows.all(), failing):
        assert row.locator("td").first.inner_text() == f"batch {point['batch_size']}"
        assert row.locator(".point-error").inner_text() == point["error"]
    assert page.locator("#job-result").is_hidden()


# --- the pages themselves ---------------------------------------------------------------------------------


def test_plotly_comes_from_the_installed_package_with_a_long_cache(server):
    response = httpx.get(server.url + plotly_js_url(), timeout=30)
    assert response.status_code == 200
    assert response.content == plotly_js_path().read_bytes()
    assert "immutable" in response.headers["cache-control"] and "max-age=31536000" in response.headers["cache-control"]
    page = httpx.get(f"{server.url}/jobs/{server.handmade_id}", timeout=30)
    assert page.status_code == 200 and f'src="{plotly_js_url()}"' in page.text
    assert not re.search(r'(src|href)="(https?:)?//', page.text), "the page links something off this server"


def test_pages_make_no_request_beyond_this_server(tab, server):
    page = tab.open("/")
    page.wait_for_selector(f"tr[data-job-id='{server.handmade_id}']")
    tab.open("/jobs/new").wait_for_selector("#job-form[data-ready='true']")
    tab.open(f"/jobs/{server.handmade_id}")
    tab.plot_data("plot-pareto")
    assert any(url.endswith(plotly_js_url()) for url in tab.requests)
    assert any("/v1/jobs/" in url for url in tab.requests)
    outside = [url for url in tab.requests if not url.startswith(server.url + "/") and not url.startswith("data:")]
    assert not outside, f"requests beyond the server: {outside}"


def test_the_job_page_lists_the_points_it_polls_from_the_points_endpoint(tab, server):
    points = server.api.get(f"/v1/jobs/{server.handmade_id}/points")["points"]
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_until(page, f"document.querySelectorAll('#points-table tbody tr').length === {len(points)}")
    rows = [[cell.inner_text() for cell in row.locator("td").all()[:3]] for row in page.locator("#points-table tbody tr").all()]
    assert rows == [[f"batch {p['batch_size']}", "done", "1"] for p in points] and len(points) == 5
    job_url = f"{server.url}/v1/jobs/{server.handmade_id}"
    assert f"{job_url}/points?limit=500&offset=0" in tab.requests
    assert f"{job_url}?points=false" in tab.requests and job_url not in tab.requests  # no points come with the job


def test_jobs_page_lists_each_job_with_progress_and_the_recommended_batch(tab, server):
    job = server.api.get(f"/v1/jobs/{server.handmade_id}")
    page = tab.open("/")
    row = page.locator(f"tr[data-job-id='{server.handmade_id}']")
    row.wait_for()
    cells = [cell.inner_text() for cell in row.locator("td").all()]
    assert cells[:5] == ["handmade-done", "small_cnn", "synthetic_images", "1 × 1 16 GiB devices", "done"]
    bar = row.locator("progress")
    assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("5", "5")
    chosen = job["chosen"]
    assert cells[6] == f"{chosen['global_batch']} = {chosen['device_batch']} × {chosen['devices']} × {chosen['accumulation']}"
    if SCREENSHOTS:
        bottom_px = page.evaluate("Math.ceil(document.querySelector('main').getBoundingClientRect().bottom)")
        page.screenshot(path=str(SCREENSHOTS / "dashboard_jobs.png"), clip={"x": 0, "y": 0, "width": LAPTOP["width"], "height": bottom_px})


def test_every_number_in_the_recommendation_card_says_where_it_came_from(tab, server):
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    values = page.locator("#recommendation-body .facts dd")
    assert values.count() >= 12
    allowed = {"measured", "fitted", "predicted", "assumed", "spec", "catalog-assumed"}
    for value in values.all():
        badges = value.locator(".source").all()
        assert badges, f"no source on {value.inner_text()!r}"
        assert all(badge.inner_text().split(" ")[0] in allowed for badge in badges)


def test_the_run_to_measure_next_is_named_with_its_predicted_epochs(tab, server):
    """The handmade job's epochs rest on the initial weights' noise scale: the card names the run that would settle
    them (models.efficiency.next_run), as the API does."""
    run = server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")["models"]["efficiency"]["next_run"]
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    assert page.inner_text("#next-run-batch") == f"global batch {run['batch']}"
    assert "training.other_runs" in page.locator("#recommendation-body .facts dd", has=page.locator("#next-run-batch")).inner_text()


def test_an_unreliable_profile_is_a_banner_above_the_recommendation(tab, server):
    page = tab.open(f"/jobs/{server.noisy_id}")
    wait_for_plan(page, "stored")
    assert page.is_visible("#job-unreliable")
    assert page.inner_text("#job-unreliable-title") == "Unreliable: re-profile on a quiet host"
    assert "iteration-time CVs above 25%" in page.inner_text("#job-unreliable-reasons")
    clean = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(clean, "stored")
    assert not clean.is_visible("#job-unreliable")


def test_the_knee_method_is_explained_next_to_the_pick(tab, server):
    knee = server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")["knee"]
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    assert page.inner_text("#knee-method").strip() == f"{knee['method']}: {knee['method_explained']}."


def test_phone_screens_get_no_horizontal_scrolling(browser, server):
    tab = Tab(browser, server, PHONE, server.token)
    try:
        for path, ready in (("/", f"tr[data-job-id='{server.handmade_id}']"), ("/jobs/new", "#job-form[data-ready='true']"),
                            (f"/jobs/{server.handmade_id}", "#job-result[data-plan='stored']")):  # fmt: skip
            page = tab.open(path)
            page.wait_for_selector(ready, state="attached")
            page.wait_for_timeout(300)
            scroll_width, inner_width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert scroll_width <= inner_width, f"{path}: {scroll_width} px of content in a {inner_width} px screen"
    finally:
        tab.close()


def test_without_a_token_the_page_says_so_and_a_saved_token_loads_the_jobs(browser, server):
    tab = Tab(browser, server, LAPTOP, token=None)
    try:
        page = tab.open("/")
        banner = page.locator("#banner")
        banner.wait_for(state="visible")
        assert "This server needs an API token" in banner.inner_text()
        assert page.locator("#token-box").get_attribute("open") is not None
        page.fill("#token-input", server.token)
        page.click("#token-form button[type=submit]")
        page.locator(f"tr[data-job-id='{server.handmade_id}']").wait_for()
        banner.wait_for(state="hidden")
        assert page.evaluate("localStorage.getItem('tula.apiToken')") == server.token
    finally:
        tab.close()


def test_copy_buttons_copy_the_json_and_the_cli_command(tab, server):
    tab.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    page.click("#copy-json")
    copied = json.loads(page.evaluate("navigator.clipboard.readText()"))
    assert copied == server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")
    page.click("#copy-cli")
    assert page.evaluate("navigator.clipboard.readText()") == f"tula show {server.handmade_id} --server {server.url}"


def test_the_ags_snippet_scales_the_update_when_variability_is_below_delta(tab, server):
    torch = pytest.importorskip("torch")
    rec = server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    snippet = page.locator("[data-copy-text='Python (AGS)']").text_content()
    namespace: dict = {}
    exec(compile(snippet, "ags_snippet.py", "exec"), namespace)  # noqa: S102 - the snippet the page offers
    ags_config = rec["training_advice"]["ags"]
    assert namespace["AGS_CONFIG"] == {"delta": ags_config["delta"]["value"], "s": ags_config["s"]["value"]}
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = namespace["AdaptiveGradientScaler"].wrap(torch.optim.SGD([weight], lr=0.1), {"delta": 0.5, "s": 2.0})
    steps = []
    for gradient in ([1.0, 0.0, 0.0], [1.1, 0.0, 0.0], [5.0, 0.0, 0.0]):  # variability: none yet, 0.1, 3.5
        before = weight.detach().clone()
        weight.grad = torch.tensor(gradient)
        optimizer.step()
        steps.append((optimizer.last_decision.scaled, float((before - weight.detach())[0])))
    assert [scaled for scaled, _ in steps] == [False, True, False]
    assert [moved for _, moved in steps] == pytest.approx([0.1, 2.0 * 0.1 * 1.1, 0.1 * 5.0])
    line = next(line for line in snippet.splitlines() if line.startswith("# optimizer = torch.optim."))
    built = eval(line.removeprefix("# optimizer = "), {"torch": torch, "model": torch.nn.Linear(2, 1), "REFERENCE_LR": 0.1, **namespace})  # noqa: S307
    settings = rec["training_advice"]["lr_rule"]["optimizer_settings"]  # the optimizer the plan is for, with its settings
    assert settings and {name: built.param_groups[0][name] for name in settings} == {name: s["value"] for name, s in settings.items()}


def test_the_snippets_optimizer_line_builds_every_optimizer_the_spec_takes_with_its_settings(tab, server):
    """recommendation.js's optimizerLine for each training.optimizer, with every setting the spec has for it given (not
    its default), evaluated by Python: the torch optimizer it builds carries those settings."""
    torch = pytest.importorskip("torch")
    given = {"momentum": 0.5, "nesterov": True, "dampening": 0.0, "betas": [0.8, 0.95], "eps": 1e-6, "alpha": 0.9, "centered": True,
             "amsgrad": True, "momentum_decay": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.05}  # fmt: skip
    cases = [(optimizer, given) for optimizer in OPTIMIZER_NAMES] + [("sgd", {**given, "nesterov": False, "dampening": 0.3})]  # torch: not both
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    for optimizer, given in cases:
        training = {"reference_batch": 32, "reference_epochs": 3, "optimizer": optimizer, **{name: given[name] for name in optimizer_setting_names(optimizer)}}
        settings = JobSpec.model_validate(spec_dict(training=training)).training.optimizer_settings()
        line = page.evaluate("async (lr) => (await import('/static/js/recommendation.js')).optimizerLine(lr)",
                             {"optimizer": optimizer, "optimizer_settings": settings})  # fmt: skip
        built = eval(line, {"torch": torch, "model": torch.nn.Linear(2, 1), "REFERENCE_LR": 0.1, "LR_MULTIPLIER": 2.0})  # noqa: S307
        group = built.param_groups[0]
        assert type(built).__name__ == OPTIMIZER_NAMES[optimizer] and group["lr"] == pytest.approx(0.2), line
        assert {name: list(group[name]) if name == "betas" else group[name] for name in settings} == {name: given[name] for name in settings}, line


def test_the_model_curves_drawn_are_the_ones_the_server_evaluated(tab, server):
    curves = server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")["curves"]
    page = tab.open(f"/jobs/{server.handmade_id}")
    wait_for_plan(page, "stored")
    iter_time, memory, epochs = curves["iter_time"], curves["memory"], curves["epochs"]
    drawn = trace(tab.plot_data("plot-iter-time"), f"fitted: {iter_time['model']}")
    assert (drawn["x"], drawn["y"]) == (iter_time["device_batch"], iter_time["iter_time_s"])
    drawn = trace(tab.plot_data("plot-throughput"), f"fitted: batch / T_comp({iter_time['model']})")
    assert (drawn["x"], drawn["y"]) == (iter_time["device_batch"], iter_time["samples_per_s"])
    memory_traces = tab.plot_data("plot-memory")
    drawn = trace(memory_traces, "fitted: M(b) = static + act × b")
    assert drawn["x"] == memory["device_batch"]
    assert drawn["y"] == pytest.approx([value / 2**30 for value in memory["memory_bytes"]], rel=1e-15)
    assert memory["memory_upper_bytes"] == memory["memory_bytes"]  # hand-made points lie on their line:
    assert not [t for t in memory_traces if t["name"].startswith("95% upper bound")]  # no band to draw
    efficiency_traces = tab.plot_data("plot-efficiency")
    drawn = trace(efficiency_traces, "fitted: E(B) = E_min (1 + B / B_noise)")
    assert (drawn["x"], drawn["y"]) == (epochs["global_batch"], epochs["epochs"])
    low = trace(efficiency_traces, "80% interval, calibrated across tasks: low")
    high = trace(efficiency_traces, "80% interval")  # the band between them: the epochs' calibrated interval
    assert (low["y"], high["y"], high["fill"]) == (epochs["calibrated_low"], epochs["calibrated_high"], "tonexty")
    chosen_epochs = server.api.get(f"/v1/jobs/{server.handmade_id}/recommendation")["chosen"]["epochs"]
    assert chosen_epochs["calibrated_interval"] == [chosen_epochs["value"]] * 2  # chosen at the reference batch: closed,
    assert page.locator("dl.facts .calibrated").count() == 0  # so not shown (the run to measure next has its own range)


def test_a_sparse_trace_is_read_by_the_trend_through_the_first_record_past_the_target_and_says_so(tab, server):
    """Two rows before the target, both short of the window's middle, and the trace going on: the read is the bins'
    trend at 75% of the run, interpolated with the first row past the target, and the figure says so."""
    rec = server.api.get(f"/v1/jobs/{server.sparse_id}/recommendation")
    read = next(c for c in rec["models"]["efficiency"]["evidence"]["candidates"] if c["source"] == "reference_run")
    assert read["detail"]["records_past_target"] == 1 and not read["detail"]["extrapolated"]
    page = tab.open(f"/jobs/{server.sparse_id}")
    wait_for_plan(page, "stored")
    traces = tab.plot_data("plot-noise-trajectory")
    [measured] = [t for t in traces if t["name"].startswith("reference run: B_simple, records pooled in")]
    assert measured["x"] == pytest.approx([1.0, 4.0, 14.0])  # the row at 20 epochs is left out
    [value] = [t for t in traces if t["name"].startswith("read: ")]
    assert "(fitted; the bins' trend at 75% of the run, interpolated with the first record past the target)" in value["name"]
    assert value["y"] == pytest.approx([read["noise_scale"]] * 2)
    assert "interpolated with the first record past the target" in page.locator("#noise-trajectory-note").inner_text()
    assert not tab.errors


def test_the_noise_scale_is_drawn_along_the_reference_run_it_was_read_from(tab, server):
    rec = server.api.get(f"/v1/jobs/{server.trajectory_id}/recommendation")
    efficiency = rec["models"]["efficiency"]
    assert efficiency["evidence"]["used"] == "reference_run"
    read = next(c for c in efficiency["evidence"]["candidates"] if c["source"] == "reference_run")
    bins = read["detail"]["bins"]
    page = tab.open(f"/jobs/{server.trajectory_id}")
    wait_for_plan(page, "stored")
    traces = tab.plot_data("plot-noise-trajectory")
    [measured] = [t for t in traces if t["name"].startswith("reference run: B_simple, records pooled in")]
    assert measured["x"] == pytest.approx([samples / 50_000 for samples in bins["samples"]]) and measured["y"] == bins["noise_scale"]
    assert max(measured["x"]) <= 10  # the records up to the target (10 epochs): the run logged past it
    [value] = [t for t in traces if t["name"].startswith("read: ")]
    assert value["y"] == pytest.approx([read["noise_scale"]] * 2)
    assert value["x"] == pytest.approx([5.0, 10.0])  # over the second half of the run to the target, in epochs
    assert "(fitted; over the shaded part of the run)" in value["name"]
    [target] = [t for t in traces if t["name"].startswith("the run reaches the target")]
    assert target["x"] == [10, 10]
    assert "read from the reference run's records" in page.locator("#noise-trajectory-note").inner_text()
    assert not tab.errors
    without = tab.open(f"/jobs/{server.handmade_id}")  # read at the initial weights: no run to draw
    wait_for_plan(without, "stored")
    assert without.locator("#noise-trajectory-card").is_hidden()


def test_a_plan_stored_before_curves_were_served_draws_its_measurements(tab, server):
    rec = server.api.get(f"/v1/jobs/{server.older_id}/recommendation")
    assert "curves" not in rec
    page = tab.open(f"/jobs/{server.older_id}")
    wait_for_plan(page, "stored")
    for div in ("plot-iter-time", "plot-throughput", "plot-memory", "plot-efficiency"):
        names = [t["name"] for t in tab.plot_data(div)]
        assert not [name for name in names if name.startswith("fitted")], (div, names)
    assert len(trace(tab.plot_data("plot-pareto"), "candidates")["x"]) == len(rec["candidates"])


def test_the_job_page_polls_until_one_of_the_servers_terminal_states(server):
    page = httpx.get(f"{server.url}/jobs/{server.handmade_id}", timeout=30)
    assert f'data-terminal-states="{" ".join(TERMINAL_JOB_STATES)}"' in page.text


def test_the_run_page_draws_the_telemetry_against_the_plan_and_asks_for_advice(tab, server):
    run = server.api.post("/v1/runs", {"job_id": server.handmade_id}).json()
    batch = run["config"]["global_batch"]
    records = [{"step": s, "samples": s * batch, "wall_time_s": 0.06 * s, "step_time_s": 0.06, "lr": 0.1, "loss": 2.0 / (1 + s / 10),
                "grad_sqr": 1.0, "trace_sigma": 100.0 + s} for s in range(1, 31)]  # fmt: skip
    records[-1].update(stability_headroom=2.0, stability_lr=0.1)  # TulaRun.measure_stability: the LR cap the advice shows
    records[9]["statistics_samples"] = 8 * batch  # step 10's window: its statistics taken at step 8
    assert server.api.post(f"/v1/runs/{run['id']}/telemetry", {"records": records}).status_code == 200
    page = tab.open(f"/runs/{run['id']}")
    wait_until(page, "document.getElementById('run-header').dataset.drawn === '30'")
    traces = page.evaluate("""() => Object.fromEntries(['plot-progress', 'plot-step-time', 'plot-noise', 'plot-lr'].map(
        (id) => [id, document.getElementById(id).data.map((t) => [t.name, t.x.length])]))""")
    assert traces["plot-step-time"][0] == ["step time (measured)", 30] and traces["plot-step-time"][1][0].startswith("plan (")
    assert traces["plot-progress"][0] == ["samples seen (measured)", 30] and traces["plot-progress"][1][0].startswith("the plan's pace")
    assert traces["plot-noise"] == [["B_simple (measured)", 30], ["global batch", 30]] and traces["plot-lr"] == [["LR (reported)", 30]]
    noise_steps = page.evaluate("() => document.getElementById('plot-noise').data[0].x")
    assert noise_steps[8:11] == [9, 8, 11]  # each record where its statistics were taken
    assert f"{batch} = " in page.locator("#run-config").inner_text()
    page.locator("#run-advise").click()
    wait_until(page, "document.getElementById('run-advice').textContent.length > 20 && "
                     "!document.getElementById('run-advice').textContent.startsWith('re-planning')", timeout_s=60)
    advice = page.locator("#run-advice").inner_text()
    assert "kept" in advice or "Changed" in advice
    assert "B_noise " in advice and "from the live trajectory" in advice and "LR at most 2x the reference (stability headroom; " in advice
    assert re.search(r"B_noise [\d.,]+ \(80%: [\d.,]+-[\d.,]+\) from the live trajectory", advice), advice  # its calibrated interval
    assert "from the live trajectory (the live trajectory covers " in advice, advice  # and why that evidence


def test_a_fine_tuning_jobs_noise_scale_says_its_points_started_from_the_initial_weights(tab, server):
    """Where the profiler's own training began is part of the evidence: a checkpoint is named, a random init is not."""
    def noise_scale_text(job_id):
        page = tab.open(f"/jobs/{job_id}")
        term = page.locator("dt", has_text="Noise scale").first
        term.wait_for()
        return term.evaluate("dt => dt.nextElementSibling.querySelector('.value').textContent")

    assert "from the initialization, started from initial_weights /nonexistent/pretrained.pt" in noise_scale_text(server.weights_id)
    assert "started from" not in noise_scale_text(server.handmade_id)
