"""Prompt passes cancelled when their run closes: a final state of the prompt ledger beside done,
failed and skipped, and its count per run.

Revision ID: 0014_cancelled_passes
Revises: 0013_consumers
Create Date: 2026-12-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_cancelled_passes"
down_revision: str | Sequence[str] | None = "0013_consumers"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = "state IN ('queued', 'in_flight', 'done', 'failed', 'skipped')"
NEW_STATES = "state IN ('queued', 'in_flight', 'done', 'failed', 'skipped', 'cancelled')"


def upgrade() -> None:
    op.add_column(
        "run_totals",
        sa.Column("prompts_cancelled", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.drop_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", type_="check")
    op.create_check_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", NEW_STATES)


def downgrade() -> None:
    # The closest earlier state: the pass is over without generation, as a skipped one is.
    op.execute("UPDATE prompt_passes SET state = 'skipped' WHERE state = 'cancelled'")
    op.execute("UPDATE run_totals SET prompts_skipped = prompts_skipped + prompts_cancelled")
    op.drop_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", type_="check")
    op.create_check_constraint(op.f("ck_prompt_passes_state"), "prompt_passes", OLD_STATES)
    op.drop_column("run_totals", "prompts_cancelled")
