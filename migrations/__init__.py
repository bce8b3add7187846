"""Alembic migrations of the broker database, its accounting and access tables (see
``app.db.upgrade_to_head``)."""
