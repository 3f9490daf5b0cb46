"""Request size limit: bodies over `max_bytes` get a 413 problem before any route reads them.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so a client cannot stream an unbounded spec.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tula_service.problems import problem_response

DEFAULT_MAX_REQUEST_BYTES = 1 * 2**20  # a job spec is a few KiB; 1 MiB leaves room for long batch lists


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, scope: Scope):
        return problem_response(
            413, f"request body is larger than the server's limit of {self.max_bytes} bytes", scope.get("path"),
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope)(scope, receive, send)
            return
        # Read the body up front (specs are small), then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        more = scope["method"] not in ("GET", "HEAD", "OPTIONS", "DELETE") or declared not in (None, b"0")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope)(scope, receive, send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
