"""Partial rollouts: the run's counts of partials returned, resumed and dropped, and the
response tokens of those resumed and dropped (the `partials` events).

Revision ID: 0008_partials
Revises: 0007_token_masks
Create Date: 2025-07-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_partials"
down_revision: str | Sequence[str] | None = "0007_token_masks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUN_TOTALS_COLUMNS = (
    "partials_returned",
    "partials_resumed",
    "partials_dropped",
    "partial_tokens_resumed",
    "partial_tokens_dropped",
)


def upgrade() -> None:
    for name in RUN_TOTALS_COLUMNS:
        op.add_column(
            "run_totals", sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    for name in reversed(RUN_TOTALS_COLUMNS):
        op.drop_column("run_totals", name)
