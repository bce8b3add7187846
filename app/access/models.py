"""The access tables: tokens (secrets stored only as SHA-256 digests, a live token's name unique)
and the audit log. They share the accounting database and its migrations
(``migrations/versions/0004_access.py``, ``0006_live_token_names.py``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from sqlalchemy import BigInteger, DateTime, Index, LargeBinary, Text, func, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base

LIVE_NAME_INDEX: Final = "uq_api_tokens_live_name"


class ApiToken(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (  # a live token's name is unique (the audit log names it)
        Index(
            LIVE_NAME_INDEX,
            "name",
            unique=True,
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    token_id: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    runs: Mapped[list[str] | None] = mapped_column(ARRAY(Text), nullable=True)
    secret_sha256: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    created_by: Mapped[str] = mapped_column(Text)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AuditEntry(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index(None, "run_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    actor: Mapped[str] = mapped_column(Text)
    token_id: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    run_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB)
    source: Mapped[str | None] = mapped_column(
        Text, unique=True, nullable=True, comment="Redis stream id the entry came from"
    )
