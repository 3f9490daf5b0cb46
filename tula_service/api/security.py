"""HTTP hardening for a server a team shares: the Host names it answers to, and the headers on every response.

Host allowlist (DNS rebinding). A page on evil.example can point evil.example at 127.0.0.1 once the
browser has loaded it, then read this server's answers as its own origin: a loopback server with no
token is open to any web page its user visits. The browser still sends `Host: evil.example`, so the
server answers only the names it is reached by: the address it is bound to, localhost, 127.0.0.1 and
[::1], plus the ones the operator names (`tula serve --allowed-host`, or TULA_ALLOWED_HOSTS,
comma-separated). Starlette's TrustedHostMiddleware decides (exact names, `*.example.com`, or `*` for
any host); a refusal is a 400 problem naming the Host and how to allow it.

Security headers. The dashboard's pages load only their own files (no inline script or style, no
CDN), so the Content-Security-Policy allows scripts and styles from this server alone. A response that
sets its own policy keeps it: the job page and ReDoc allow inline styles (plotly.js and ReDoc style
their elements from script), and Swagger UI allows its inline start-up script by its hash.
`frame-ancestors 'none'` and `X-Frame-Options: DENY` keep every page out of other sites' frames
(clickjacking), `nosniff` keeps a JSON answer from being run as a script, and `no-referrer` keeps job
ids out of other sites' logs.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from collections.abc import Iterable

from starlette.datastructures import MutableHeaders
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tula_service.problems import problem_response
from tula_service.settings import ALLOWED_HOSTS_ENV, environment

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# What Starlette's TestClient sends: an app built in-process (tests, embedding) answers it too;
# `tula serve` replaces this list with the bound address and the loopback names.
IN_PROCESS_ALLOWED_HOSTS = (*LOOPBACK_HOSTS, "testserver")
HOST_NOT_ALLOWED = "host-not-allowed"
SHOWN_HOST_MAX_CHARS = 100

CSP_DIRECTIVES = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self' data:",
    "font-src": "'self'",
    "connect-src": "'self'",
    "worker-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}
STATIC_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).version
    except ValueError:
        return None


def host_pattern(host: str) -> str:
    """A host as it appears in a Host header: IPv6 literals in brackets, names in lower case."""
    host = host.strip().lower()
    return f"[{host.strip('[]')}]" if _ip_version(host) == 6 else host


def allowed_hosts_from_env() -> list[str]:
    return environment().allowed_hosts


def served_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The bound address, the loopback names, then `extra`; each once, in that order."""
    hosts = [host_pattern(bind_host), *LOOPBACK_HOSTS, *(host_pattern(h) for h in extra)]
    return tuple(dict.fromkeys(hosts))


def host_pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be an allowed host (TrustedHostMiddleware's rules), or None."""
    if pattern == "*" or _ip_version(pattern) is not None:
        return None
    if "*" in pattern[1:] or (pattern.startswith("*") and not pattern.startswith("*.")):
        return f"'{pattern}': a wildcard is only '*' or a leading '*.' as in '*.example.com'"
    if re.fullmatch(r"[^\[\]]+:\d+|\[[^\]]+\]:\d+", pattern):
        return f"'{pattern}': give the host without its port (the port does not matter)"
    if "/" in pattern:
        return f"'{pattern}': give a host name or address, not a URL"
    return None


def content_security_policy(script_hashes: Iterable[str] = (), inline_styles: bool = False,
                            worker_src: str | None = None) -> str:
    """The default policy, plus inline scripts with these hashes, inline styles, or workers from `worker_src`."""
    directives = dict(CSP_DIRECTIVES)
    hashes = [f"'{digest}'" for digest in script_hashes]
    if hashes:
        directives["script-src"] = " ".join([directives["script-src"], *hashes])
    if inline_styles:
        directives["style-src"] += " 'unsafe-inline'"
    if worker_src:
        directives["worker-src"] = worker_src
    return "; ".join(f"{name} {value}" for name, value in directives.items())


def inline_script_hashes(html: str) -> list[str]:
    """CSP source hashes ('sha256-...') of the page's inline <script> blocks."""
    return [
        "sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        for body in INLINE_SCRIPT.findall(html)
    ]


DEFAULT_CSP = content_security_policy()


class HostAllowlist:
    """Starlette's TrustedHostMiddleware decides whether the Host is allowed; a refusal is a 400 problem."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str]):
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)
        self._check = TrustedHostMiddleware(self._mark_allowed, allowed_hosts=self.allowed_hosts, www_redirect=False)

    @staticmethod
    async def _mark_allowed(scope: Scope, receive: Receive, send: Send) -> None:
        scope["tula.host_allowed"] = True

    @staticmethod
    async def _discard(message: Message) -> None:
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self._check(scope, receive, self._discard)  # its own plain-text refusal goes nowhere
        if scope.pop("tula.host_allowed", False):
            await self.app(scope, receive, send)
            return
        await self._refusal(scope)(scope, receive, send)

    def _refusal(self, scope: Scope):
        host = next((value.decode("latin-1") for name, value in scope.get("headers") or () if name == b"host"), None)
        shown = "no Host header" if host is None else f"Host '{host[:SHOWN_HOST_MAX_CHARS]}'"
        detail = (
            f"{shown} is not one this server answers to (allowed: {', '.join(self.allowed_hosts)}); "
            "a request for another name can be a DNS-rebinding attack from a web page. If this is the name "
            f"the server is reached by, start it with `tula serve --allowed-host NAME` or {ALLOWED_HOSTS_ENV}=NAME"
        )
        return problem_response(400, detail, scope.get("path"), kind=HOST_NOT_ALLOWED, title="Host not allowed",
                                allowed_hosts=list(self.allowed_hosts))


class SecurityHeaders:
    """Adds the security headers to every HTTP response; one the response set itself is kept."""

    def __init__(self, app: ASGIApp, content_security_policy: str = DEFAULT_CSP):
        self.app = app
        self.headers = {"Content-Security-Policy": content_security_policy, **STATIC_SECURITY_HEADERS}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in self.headers.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
