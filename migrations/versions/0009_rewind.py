"""Rewinding the policy version: the uses a rewind gave back, per run and per rollout version
(`samples_rewound`), and when a rewind undid each acknowledged batch (`rewound_at`).

Revision ID: 0009_rewind
Revises: 0008_partials
Create Date: 2025-07-15 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_rewind"
down_revision: str | Sequence[str] | None = "0008_partials"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TOTALS_TABLES = ("run_totals", "version_totals")


def upgrade() -> None:
    for table in TOTALS_TABLES:
        op.add_column(
            table,
            sa.Column("samples_rewound", sa.BigInteger(), server_default="0", nullable=False),
        )
    op.add_column("batches", sa.Column("rewound_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "rewound_at")
    for table in reversed(TOTALS_TABLES):
        op.drop_column(table, "samples_rewound")
