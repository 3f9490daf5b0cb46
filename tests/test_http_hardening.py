"""Hardening for a team: the Host allowlist, the security headers, what-ifs under public reads, the
Allow header of a 405, readable messages for a body that is not JSON, and a what-if schema that says
what the API takes. Real `tula serve` processes (API only: `--executor none`) on real SQLite files."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api_fixtures import finished_job, store_for
from tests.conftest import REPO, LiveServer
from tests.handmade import spec_dict
from tula_service.api import Settings, create_app
from tula_service.api.security import host_pattern_problem, served_hosts
from tula_service.catalogs import load_gpus
from tula_service.plan.whatif import CLUSTER_OVERRIDES, PRICING_OVERRIDES, TRAINING_OVERRIDES
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.tokens import create_token

PROBLEM = "application/problem+json"
API_ONLY = ("--executor", "none")
SECURITY_HEADERS = {"x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "no-referrer"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An API-only server on a database holding one done job (reference_lr 0.1) and one queued job."""
    folder = tmp_path_factory.mktemp("hardening")
    database_url = f"sqlite:///{folder / 'tula.db'}"
    store = store_for(database_url)
    live = LiveServer(folder / "tula.db", folder / "server.log", API_ONLY)
    live.done_id = finished_job(store, training={"reference_lr": 0.1})
    live.queued_id = store.create_job(JobSpec.model_validate(spec_dict()))[0].id
    yield live.start()
    live.stop()


def _policy(response: httpx.Response) -> dict[str, str]:
    """The Content-Security-Policy as {directive: sources}."""
    return dict(d.strip().split(" ", 1) for d in response.headers["content-security-policy"].split(";"))


def _host(server: LiveServer, host: str, path: str = "/healthz") -> httpx.Response:
    return httpx.get(server.url + path, headers={"Host": host}, timeout=30)


# --- the Host allowlist ---------------------------------------------------------------------------------


def test_a_request_for_another_host_is_a_400_problem_that_names_it_and_how_to_allow_it(server):
    for path in ("/healthz", "/v1/jobs", "/", "/docs"):
        refused = _host(server, "rebound.example:8000", path)
        assert refused.status_code == 400 and refused.headers["content-type"] == PROBLEM, path
        problem = refused.json()
        assert problem["type"] == "https://tula.dev/problems/host-not-allowed" and problem["title"] == "Host not allowed"
        assert "Host 'rebound.example:8000' is not one this server answers to" in problem["detail"]
        assert "DNS-rebinding" in problem["detail"] and "--allowed-host NAME" in problem["detail"]
        assert problem["allowed_hosts"] == ["127.0.0.1", "localhost", "[::1]"]


def test_the_bound_address_and_the_loopback_names_are_answered_with_any_port(server):
    for host in ("127.0.0.1", f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST", "[::1]:8000"):
        assert _host(server, host).status_code == 200, host
    assert _host(server, "testserver").status_code == 400  # the in-process default is not `tula serve`'s


def test_allowed_host_options_add_names_and_subdomains_and_replace_the_environment(make_server):
    server = make_server(*API_ONLY, "--allowed-host", "tula.example.com", "--allowed-host", "*.team.internal",
                         env={"TULA_ALLOWED_HOSTS": "from-env.example"})  # fmt: skip
    assert _host(server, "tula.example.com").status_code == 200
    assert _host(server, "gpu-box.team.internal:8000").status_code == 200
    assert _host(server, "localhost").status_code == 200
    assert _host(server, "from-env.example").status_code == 400
    assert _host(server, "team.internal.evil.example").status_code == 400
    assert "Allowed hosts:  127.0.0.1, localhost, [::1], tula.example.com, *.team.internal" in server.log_path.read_text()


def test_allowed_hosts_come_from_the_environment_comma_separated(make_server):
    server = make_server(*API_ONLY, env={"TULA_ALLOWED_HOSTS": "tula.example.com, other.example"})
    assert _host(server, "other.example").status_code == 200 and _host(server, "tula.example.com").status_code == 200
    assert _host(server, "third.example").status_code == 400


def test_a_wildcard_allows_any_host(make_server):
    server = make_server(*API_ONLY, "--allowed-host", "*")
    assert _host(server, "anything.example").status_code == 200


def test_an_allowed_host_with_a_port_or_a_bad_wildcard_stops_the_server_at_start(tmp_path):
    for bad, message in (("tula.example.com:8000", "without its port"), ("tula.*.com", "a wildcard is only")):
        result = subprocess.run(
            [sys.executable, "-m", "tula_service", "serve", "--database-url", f"sqlite:///{tmp_path / 't.db'}",
             "--executor", "none", "--allowed-host", bad],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2 and message in result.stderr and bad in result.stderr, result.stderr


def test_an_ipv6_host_is_allowed_in_the_brackets_a_host_header_writes_it_in():
    assert served_hosts("::", ["fe80::1", "Tula.Example.COM"]) == (
        "[::]", "localhost", "127.0.0.1", "[::1]", "[fe80::1]", "tula.example.com",
    )  # fmt: skip
    assert host_pattern_problem("fe80::1") is None and "without its port" in host_pattern_problem("[fe80::1]:8000")


# --- security headers -----------------------------------------------------------------------------------


def test_every_answer_carries_the_security_headers(server):
    answers = {path: httpx.get(server.url + path, timeout=30) for path in
               ("/", "/jobs/new", f"/jobs/{server.done_id}", "/static/css/dashboard.css", "/v1/jobs", "/healthz",
                "/metrics", "/openapi.json", "/docs", "/redoc", "/v1/jobs/nope")}  # fmt: skip
    answers["host refusal"] = _host(server, "rebound.example")
    answers["405"] = httpx.put(f"{server.url}/v1/jobs", timeout=30)
    for what, response in answers.items():
        for name, value in SECURITY_HEADERS.items():
            assert response.headers.get(name) == value, (what, name)
        policy = _policy(response)
        assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'self'", what
        assert policy["script-src"].startswith("'self'") and "'unsafe-inline'" not in policy["script-src"], what
    assert answers["/v1/jobs/nope"].status_code == 404 and answers["405"].status_code == 405


def test_dashboard_pages_allow_only_this_servers_scripts_and_styles(server):
    for path in ("/", "/jobs/new"):
        response = httpx.get(server.url + path, timeout=30)
        policy = _policy(response)
        assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'", path
        assert "<script>" not in response.text and " style=" not in response.text, path
    job_page = httpx.get(f"{server.url}/jobs/{server.done_id}", timeout=30)
    assert _policy(job_page)["style-src"] == "'self' 'unsafe-inline'"  # plotly.js styles its plots


def test_an_internal_error_carries_the_security_headers_too(tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 't.db'}", executor="none", allowed_hosts=("127.0.0.1",)))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("boom")

    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500 and response.headers["content-type"] == PROBLEM
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert all(response.headers.get(name) == value for name, value in SECURITY_HEADERS.items())


# --- public reads include the what-if --------------------------------------------------------------------


def test_public_reads_let_a_what_if_through_without_a_token_but_no_write(make_server, tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tula.db'}"
    job_id = finished_job(store_for(database_url))
    _, token = create_token(make_session_factory(make_engine(database_url)), "ci")
    public = make_server(*API_ONLY, "--public-reads", database_path=tmp_path / "tula.db")
    replanned = httpx.post(f"{public.url}/v1/jobs/{job_id}/plan", json={"cluster": {"gpus_per_node": 2}}, timeout=30)
    assert replanned.status_code == 200, replanned.text
    assert max(row["devices"] for row in replanned.json()["candidates"]) == 2
    assert httpx.get(f"{public.url}/v1/jobs/{job_id}", timeout=30).status_code == 200
    for method, path in (("POST", "/v1/jobs"), ("POST", f"/v1/jobs/{job_id}/cancel"), ("DELETE", f"/v1/jobs/{job_id}"),
                         ("POST", f"/v1/jobs/{job_id}/plan/extra")):  # fmt: skip
        assert httpx.request(method, public.url + path, json=spec_dict(), timeout=30).status_code == 401, (method, path)
    with_token = httpx.post(f"{public.url}/v1/jobs", json=spec_dict(), headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert with_token.status_code == 202


def test_without_public_reads_a_what_if_needs_the_token(make_server, tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tula.db'}"
    job_id = finished_job(store_for(database_url))
    _, token = create_token(make_session_factory(make_engine(database_url)), "ci")
    private = make_server(*API_ONLY, database_path=tmp_path / "tula.db")
    assert httpx.post(f"{private.url}/v1/jobs/{job_id}/plan", json={}, timeout=30).status_code == 401
    bearer = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{private.url}/v1/jobs/{job_id}/plan", json={}, headers=bearer, timeout=30).status_code == 200


# --- 405: Allow lists every method of the path ----------------------------------------------------------------


def test_a_405_lists_every_method_the_path_has(server):
    for method, path, allow in (("PUT", f"/v1/jobs/{server.done_id}", "DELETE, GET"), ("PATCH", "/v1/jobs", "GET, POST"),
                                ("OPTIONS", f"/v1/jobs/{server.done_id}", "DELETE, GET"),
                                ("GET", f"/v1/jobs/{server.done_id}/plan", "POST")):  # fmt: skip
        response = httpx.request(method, server.url + path, timeout=30)
        assert response.status_code == 405 and response.headers["content-type"] == PROBLEM, (method, path)
        assert response.headers["allow"] == allow, (method, path)


# --- messages for a body that is not JSON ---------------------------------------------------------------------


def test_a_body_that_is_not_json_is_named_with_its_line_and_column(server):
    body = '{"model": "small_cnn",\n "batch_sizes": [8,, 16]}'
    response = httpx.post(f"{server.url}/v1/jobs", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 422 and response.headers["content-type"] == PROBLEM
    message = "request body is not valid JSON: Expecting value at line 2 column 20"
    with pytest.raises(json.JSONDecodeError, match="line 2 column 20"):  # Python's own count agrees
        json.loads(body)
    assert response.json()["detail"] == message
    assert response.json()["errors"] == [{"field": "body", "message": message, "type": "json_invalid"}]


def test_a_spec_without_a_json_content_type_says_to_send_json(server):
    spec = json.dumps(spec_dict())
    for headers, sent in (({}, "no Content-Type"), ({"Content-Type": "text/plain"}, "Content-Type: text/plain"),
                          ({"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type: application/x-www-form-urlencoded")):  # fmt: skip
        response = httpx.post(f"{server.url}/v1/jobs", content=spec, headers=headers, timeout=30)
        assert response.status_code == 422, headers
        message = f"send the job spec as JSON with Content-Type: application/json (this request had {sent})"
        assert response.json()["detail"] == message
        assert response.json()["errors"] == [{"field": "body", "message": message, "type": "content_type"}]
    what_if = httpx.post(f"{server.url}/v1/jobs/{server.done_id}/plan", content="{}", headers={"Content-Type": "text/plain"}, timeout=30)
    assert what_if.json()["detail"].startswith("send the what-if as JSON with Content-Type: application/json")
    json_type = httpx.post(f"{server.url}/v1/jobs", content=spec, headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert json_type.status_code == 202, json_type.text


def test_a_json_body_of_the_wrong_shape_keeps_the_validators_message(server):
    response = httpx.post(f"{server.url}/v1/jobs", json=[1, 2], timeout=30)
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body" and "valid dictionary" in response.json()["errors"][0]["message"]


# --- the what-if schema says what the API takes ---------------------------------------------------------------


def test_the_what_if_schema_lists_exactly_the_fields_a_what_if_may_change(server):
    schemas = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["components"]["schemas"]
    for name, fields in (("ClusterOverrides", CLUSTER_OVERRIDES), ("PricingOverrides", PRICING_OVERRIDES),
                         ("TrainingOverrides", TRAINING_OVERRIDES)):  # fmt: skip
        assert schemas[name]["additionalProperties"] is False and tuple(schemas[name]["properties"]) == fields, name
    what_if = schemas["WhatIf"]
    assert what_if["additionalProperties"] is False
    assert set(what_if["properties"]) == {"cluster", "pricing", "training", "objective", "deadline_h", "budget_usd"}
    cluster = schemas["ClusterOverrides"]["properties"]
    assert cluster["nodes"] == {"minimum": 1, "title": "Nodes", "type": "integer"}  # no null, no default: absent keeps it
    assert cluster["gpu_type"]["anyOf"][0]["enum"] == sorted(load_gpus())
    assert cluster["device_memory_gib"]["anyOf"][0] == {"exclusiveMinimum": 0, "type": "number"}
    assert what_if["properties"]["objective"]["enum"] == ["knee", "min_time", "min_cost", "deadline", "budget"]


def test_a_what_if_key_or_value_outside_the_schema_is_a_422_naming_its_field(server):
    plan_url = f"{server.url}/v1/jobs/{server.done_id}/plan"
    for body, field in (({"cluster": {"gpus": 4}}, "body.cluster.gpus"), ({"cluster": {"device_memory_source": "spec"}},
                        "body.cluster.device_memory_source"), ({"objective": "fastest"}, "body.objective"),
                        ({"cluster": {"nodes": 0}}, "body.cluster.nodes"), ({"cluster": {"gpu_type": "b200"}}, "body.cluster.gpu_type"),
                        ({"training": {"reference_lr": -1}}, "body.training.reference_lr")):  # fmt: skip
        response = httpx.post(plan_url, json=body, timeout=30)
        assert response.status_code == 422, (body, response.text)
        assert [e["field"] for e in response.json()["errors"]] == [field], body


def test_a_well_formed_what_if_that_does_not_fit_the_stored_spec_is_a_409_naming_the_field(server):
    plan_url = f"{server.url}/v1/jobs/{server.done_id}/plan"
    below = httpx.post(plan_url, json={"training": {"max_lr": 0.01}}, timeout=30)
    assert below.status_code == 409 and below.headers["content-type"] == PROBLEM
    problem = below.json()
    assert problem["type"] == "https://tula.dev/problems/what-if-does-not-fit"
    assert problem["detail"] == (f"the what-if does not fit job '{server.done_id}': its stored spec with the what-if "
                                 "applied is invalid at body.training")
    assert problem["errors"][0]["field"] == "body.training" and "below reference_lr" in problem["errors"][0]["message"]
    no_deadline = httpx.post(plan_url, json={"objective": "deadline"}, timeout=30)
    assert no_deadline.status_code == 409 and "needs deadline_h" in no_deadline.json()["errors"][0]["message"]
    assert httpx.post(plan_url, json={"objective": "deadline", "deadline_h": 1000}, timeout=30).status_code == 200


def test_a_what_if_echoes_the_fields_it_was_given(server):
    body = {"cluster": {"gpus_per_node": 2}, "training": {"reference_epochs": 12}, "deadline_h": None}
    response = httpx.post(f"{server.url}/v1/jobs/{server.done_id}/plan", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["what_if"] == body
