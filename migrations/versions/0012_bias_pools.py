"""The length and reward bias of what a run trains on, and difficulty pools (issue 36): per run
the log-spaced histograms of trained-token lengths of the rollouts received and of the samples
consumed (app/accounting/bias.py), the rewards of both (count and sum); each prompt's newest
group mean reward (its pool is judged from it and the run's thresholds); and prompt passes
skipped, a final state beside done and failed.

Revision ID: 0012_bias_pools
Revises: 0011_generators
Create Date: 2025-08-29 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_bias_pools"
down_revision: str | Sequence[str] | None = "0011_generators"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUN_COUNTS = ("reward_generated_n", "reward_trained_n", "prompts_skipped")
RUN_SUMS = ("reward_generated_sum", "reward_trained_sum")
OLD_STATES = "state IN ('queued', 'in_flight', 'done', 'failed')"
NEW_STATES = "state IN ('queued', 'in_flight', 'done', 'failed', 'skipped')"


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def upgrade() -> None:
    for name in RUN_COUNTS:
        op.add_column("run_totals", _count(name))
    for name in RUN_SUMS:
        op.add_column(
            "run_totals", sa.Column(name, sa.Double(), server_default="0", nullable=False)
        )
    op.create_table(
        "length_counts",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("side", sa.Text(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        _count("rollouts"),
        sa.CheckConstraint("side IN ('generated', 'trained')", name=op.f("ck_length_counts_side")),
        sa.PrimaryKeyConstraint("run_id", "side", "bucket", name=op.f("pk_length_counts")),
    )
    op.create_table(
        "prompt_means",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("prompt_id", sa.Text(collation="C"), nullable=False),
        sa.Column("mean", sa.Double(), nullable=False),
        _count("groups"),
        sa.Column("event_ms", sa.BigInteger(), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "prompt_id", name=op.f("pk_prompt_means")),
    )
    op.drop_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", type_="check")
    op.create_check_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", NEW_STATES)


def downgrade() -> None:
    op.execute("UPDATE prompt_passes SET state = 'done' WHERE state = 'skipped'")
    op.drop_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", type_="check")
    op.create_check_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", OLD_STATES)
    op.drop_table("prompt_means")
    op.drop_table("length_counts")
    for name in reversed(RUN_SUMS):
        op.drop_column("run_totals", name)
    for name in reversed(RUN_COUNTS):
        op.drop_column("run_totals", name)
