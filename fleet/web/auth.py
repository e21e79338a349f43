"""Who is asking: a bearer token (API clients) or a signed session cookie (the browser), and what they may do.

- `Authorization: Bearer et_…` is checked against the token store on every request; no CSRF check, since a
  browser never attaches that header by itself.
- A browser logs in by pasting a token once; it gets a session cookie (HttpOnly, SameSite=Strict, Secure when
  configured) that names the token id, carries a session id, a CSRF token and an expiry, and is signed with
  HMAC-SHA256 under the auth DB's session key. Every request re-reads the token, so revoking it ends its sessions,
  and checks the session id against the sessions ended by logging out (kept in the auth DB until they expire), so
  a copy of the cookie saved before the logout no longer works.
- CSRF, synchronizer-token pattern: the session's CSRF token is rendered into every form (and into a meta tag for
  the page's own fetch calls) and must come back as the `csrf` field or the `X-CSRF-Token` header on every POST
  that a cookie authenticates. A visitor who is not logged in gets a session without a token, so the login form
  is protected too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from fleet.tokens import TokenStore, role_allows

COOKIE = "edgetune_session"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class Session:
    id: str  # what logging out records as ended
    token_id: int | None  # None: a visitor who has not logged in
    csrf: str
    expires_at: float


@dataclass(frozen=True)
class Principal:
    role: str | None  # viewer | operator; None: anonymous
    name: str
    via: str  # bearer | session | anonymous
    session: Session | None = None

    def allows(self, role: str) -> bool:
        return role_allows(self.role, role)


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


class Auth:
    """Token checks and session cookies over one auth DB; a TokenStore per thread (SQLite connections)."""

    def __init__(self, auth_path: Path, *, session_s: float, secure_cookies: bool, anonymous_read: bool):
        self.auth_path = auth_path
        self.session_s = session_s
        self.secure_cookies = secure_cookies
        self.anonymous_read = anonymous_read
        self._local = threading.local()
        self._key = self.tokens().session_key()

    def tokens(self) -> TokenStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = TokenStore(self.auth_path)
        return store

    # ---- session cookies -----------------------------------------------------------------------------------

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())

    def encode(self, s: Session) -> str:
        payload = _b64(json.dumps({"s": s.id, "t": s.token_id, "c": s.csrf, "e": round(s.expires_at)}).encode())
        return f"{payload}.{self._sign(payload)}"

    def decode(self, cookie: str | None) -> Session | None:
        """The session in a cookie, or None when it is absent, forged, malformed or expired."""
        if not cookie or cookie.count(".") != 1:
            return None
        payload, sig = cookie.split(".")
        if not hmac.compare_digest(sig, self._sign(payload)):
            return None
        try:
            d = json.loads(_unb64(payload))
            s = Session(str(d["s"]), d["t"], d["c"], float(d["e"]))
        except (ValueError, KeyError, TypeError):
            return None
        return s if s.expires_at > time.time() else None

    def new_session(self, token_id: int | None) -> Session:
        return Session(secrets.token_urlsafe(16), token_id, secrets.token_urlsafe(24), time.time() + self.session_s)

    def end(self, s: Session) -> None:
        """Log a session out for good: its cookie, wherever a copy of it is, identifies nobody any more."""
        self.tokens().end_session(s.id, s.expires_at)

    def _session(self, request: Request) -> Session | None:
        """The request's session: its cookie decoded, unless that session was ended."""
        s = self.decode(request.cookies.get(COOKIE))
        return None if s is None or self.tokens().session_ended(s.id) else s

    def set_cookie(self, response: Response, s: Session) -> None:
        response.set_cookie(COOKIE, self.encode(s), max_age=int(self.session_s), path="/", httponly=True,
                            samesite="strict", secure=self.secure_cookies)

    # ---- who is asking -------------------------------------------------------------------------------------

    def identify(self, request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        if header:
            scheme, _, secret = header.partition(" ")
            token = self.tokens().verify(secret.strip()) if scheme.lower() == "bearer" else None
            if token is None:
                return Principal(None, "", "bearer")  # a wrong token is never upgraded by a cookie
            return Principal(token.role, token.name, "bearer")
        session = self._session(request)
        if session is not None and session.token_id is not None:
            token = self.tokens().active(session.token_id)
            if token is not None:
                return Principal(token.role, token.name, "session", session)
        return Principal("viewer" if self.anonymous_read else None, "anonymous", "anonymous", session)

    @staticmethod
    def csrf_ok(p: Principal, sent: str | None) -> bool:
        """A POST authenticated by a cookie must echo the session's CSRF token; a bearer token needs none."""
        if p.via == "bearer":
            return True
        return p.session is not None and bool(sent) and hmac.compare_digest(sent, p.session.csrf)
