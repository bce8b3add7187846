"""Totals per policy version of the trainer: the acknowledged batches leased at each version V
and the exact KL and importance-ratio sums of their acks (version_totals is keyed by the
version that generated the rollouts instead).

Revision ID: 0005_training_totals
Revises: 0004_access
Create Date: 2025-05-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_training_totals"
down_revision: str | Sequence[str] | None = "0004_access"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def _sum(name: str) -> sa.Column[float]:
    return sa.Column(name, sa.Double(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "training_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        _count("batches"),
        _count("samples"),
        _count("tokens"),
        _count("kl_tokens"),
        _sum("kl_sum"),
        sa.Column("kl_max", sa.Double(), nullable=True),
        _count("ratio_tokens"),
        _sum("ratio_sum"),
        _count("ratio_clipped"),
        sa.PrimaryKeyConstraint("run_id", "policy_version", name=op.f("pk_training_totals")),
    )


def downgrade() -> None:
    op.drop_table("training_totals")
