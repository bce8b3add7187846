"""Per-generator accounting (issue 35): per (run, generator) its rollouts, uses and the sums of
its measured tokens, and whether it is quarantined; and the β of the adaptive KL penalty after
the newest ack, per run and per version of the trainer.

Revision ID: 0011_generators
Revises: 0010_rewards
Create Date: 2025-08-15 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_generators"
down_revision: str | Sequence[str] | None = "0010_rewards"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KL_COEF_TABLES = ("run_totals", "training_totals")


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def _sum(name: str) -> sa.Column[float]:
    return sa.Column(name, sa.Double(), server_default="0", nullable=False)


def upgrade() -> None:
    for table in KL_COEF_TABLES:
        op.add_column(table, sa.Column("kl_coef", sa.Double(), nullable=True))
        op.add_column(table, sa.Column("kl_coef_ms", sa.BigInteger(), nullable=True))
        op.add_column(table, sa.Column("kl_coef_seq", sa.BigInteger(), nullable=True))
    op.create_table(
        "generator_totals",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("generator_id", sa.Text(), nullable=False),
        _count("rollouts"),
        _count("tokens"),
        _count("samples_consumed"),
        _count("kl_tokens"),
        _sum("kl_sum"),
        sa.Column("kl_max", sa.Double(), nullable=True),
        _count("ratio_tokens"),
        _sum("ratio_sum"),
        _count("clipped"),
        _count("zero_weight"),
        sa.Column("last_seen_ms", sa.BigInteger(), nullable=True),
        sa.Column("quarantined", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("quarantined_ms", sa.BigInteger(), nullable=True),
        sa.Column("quarantined_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "generator_id", name=op.f("pk_generator_totals")),
    )


def downgrade() -> None:
    op.drop_table("generator_totals")
    for table in reversed(KL_COEF_TABLES):
        op.drop_column(table, "kl_coef_seq")
        op.drop_column(table, "kl_coef_ms")
        op.drop_column(table, "kl_coef")
