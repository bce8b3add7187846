"""Access control: bearer tokens (their secrets only as SHA-256 digests) and the audit log of
operator actions.

Revision ID: 0004_access
Revises: 0003_lag_sum_numeric
Create Date: 2025-04-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004_access"
down_revision: str | Sequence[str] | None = "0003_lag_sum_numeric"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("token_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("runs", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("secret_sha256", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("token_id", name=op.f("pk_api_tokens")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("token_id", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=True),
        sa.Column("detail", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "source", sa.Text(), nullable=True, comment="Redis stream id the entry came from"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
        sa.UniqueConstraint("source", name=op.f("uq_audit_log_source")),
    )
    op.create_index(op.f("ix_audit_log_run_id_id"), "audit_log", ["run_id", "id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_log_run_id_id"), table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("api_tokens")
