"""Alembic migrations of the accounting database (see ``app.accounting.db.upgrade_to_head``)."""
