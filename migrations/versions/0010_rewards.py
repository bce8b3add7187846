"""Rewards of rollouts posted without one (issue 34): per run and per rollout version the
rollouts awaiting a reward lease, in a live one, scored, and the expiries of reward leases; per
run the summed time from ingest to score; and the reward-latency histogram.

Revision ID: 0010_rewards
Revises: 0009_rewind
Create Date: 2025-08-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_rewards"
down_revision: str | Sequence[str] | None = "0009_rewind"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TOTALS_TABLES = ("run_totals", "version_totals")
TOTALS_COLUMNS = ("rewards_awaiting", "rewards_leased", "rewards_scored", "rewards_timed_out")


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def upgrade() -> None:
    for table in TOTALS_TABLES:
        for name in TOTALS_COLUMNS:
            op.add_column(table, _count(name))
    op.add_column("run_totals", _count("reward_wait_ms"))
    op.create_table(
        "reward_latency_counts",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("bound_ms", sa.BigInteger(), nullable=False),
        _count("scores"),
        sa.PrimaryKeyConstraint("run_id", "bound_ms", name=op.f("pk_reward_latency_counts")),
    )


def downgrade() -> None:
    op.drop_table("reward_latency_counts")
    op.drop_column("run_totals", "reward_wait_ms")
    for table in reversed(TOTALS_TABLES):
        for name in reversed(TOTALS_COLUMNS):
            op.drop_column(table, name)
