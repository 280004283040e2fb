"""Who may use python -m engines.serve's server: the HTTP policy in front of engines/serving/server.py's routes.

A server on the user's own machine is reached by more than the user: every web page their browser opens can
send it requests. The rules, each answered with OpenAI's error JSON before any route runs:

- Host: the Host header names an allowed host (421), so a DNS-rebinding page (a name of its own that points
  at 127.0.0.1) cannot read the answers. Allowed: localhost's names at the served port, the address served
  (when it is one), and each --allow-host. Beyond loopback with a key and no names, any Host (the key guards).
  A Host list is not access control (a client writes its own Host): beyond loopback, the key is.
- Origin: a request a browser marks with an Origin must come from the page's own origin, the Host it was
  sent to (403): no other site's page can make the server generate.
- Content-Type: a POST is application/json (415). A page can send text/plain to any address without asking,
  and a JSON body so sent would otherwise be read.
- The key (--api-key-file, $TINY_GPT_API_KEY): every route but the page (GET /) and GET /health needs
  "Authorization: Bearer KEY" (401), as OpenAI's clients send it; without it /health says only its status.
- Body: at most MAX_BODY_BYTES (413), refused unread when Content-Length says so, else where it passes.
- Every answer says nosniff, may not be framed, and carries a Content-Security-Policy that lets the page run
  its own script and style (by their hashes) and talk to this server alone.
"""
import base64
import hashlib
import re
import secrets

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse

from engines.edge.cli import is_loopback


MAX_BODY_BYTES = 2**20
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
OPEN_ROUTES = ("/", "/health")  # readable without the key: the page asks for it, a monitor checks health (its status)


class Refused(Exception):
    """A request answered with OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error", code=None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def with_port(name, port):
    """A Host header as "name:port", lower case (a header without a port means port 80)."""
    name = name.lower()
    return name if ("]:" in name if name.startswith("[") else ":" in name) else f"{name}:{port}"


def allowed_hosts(host, port, allow_hosts=(), keyed=False):
    """The Host headers served, or None for any (beyond loopback, with a key and no names given)."""
    if not is_loopback(host) and not allow_hosts and keyed:
        return None
    served = [] if host in ("0.0.0.0", "::") else [f"[{host}]" if ":" in host else host]
    return {with_port(name, port) for name in (*LOOPBACK_NAMES, *served, *allow_hosts)}


def content_security_policy(page):
    """The page's policy: its own inline script and style, by their sha256, and fetches to this server only."""
    def hashes(tag):
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
                        for body in re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S))
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class HttpPolicy:
    """ASGI middleware: the module's rules around `app`. hosts: allowed_hosts(); api_key: None for none; page:
    the chat page's HTML."""

    def __init__(self, app, hosts, api_key, page):
        self.app, self.hosts, self.api_key = app, hosts, api_key
        self.headers = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                        (b"content-security-policy", content_security_policy(page).encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def secured(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).raw.extend(self.headers)
            await send(message)
        try:
            self.check(scope, Headers(scope=scope))
        except Refused as refused:
            return await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, secured)
        await self.app(scope, self.limited(receive), secured)

    def check(self, scope, headers):
        host = headers.get("host", "").lower()
        if self.hosts is not None and with_port(host, 80) not in self.hosts:
            raise Refused(f"Host {host!r} is not served here; python -m engines.serve --allow-host NAME:PORT "
                          "adds a name", status=421, code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin.lower().split("://", 1)[-1] != host:
            raise Refused(f"a request from the page of {origin!r} is refused: only this server's own page may send "
                          "requests from a browser", status=403, kind="permission_error", code="origin_not_allowed")
        wanted = f"Bearer {self.api_key}"
        scope["with_key"] = self.api_key is None or secrets.compare_digest(headers.get("authorization", "").encode(),
                                                                            wanted.encode())  # /health reads it
        if not scope["with_key"] and scope["path"] not in OPEN_ROUTES:
            raise Refused("this server needs its API key: send the header 'Authorization: Bearer KEY' (an OpenAI "
                          "client's api_key)", status=401, kind="authentication_error", code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise Refused(f"a POST's Content-Type must be application/json, got {kind or 'none'!r}", status=415)
            length = headers.get("content-length", "0")
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                raise Refused(f"the body is more than {MAX_BODY_BYTES} bytes", status=413, code="body_too_large")

    def limited(self, receive):
        """receive, refusing a body that passes MAX_BODY_BYTES as it arrives (one sent without a length)."""
        seen = 0

        async def receive_limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise Refused(f"the body is more than {MAX_BODY_BYTES} bytes", status=413, code="body_too_large")
            return message
        return receive_limited
