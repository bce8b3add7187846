"""A live token's name is unique: the audit log names the token that acted, and two live tokens
of one name (or one named ``bootstrap``, the name of ``BROKER_ADMIN_TOKEN``) would make it
ambiguous. A partial unique index holds the rule against concurrent creations; a revoked
token's name may be reused.

Live tokens that break the rule already are renamed ``<name>-<token_id>`` first (the oldest of a
name keeps it; every one named like a caller that is not a token is renamed), so the upgrade
never fails on existing data; their ids, secrets and audit entries are unchanged.

Revision ID: 0006_live_token_names
Revises: 0005_training_totals
Create Date: 2025-06-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_live_token_names"
down_revision: str | Sequence[str] | None = "0005_training_totals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESERVED = ("bootstrap", "anonymous")  # app.access.tokens.RESERVED_NAMES, as of this revision


def upgrade() -> None:
    op.execute(
        sa.text(
            """
            UPDATE api_tokens AS t SET name = t.name || '-' || t.token_id
            FROM (
                SELECT token_id, name, row_number() OVER (
                    PARTITION BY name ORDER BY created_at, token_id
                ) AS nth
                FROM api_tokens WHERE revoked_at IS NULL
            ) AS live
            WHERE t.token_id = live.token_id
              AND (live.nth > 1 OR live.name = ANY(:reserved))
            """
        ).bindparams(sa.bindparam("reserved", list(RESERVED), type_=sa.ARRAY(sa.Text())))
    )
    op.create_index(
        op.f("uq_api_tokens_live_name"),
        "api_tokens",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index(op.f("uq_api_tokens_live_name"), table_name="api_tokens")
