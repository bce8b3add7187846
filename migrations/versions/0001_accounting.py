"""Accounting tables: runs, totals per run and per version, reasons, lag histogram, batch
ledger and the processed-event ids that make draining exactly-once.

Revision ID: 0001_accounting
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_accounting"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def _sum(name: str) -> sa.Column[float]:
    return sa.Column(name, sa.Double(), server_default="0", nullable=False)


def _totals() -> list[sa.Column[int] | sa.Column[float]]:
    return [
        _count("rollouts_received"),
        _count("groups_received"),
        _count("tokens_generated"),
        _count("rollouts_rejected"),
        _count("rollouts_leased"),
        _count("rollouts_acked"),
        _count("rollouts_nacked"),
        _count("rollouts_expired"),
        _count("rollouts_retired"),
        _count("tokens_consumed"),
        _count("wasted_tokens"),
        _count("lag_samples"),
        _count("lag_sum"),
        sa.Column("lag_max", sa.BigInteger(), nullable=True),
        _count("kl_tokens"),
        _sum("kl_sum"),
        sa.Column("kl_max", sa.Double(), nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_change", sa.Text(), nullable=False),
        sa.Column("event_ms", sa.BigInteger(), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_table(
        "run_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        *_totals(),
        _count("duplicates"),
        _count("batches_leased"),
        _count("batches_acked"),
        _count("batches_nacked"),
        _count("batches_expired"),
        _count("ratio_tokens"),
        _sum("ratio_sum"),
        _count("ratio_clipped"),
        _count("events_applied"),
        sa.Column("first_event_ms", sa.BigInteger(), nullable=True),
        sa.Column("last_event_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_totals")),
    )
    op.create_table(
        "version_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        *_totals(),
        sa.PrimaryKeyConstraint("run_id", "policy_version", name=op.f("pk_version_totals")),
    )
    op.create_table(
        "reason_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        _count("rollouts"),
        _count("tokens"),
        _count("unused"),
        _count("wasted_tokens"),
        sa.CheckConstraint("kind IN ('rejected', 'retired')", name=op.f("ck_reason_totals_kind")),
        sa.PrimaryKeyConstraint(
            "run_id", "policy_version", "kind", "reason", name=op.f("pk_reason_totals")
        ),
    )
    op.create_table(
        "lag_counts",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        sa.Column("lag", sa.BigInteger(), nullable=False),
        _count("samples"),
        sa.PrimaryKeyConstraint("run_id", "policy_version", "lag", name=op.f("pk_lag_counts")),
    )
    op.create_table(
        "batches",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("trainer_id", sa.Text(), nullable=True),
        sa.Column("policy_version", sa.BigInteger(), nullable=True),
        sa.Column("leased_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("nacked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("lag_mean", sa.Double(), nullable=True),
        sa.Column("lag_max", sa.BigInteger(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=True),
        sa.Column("kl_mean", sa.Double(), nullable=True),
        sa.Column("kl_max", sa.Double(), nullable=True),
        sa.Column("is_ratio_mean", sa.Double(), nullable=True),
        sa.Column("clip_fraction", sa.Double(), nullable=True),
        sa.Column("ess_fraction", sa.Double(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("event_ms", sa.BigInteger(), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('leased', 'acked', 'nacked', 'expired')",
            name=op.f("ck_batches_outcome"),
        ),
        sa.PrimaryKeyConstraint("run_id", "batch_id", name=op.f("pk_batches")),
    )
    op.create_index(
        op.f("ix_batches_run_id_event_ms_event_seq_batch_id"),
        "batches",
        ["run_id", "event_ms", "event_seq", "batch_id"],
    )
    op.create_table(
        "processed_events",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("stream_ms", sa.BigInteger(), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column(
            "applied_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "stream_ms", "stream_seq", name=op.f("pk_processed_events")
        ),
    )


def downgrade() -> None:
    op.drop_table("processed_events")
    op.drop_index(op.f("ix_batches_run_id_event_ms_event_seq_batch_id"), table_name="batches")
    op.drop_table("batches")
    op.drop_table("lag_counts")
    op.drop_table("reason_totals")
    op.drop_table("version_totals")
    op.drop_table("run_totals")
    op.drop_table("runs")
