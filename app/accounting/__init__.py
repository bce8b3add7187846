"""Exact rollout and sample accounting: the event stream drained into Postgres, and its reads.

Modules: ``events`` (decoding the stream entries), ``fold`` (events to deltas), ``models``
(tables), ``repository`` (all writes), ``queries`` (reads), ``schemas`` (API models),
``stream`` (Redis side of the consumer group), ``drain`` (the drain loop's steps), ``db``
(engine, sessions, migrations).
"""
