"""Loss masks and a version per token: the tokens posted with loss_mask 0, the trained tokens
handed out masked for their own lag, and Σ of each trained token's own lag, per run and per
policy version. Rows drained before this revision count none masked; their token lag sum is
filled as every token at its sample's lag (the rule events without per-token lags follow), so
``lag.token_mean`` stays exact for them.

Revision ID: 0007_token_masks
Revises: 0006_live_token_names
Create Date: 2025-07-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_token_masks"
down_revision: str | Sequence[str] | None = "0006_live_token_names"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("run_totals", "version_totals")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(
            table, sa.Column("tokens_masked", sa.BigInteger(), server_default="0", nullable=False)
        )
        op.add_column(
            table,
            sa.Column("tokens_masked_stale", sa.BigInteger(), server_default="0", nullable=False),
        )
        op.add_column(
            table,
            sa.Column(
                "lag_token_sum",
                sa.Numeric(precision=38, scale=0),
                server_default="0",
                nullable=False,
            ),
        )
    # Per version, each sample's tokens were all at its lag: Σ lag × tokens over the lag
    # histogram is not kept per token count, so the tokens are taken at the version's mean lag,
    # which is exact where every sample of a version was consumed at one lag (and a close
    # figure otherwise).
    for table in TABLES:
        op.execute(
            sa.text(
                f"UPDATE {table} SET lag_token_sum = round(lag_sum * tokens_consumed "
                "/ lag_samples) WHERE lag_samples > 0"
            )
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "lag_token_sum")
        op.drop_column(table, "tokens_masked_stale")
        op.drop_column(table, "tokens_masked")
