"""Bearer-token authentication for `/v1`, as a pure ASGI middleware, and the listen-address guard.

Rules: while no active token exists the API is open (a fresh install on 127.0.0.1 just works).
Once one exists, every write under `/v1/` (POST, PUT, PATCH, DELETE) needs `Authorization: Bearer
<token>`, and so do reads (GET, HEAD, OPTIONS, and the what-if POST /v1/jobs/{id}/plan, which re-plans
without storing anything) unless the server runs with public reads.
`/healthz`, `/readyz`, `/metrics` and the docs stay open. A refusal is a 401 problem+json with
`WWW-Authenticate: Bearer realm="tula"` (RFC 6750).

Tokens live in the database and the CLI creates and revokes them from another process, so the
answers are cached for CACHE_TTL_S only: a new or revoked token takes effect within about a second,
and a load test costs at most one database read per second per distinct token, not one per request.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time

from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from tula_service.problems import problem_response
from tula_service.store.tokens import TokenInfo, any_active_token, token_digest, verify_token

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/v1/"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# POSTs that change nothing: a what-if re-plans a job's stored measurements and stores nothing.
READ_ONLY_POSTS = re.compile(r"/v1/jobs/[^/]+/plan")
CACHE_TTL_S = 1.0
MAX_CACHED_TOKENS = 1024
CHALLENGE = 'Bearer realm="tula"'
MISSING_TOKEN = (
    "this server requires an API token: send 'Authorization: Bearer <token>' "
    "(create one with `tula token create --name NAME`)"
)
NOT_BEARER = "the Authorization header must be 'Bearer <token>'"
INVALID_TOKEN = "invalid or revoked token"
NO_TOKEN_EXISTS = (
    "this server requires an API token but every token was revoked: "
    "create one with `tula token create --name NAME`"
)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost` reach this machine only; anything else (0.0.0.0, a LAN
    address, another host name) may be reachable from elsewhere."""
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_refusal(host: str, insecure: bool, tokens_exist: bool) -> str | None:
    """Why the server must not listen on `host`, or None when it may."""
    if insecure or tokens_exist or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host}: it is reachable from other machines and no API token exists, "
        "so anyone could submit, cancel and delete jobs. Create a token first "
        "(`tula token create --name NAME --database-url URL`), listen on 127.0.0.1, "
        "or pass --insecure to serve without authentication."
    )


def authorization_header(scope: Scope) -> str | None:
    """The raw Authorization header value, or None when absent."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class TokenAuth:
    """`require_token=True` keeps refusing when every token was revoked (for a server that may only
    listen where it is reachable because a token existed); by default no token means open."""

    def __init__(self, app: ASGIApp, sessions: sessionmaker, public_reads: bool = False, require_token: bool = False):
        self.app = app
        self.sessions = sessions
        self.public_reads = public_reads
        self.require_token = require_token
        self._tokens_exist: tuple[float, bool] | None = None  # (expires at, answer)
        self._verified: dict[str, tuple[float, TokenInfo | None]] = {}  # SHA-256 -> (expires at, answer)

    async def _any_active_token(self) -> bool:
        now = time.monotonic()
        if self._tokens_exist is None or self._tokens_exist[0] <= now:
            exists = await run_in_threadpool(any_active_token, self.sessions)
            self._tokens_exist = (now + CACHE_TTL_S, exists)
        return self._tokens_exist[1]

    async def _verify(self, plaintext: str) -> TokenInfo | None:
        now = time.monotonic()
        digest = token_digest(plaintext)
        cached = self._verified.get(digest)
        if cached is None or cached[0] <= now:
            info = await run_in_threadpool(verify_token, self.sessions, plaintext)
            if len(self._verified) >= MAX_CACHED_TOKENS:
                self._verified.clear()
            cached = self._verified[digest] = (now + CACHE_TTL_S, info)
        return cached[1]

    def _needs_token(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        if not (path.startswith(GUARDED_PREFIX) or path == GUARDED_PREFIX.rstrip("/")):
            return False
        return not (self.public_reads and self._is_read(scope.get("method", "GET"), path))

    @staticmethod
    def _is_read(method: str, path: str) -> bool:
        return method in READ_METHODS or (method == "POST" and READ_ONLY_POSTS.fullmatch(path) is not None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._needs_token(scope):
            await self.app(scope, receive, send)
            return
        try:
            refusal = await self._refusal(scope)
        except Exception as error:  # noqa: BLE001 - the database is down: say so, never let a request through
            log.exception("cannot check the API token")
            refusal = problem_response(
                503, f"cannot check the API token: the database is unavailable ({type(error).__name__})",
                scope.get("path"),
            )  # fmt: skip
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _refusal(self, scope: Scope):
        """None when the request may pass, else the 401 response."""
        if not await self._any_active_token():
            return self._unauthorized(scope, NO_TOKEN_EXISTS, CHALLENGE) if self.require_token else None
        header = authorization_header(scope)
        if header is None:
            return self._unauthorized(scope, MISSING_TOKEN, CHALLENGE)
        scheme, _, credentials = header.strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() != "bearer" or not credentials:
            return self._unauthorized(scope, NOT_BEARER, f'{CHALLENGE}, error="invalid_request"')
        info = await self._verify(credentials)
        if info is None:
            return self._unauthorized(scope, INVALID_TOKEN, f'{CHALLENGE}, error="invalid_token"')
        scope.setdefault("state", {})["api_token"] = info.name
        return None

    @staticmethod
    def _unauthorized(scope: Scope, detail: str, challenge: str):
        return problem_response(401, detail, scope.get("path"), headers={"WWW-Authenticate": challenge})
