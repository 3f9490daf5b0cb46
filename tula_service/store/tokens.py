"""API tokens: `tula_` + 32 random bytes (URL-safe base64), shown once, stored as SHA-256 only.

A token is looked up by the SHA-256 of what the client sent, so the database never holds anything
that authenticates by itself. `prefix` (the first 12 characters, e.g. `tula_AbCdEfG`) names a token
in listings and revocation without revealing it. The functions take a SQLAlchemy `sessionmaker`
(`tula_service.store.db.make_session_factory`); the CLI calls them directly on the database, so the first
token can be created before any server trusts anyone.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import re
import secrets

from sqlalchemy import or_, select, update
from sqlalchemy.orm import sessionmaker

from tula_service.store.db import ApiToken, utcnow

TOKEN_PREFIX = "tula_"
TOKEN_RANDOM_BYTES = 32
PREFIX_CHARS = 12
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,100}")
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)  # last_used_at is written at most this often per token


class InvalidTokenName(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class TokenInfo:
    """What may be shown about a token: never the token itself."""

    id: int
    name: str
    prefix: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def of(cls, row: ApiToken) -> TokenInfo:
        return cls(id=row.id, name=row.name, prefix=row.prefix, created_at=row.created_at,
                   last_used_at=row.last_used_at, revoked_at=row.revoked_at)  # fmt: skip


def token_digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidTokenName(
            f"token name {name!r} is not valid: use 1 to 100 characters among letters, digits, '.', '_' and '-'"
        )
    return name


def create_token(sessions: sessionmaker, name: str) -> tuple[TokenInfo, str]:
    """A new token named `name`; returns its info and the plaintext, which is not stored anywhere."""
    check_name(name)
    plaintext = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_RANDOM_BYTES)
    with sessions() as session, session.begin():
        row = ApiToken(name=name, prefix=plaintext[:PREFIX_CHARS], token_sha256=token_digest(plaintext), created_at=utcnow())
        session.add(row)
        session.flush()
        info = TokenInfo.of(row)
    return info, plaintext


def list_tokens(sessions: sessionmaker, include_revoked: bool = False) -> list[TokenInfo]:
    query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    with sessions() as session:
        return [TokenInfo.of(row) for row in session.scalars(query)]


def revoke_token(sessions: sessionmaker, name_or_prefix: str) -> int:
    """Revoke every active token with this name or prefix (or this very token); returns how many."""
    matches = or_(
        ApiToken.name == name_or_prefix,
        ApiToken.prefix == name_or_prefix,
        ApiToken.token_sha256 == token_digest(name_or_prefix),
    )
    with sessions() as session, session.begin():
        result = session.execute(
            update(ApiToken).where(matches, ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
        )
        return int(result.rowcount or 0)


def any_active_token(sessions: sessionmaker) -> bool:
    with sessions() as session:
        return session.scalar(select(ApiToken.id).where(ApiToken.revoked_at.is_(None)).limit(1)) is not None


def verify_token(sessions: sessionmaker, plaintext: str) -> TokenInfo | None:
    """The active token whose SHA-256 matches `plaintext`, or None. Touches `last_used_at` at most
    once per LAST_USED_RESOLUTION, so a busy client does not cost a database write per request."""
    digest = token_digest(plaintext)
    with sessions() as session:
        row = session.scalars(
            select(ApiToken).where(ApiToken.token_sha256 == digest, ApiToken.revoked_at.is_(None))
        ).one_or_none()
        if row is None or not hmac.compare_digest(row.token_sha256, digest):
            return None
        now = utcnow()
        if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
            session.execute(update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=now))
            session.commit()
            return dataclasses.replace(TokenInfo.of(row), last_used_at=now)
        return TokenInfo.of(row)
