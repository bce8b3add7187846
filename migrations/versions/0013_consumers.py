"""Consumers' figures (issue 37): per run and consumer name the items delivered to it,
acknowledged and dropped, summed from ``consumers`` events. Pending is derived when read.

Revision ID: 0013_consumers
Revises: 0012_bias_pools
Create Date: 2025-09-05 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_consumers"
down_revision: str | Sequence[str] | None = "0012_bias_pools"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "consumer_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        _count("delivered"),
        _count("acked"),
        _count("dropped"),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_consumer_totals")),
    )


def downgrade() -> None:
    op.drop_table("consumer_totals")
