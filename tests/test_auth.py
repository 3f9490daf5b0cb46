"""API tokens: created by the CLI, stored as SHA-256 only, required by the server once one exists."""

import asyncio
import hashlib
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import create_engine, text
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.conftest import REPO, free_port
from tests.handmade import spec_dict
from tula_service.api.auth import CACHE_TTL_S, TokenAuth, is_loopback, listen_refusal
from tula_service.client import TulaClient, TulaError
from tula_service.store.db import make_engine, make_session_factory, normalized_url
from tula_service.store.tokens import (
    InvalidTokenName,
    any_active_token,
    create_token,
    list_tokens,
    revoke_token,
    verify_token,
)

API_ONLY = ("--executor", "none")
SETTLE_S = 10 * CACHE_TTL_S  # generous: the machine is shared; the server needs about CACHE_TTL_S


def tula(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tula_service", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


def cli_token(database_url: str, name: str = "ci") -> str:
    result = tula("token", "create", "--name", name, "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def eventually(condition, timeout_s: float = SETTLE_S):
    """Poll `condition` until it returns something truthy; the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# --- tokens on the database ------------------------------------------------------------------------


@pytest.fixture
def sessions(database_url):
    """Token storage on each backend (SQLite and PostgreSQL, from conftest's `database_url`)."""
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_a_token_is_returned_once_and_only_its_sha256_is_stored(sessions):
    info, plaintext = create_token(sessions, "ci")
    assert plaintext.startswith("tula_") and len(plaintext) > 40 and info.prefix == plaintext[:12]
    with sessions() as session:
        rows = [tuple(row) for row in session.execute(text("SELECT * FROM api_tokens"))]
    assert len(rows) == 1 and hashlib.sha256(plaintext.encode()).hexdigest() in rows[0]
    assert not any(plaintext in str(value) for value in rows[0])
    assert plaintext not in repr(list_tokens(sessions))


def test_verify_accepts_the_token_and_refuses_others(sessions):
    info, plaintext = create_token(sessions, "ci")
    verified = verify_token(sessions, plaintext)
    assert verified is not None and verified.id == info.id and verified.last_used_at is not None
    assert verify_token(sessions, plaintext + "x") is None
    assert verify_token(sessions, "tula_" + "A" * 43) is None


def test_last_used_is_written_at_most_once_a_minute(sessions):
    _, plaintext = create_token(sessions, "ci")
    first = verify_token(sessions, plaintext).last_used_at
    assert verify_token(sessions, plaintext).last_used_at == first
    assert list_tokens(sessions)[0].last_used_at == first


def test_revoke_by_name_or_prefix_counts_and_takes_the_token_out(sessions):
    ci, ci_plain = create_token(sessions, "ci")
    _, other_plain = create_token(sessions, "deploy")
    assert revoke_token(sessions, "nobody") == 0
    assert revoke_token(sessions, ci.prefix) == 1
    assert revoke_token(sessions, "ci") == 0  # already revoked
    assert verify_token(sessions, ci_plain) is None and verify_token(sessions, other_plain) is not None
    assert any_active_token(sessions)
    assert revoke_token(sessions, "deploy") == 1
    assert not any_active_token(sessions)
    assert [t.name for t in list_tokens(sessions, include_revoked=True)] == ["ci", "deploy"]
    assert list_tokens(sessions) == []


@pytest.mark.parametrize("name", ["", "has space", "semi;colon", "x" * 101, "ünï"])
def test_token_names_are_checked(sessions, name):
    with pytest.raises(InvalidTokenName, match="1 to 100 characters"):
        create_token(sessions, name)


def test_a_100_character_name_with_dots_dashes_underscores_is_fine(sessions):
    name = ("ci.build-1_" * 10)[:100]
    assert create_token(sessions, name)[0].name == name


# --- the middleware on a tiny app ------------------------------------------------------------------


class TinyApp:
    """A two-route Starlette app behind TokenAuth, called over real ASGI by httpx."""

    def __init__(self, sessions, **options):
        async def ok(request):
            return PlainTextResponse(f"ok {request.method}")

        routes = [Route("/v1/things", ok, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]), Route("/healthz", ok)]
        self.app = TokenAuth(Starlette(routes=routes), sessions=sessions, **options)

    def request(self, method: str, path: str, headers: dict | None = None) -> httpx.Response:
        async def send() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://tiny") as client:
                return await client.request(method, path, headers=headers)

        return asyncio.run(send())

    def get(self, path: str, headers: dict | None = None) -> httpx.Response:
        return self.request("GET", path, headers)

    def post(self, path: str, headers: dict | None = None) -> httpx.Response:
        return self.request("POST", path, headers)

    def __enter__(self) -> "TinyApp":
        return self

    def __exit__(self, *exc) -> None:
        pass


def tiny_app(sessions, public_reads=False, require_token=False) -> TinyApp:
    return TinyApp(sessions, public_reads=public_reads, require_token=require_token)


def test_middleware_lets_everything_through_while_no_token_exists(sessions):
    with tiny_app(sessions) as client:
        assert client.post("/v1/things").status_code == 200 and client.get("/v1/things").status_code == 200


def test_middleware_requires_the_token_for_writes_and_reads_once_one_exists(sessions):
    _, plaintext = create_token(sessions, "ci")
    with tiny_app(sessions) as client:
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
            refused = client.request(method, "/v1/things")
            assert refused.status_code == 401, method
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.headers["www-authenticate"].startswith('Bearer realm="tula"')
            assert "Authorization: Bearer <token>" in refused.json()["detail"]
            good = client.request(method, "/v1/things", headers={"Authorization": f"Bearer {plaintext}"})
            assert good.status_code == 200 and good.text == f"ok {method}"
        wrong = client.post("/v1/things", headers={"Authorization": "Bearer tula_wrong"})
        assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid or revoked token"
        basic = client.post("/v1/things", headers={"Authorization": f"Basic {plaintext}"})
        assert basic.status_code == 401 and "Bearer" in basic.json()["detail"]
        assert client.get("/healthz").status_code == 200


def test_public_reads_open_gets_but_not_writes(sessions):
    create_token(sessions, "ci")
    with tiny_app(sessions, public_reads=True) as client:
        assert client.get("/v1/things").status_code == 200
        assert client.post("/v1/things").status_code == 401


def test_tokens_created_or_revoked_elsewhere_take_effect_within_the_cache_time(sessions):
    with tiny_app(sessions) as client:
        assert client.post("/v1/things").status_code == 200  # caches "no token"
        _, plaintext = create_token(sessions, "ci")
        assert eventually(lambda: client.post("/v1/things").status_code == 401)
        bearer = {"Authorization": f"Bearer {plaintext}"}
        assert client.post("/v1/things", headers=bearer).status_code == 200  # caches "valid"
        revoke_token(sessions, "ci")
        # the revoked token is refused, and with no token left the API is open again
        assert eventually(lambda: client.post("/v1/things").status_code == 200)


def test_revoked_token_is_refused_while_another_token_exists(sessions):
    create_token(sessions, "other")
    _, plaintext = create_token(sessions, "ci")
    bearer = {"Authorization": f"Bearer {plaintext}"}
    with tiny_app(sessions) as client:
        assert client.post("/v1/things", headers=bearer).status_code == 200
        revoke_token(sessions, "ci")
        assert eventually(lambda: client.post("/v1/things", headers=bearer).status_code == 401)


def test_require_token_refuses_when_every_token_was_revoked(sessions):
    create_token(sessions, "ci")
    revoke_token(sessions, "ci")
    with tiny_app(sessions, require_token=True) as client:
        refused = client.post("/v1/things")
    assert refused.status_code == 401 and "every token was revoked" in refused.json()["detail"]


def test_an_unreachable_database_is_a_503_never_a_pass(tmp_path):
    broken = make_session_factory(make_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}", migrate=False))
    with tiny_app(broken) as client:
        response = client.post("/v1/things")
    assert response.status_code == 503 and "database" in response.json()["detail"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_token(host):
    assert is_loopback(host) and listen_refusal(host, insecure=False, tokens_exist=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "10.0.0.1", "tula.example.com"])
def test_other_hosts_need_a_token_or_insecure(host):
    message = listen_refusal(host, insecure=False, tokens_exist=False)
    assert message and host in message and "--insecure" in message and "tula token create" in message
    assert listen_refusal(host, insecure=True, tokens_exist=False) is None
    assert listen_refusal(host, insecure=False, tokens_exist=True) is None


# --- a real server ---------------------------------------------------------------------------------


def test_without_tokens_the_api_is_open(make_server, database_url):
    server = make_server(*API_ONLY, database_url=database_url)
    assert httpx.post(f"{server.url}/v1/jobs", json=spec_dict()).status_code == 202


def test_a_cli_token_guards_writes_and_reads_then_revoking_it_opens_the_api_again(make_server, database_url):
    server = make_server(*API_ONLY, database_url=database_url)
    jobs = f"{server.url}/v1/jobs"
    token = cli_token(server.database_url)
    assert eventually(lambda: httpx.post(jobs, json=spec_dict()).status_code == 401)

    missing = httpx.post(jobs, json=spec_dict())
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.headers["www-authenticate"].startswith('Bearer realm="tula"')
    assert "tula token create" in missing.json()["detail"]
    wrong = httpx.post(jobs, json=spec_dict(), headers={"Authorization": "Bearer tula_not-the-token"})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid or revoked token"
    good = httpx.post(jobs, json=spec_dict(), headers={"Authorization": f"Bearer {token}"})
    assert good.status_code == 202

    assert httpx.get(jobs).status_code == 401
    assert httpx.get(jobs, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path

    revoked = tula("token", "revoke", "ci", "--database-url", server.database_url)
    assert revoked.returncode == 0, revoked.stderr
    assert tula("token", "revoke", "ci", "--database-url", server.database_url).returncode == 2
    # no active token is left, so the API is open again; the revoked one is no longer a credential
    assert eventually(lambda: httpx.get(jobs).status_code == 200)


def test_a_revoked_token_is_refused(make_server, database_url):
    server = make_server(*API_ONLY, database_url=database_url)
    cli_token(server.database_url, "keeper")
    token = cli_token(server.database_url, "ci")
    bearer = {"Authorization": f"Bearer {token}"}
    assert eventually(lambda: httpx.get(f"{server.url}/v1/jobs", headers=bearer).status_code == 200)
    assert tula("token", "revoke", token[:12], "--database-url", server.database_url).returncode == 0
    assert eventually(lambda: httpx.get(f"{server.url}/v1/jobs", headers=bearer).status_code == 401)


def test_public_reads_serve_gets_without_a_token_but_not_writes(make_server, database_url):
    server = make_server(*API_ONLY, "--public-reads", database_url=database_url)
    cli_token(server.database_url)
    assert eventually(lambda: httpx.post(f"{server.url}/v1/jobs", json=spec_dict()).status_code == 401)
    assert httpx.get(f"{server.url}/v1/jobs").status_code == 200


def test_client_and_cli_send_the_token_and_say_how_when_it_is_missing(make_server, database_url, monkeypatch):
    server = make_server(*API_ONLY, database_url=database_url)
    token = cli_token(server.database_url)
    with TulaClient(server.url) as anonymous:
        assert eventually(lambda: _status_of(lambda: anonymous.jobs()) == 401)
    with TulaClient(server.url, token=token) as client:
        assert client.submit(spec_dict()).state == "queued"
    monkeypatch.setenv("TULA_URL", server.url)
    monkeypatch.setenv("TULA_TOKEN", token)
    with TulaClient() as from_env:
        assert from_env.jobs().total == 1

    refused = tula("status", "--server", server.url, "--token", "tula_wrong")
    assert refused.returncode == 2 and "401" in refused.stderr and "--token" in refused.stderr
    assert "TULA_TOKEN" in refused.stderr
    listed = tula("status", "--server", server.url, "--token", token)
    assert listed.returncode == 0 and "handmade" in listed.stdout


def _status_of(call) -> int:
    try:
        call()
    except TulaError as error:
        return error.status_code
    return 200


def test_token_list_never_shows_the_token_and_the_database_holds_its_sha256_only(database_url):
    token = cli_token(database_url)
    listed = tula("token", "list", "--database-url", database_url)
    as_json = tula("token", "list", "--json", "--database-url", database_url)
    assert listed.returncode == 0 and as_json.returncode == 0
    assert "ci" in listed.stdout and token[:12] in listed.stdout
    assert token not in listed.stdout + listed.stderr + as_json.stdout + as_json.stderr
    engine = create_engine(normalized_url(database_url))
    with engine.connect() as connection:
        rows = [tuple(row) for row in connection.execute(text("SELECT * FROM api_tokens"))]
    engine.dispose()
    assert len(rows) == 1 and hashlib.sha256(token.encode()).hexdigest() in rows[0]
    assert not any(token in str(value) for value in rows[0])


def test_token_create_prints_the_token_once_and_refuses_bad_names(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tula.db'}"
    created = tula("token", "create", "--name", "ci", "--database-url", database_url)
    assert created.returncode == 0 and created.stdout.count("tula_") == 1 and "only this once" in created.stderr
    bad = tula("token", "create", "--name", "no spaces", "--database-url", database_url)
    assert bad.returncode == 2 and "is not valid" in bad.stderr


def test_serve_refuses_a_non_loopback_address_without_a_token(database_url):
    result = tula("serve", "--host", "0.0.0.0", "--port", str(free_port()), *API_ONLY,
                  "--database-url", database_url, timeout_s=60)  # fmt: skip
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0" in result.stderr and "--insecure" in result.stderr


def test_serve_listens_on_all_interfaces_once_a_token_exists(make_server, database_url):
    cli_token(database_url)
    server = make_server("--host", "0.0.0.0", *API_ONLY, database_url=database_url)
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert httpx.post(f"{server.url}/v1/jobs", json=spec_dict()).status_code == 401


def test_serve_listens_on_all_interfaces_with_insecure(make_server):
    server = make_server("--host", "0.0.0.0", "--insecure", *API_ONLY)
    assert httpx.post(f"{server.url}/v1/jobs", json=spec_dict()).status_code == 202
