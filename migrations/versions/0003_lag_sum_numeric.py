"""Lag sums as exact numerics: a run's Σ lag over its samples can pass 2^63 (lags go up to
2^53 when max_staleness does), and a BIGINT there made an accepted ack's event impossible to
apply.

Revision ID: 0003_lag_sum_numeric
Revises: 0002_prompt_passes
Create Date: 2025-03-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_lag_sum_numeric"
down_revision: str | Sequence[str] | None = "0002_prompt_passes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("run_totals", "version_totals")


def upgrade() -> None:
    for table in TABLES:
        op.alter_column(
            table,
            "lag_sum",
            type_=sa.Numeric(precision=38, scale=0),
            existing_type=sa.BigInteger(),
            existing_nullable=False,
            existing_server_default="0",
            postgresql_using="lag_sum::numeric(38, 0)",
        )


def downgrade() -> None:
    for table in TABLES:
        op.alter_column(
            table,
            "lag_sum",
            type_=sa.BigInteger(),
            existing_type=sa.Numeric(precision=38, scale=0),
            existing_nullable=False,
            existing_server_default="0",
            postgresql_using="lag_sum::bigint",
        )
