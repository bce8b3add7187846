"""Prompt ledger: one row per prompt pass in its newest state, the run's prompt-pass counters
and the time long polls waited (trainers for rollouts, generators for prompts or budget).

Revision ID: 0002_prompt_passes
Revises: 0001_accounting
Create Date: 2025-02-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_prompt_passes"
down_revision: str | Sequence[str] | None = "0001_accounting"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUN_TOTALS_COLUMNS = (
    "prompts_registered",
    "prompts_queued",
    "prompts_in_flight",
    "prompts_done",
    "prompts_failed",
    "prompts_retried",
    "trainer_wait_ms",
    "generator_wait_ms",
)


def upgrade() -> None:
    op.create_table(
        "prompt_passes",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("prompt_id", sa.Text(collation="C"), nullable=False),
        sa.Column("pass", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("tries", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('queued', 'in_flight', 'done', 'failed')",
            name=op.f("ck_prompt_passes_state"),
        ),
        sa.CheckConstraint(
            '"pass" >= 1 AND attempt >= 1 AND tries >= 0',
            name=op.f("ck_prompt_passes_positive"),
        ),
        sa.PrimaryKeyConstraint("run_id", "prompt_id", "pass", name=op.f("pk_prompt_passes")),
    )
    op.create_index(
        op.f("ix_prompt_passes_run_id_state_prompt_id_pass"),
        "prompt_passes",
        ["run_id", "state", "prompt_id", "pass"],
    )
    # Adding a column with a constant default rewrites no rows (Postgres 11 and later).
    for name in RUN_TOTALS_COLUMNS:
        op.add_column(
            "run_totals", sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    for name in reversed(RUN_TOTALS_COLUMNS):
        op.drop_column("run_totals", name)
    op.drop_index(op.f("ix_prompt_passes_run_id_state_prompt_id_pass"), table_name="prompt_passes")
    op.drop_table("prompt_passes")
