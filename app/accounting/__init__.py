"""Exact rollout and sample accounting: the event stream drained into Postgres, and its reads.

Modules: ``service`` (what the endpoints ask: :class:`AccountingService`), ``endpoints`` (the
operator routes), ``passes`` (prompt pass states), ``deltas`` (what a fold produces), ``fold``
(events to deltas), ``models`` (tables), ``repository`` (all writes), ``queries`` (totals),
``ledger`` (the ledger against the live state), ``listings`` (batch ledger, prompt ledger,
dead letters), ``schemas`` (API models), ``stream`` and ``consumers`` (Redis side of the
consumer group), ``drain`` (the drain loop's steps).
"""
