"""The Redis key layout, written once: every key and channel name of a broker prefix.

Python code builds names with the functions below; the Lua scripts get theirs from
:func:`lua_prologue`, generated from the same table when the scripts are loaded. Every key of
a run lives under ``<prefix>:{<run_id>}:`` so that all of them share the ``{run_id}`` hash tag
and a script that touches one run touches one Redis Cluster slot. docs/design.md describes what
each key holds.
"""

from __future__ import annotations

import re

__all__ = [
    "CONSUMER_GROUP",
    "LUA_FAMILIES",
    "LUA_KEYS",
    "active_key",
    "audit_key",
    "dead_key",
    "drain_consumers_key",
    "events_key",
    "every_key",
    "lua_prologue",
    "member_key",
    "outbox_key",
    "run_base",
    "run_key",
    "run_of_wake",
    "run_of_wake_channel",
    "run_tag",
    "runs_key",
    "script_keys",
    "sync_key",
    "tokens_channel",
    "wake_channel",
    "work_wake",
    "write_probe_key",
]

# -- per-run keys: the part after "<prefix>:{<run_id>}:" ------------------------------------
RUN = "run"  # hash: config, version, status, floor, counters; the key every script is given
EVENTS = "events"  # stream: accounting events
DEAD = "dead"  # stream: events the accounting drain could not apply
QUEUE = "q"  # zset of layout 3 runs: ready units by arrival seq (load_run() removes it)
VERSIONS = "vs"  # zset: versions that have ready units, score = version
OPEN = "open"  # zset: incomplete groups by creation ms
OPEN_VERSIONS = "ov"  # zset: incomplete groups by (oldest) version
LEASES = "leases"  # zset: live batches by expiry ms
UNITS = "units"  # hash: every complete unit, ready or leased -> its record (lua/lib/units.lua)
SEEN = "seen"  # set: every rollout_id ever received (idempotency)
GROUPS_DONE = "gdone"  # set: groups that completed or retired: they take no new members
WAITING = "waiting"  # string with a TTL: a trainer is long-polling the run
PROMPT_QUEUE = "pq"  # zset: queued prompt passes, by (pass, registration seq)
PROMPTS_SEEN = "pseen"  # set: every prompt_id ever registered (idempotency)
WORK_LEASES = "wleases"  # zset: live work leases by expiry ms
WORK_WAITING = "wwaiting"  # string with a TTL: a generator is long-polling the run
# zset: acknowledged batches by ack ms, member '<V>:<batch_id>' (V the batch's version), kept as
# long as their batch records (24 h): the batches a rewind below V undoes
ACKED = "acked"
# zset: complete units whose newest trained token is newer than their governing version, score
# = that newest version: a rewind retires them too
CROSS = "xv"
# zset: the versions kl_flush raised the floor to, score = version: a rewind below one restores
# the floor from before it
FLOORS = "floors"
POLICY_WAITING = "pwaiting"  # string with a TTL: a follower long-polls the policy version
# hash: every rollout that awaits its reward (posted with none, still buffered) -> '<unit> <ingest
# ms>'; its length less the run hash's `rwl` is what awaits a reward lease
AWAITING = "aw"
# hash: every complete unit with unscored members -> its reward state (JSON: unscored count, the
# min and max of the rewards it has, expired reward leases, the live reward lease holding it)
AWAITING_UNITS = "aun"
AWAITING_QUEUE = "aq"  # zset: awaiting units in no live reward lease, by arrival seq
AWAITING_VERSIONS = "av"  # zset: every awaiting unit by its version, for eviction and rewind
REWARD_LEASES = "rleases"  # zset: live reward leases by expiry ms
REWARD_WAITING = "rwaiting"  # string with a TTL: a reward worker is long-polling the run
# hash: every live unit (buffered, leased or filling) whose rollouts name generators -> their
# generator ids, space-separated (lua/lib/generators.lua): whom a quarantine retires
UNIT_GENERATORS = "ug"
GENERATORS_QUARANTINED = "gq"  # hash: every quarantined generator -> ms it was quarantined at
# hash: generator -> its KL window, '<tokens> <kl_sum> ...' per acked batch, oldest first, only as
# much as its last generator_window_tokens trained tokens need (lua/lib/quarantine.lua)
GENERATOR_WINDOWS = "gw"
# hash: every prompt whose attempt's group completed with every reward in -> the mean reward of
# its newest such group (lua/lib/pools.lua): the prompt's difficulty pool is judged from it
PROMPT_MEANS = "pmean"
# zsets, kept only while the run has `difficulty`: the queued passes of PROMPT_QUEUE (same scores)
# in the easy, normal and hard pools (lua/lib/pools.lua)
POOL_EASY = "pqe"
POOL_NORMAL = "pqn"
POOL_HARD = "pqh"
# Consumers (lua/lib/consumers.lua). hash: every consumer's name -> '<gen> <created ms> <config
# JSON>'
CONSUMERS = "cons"
# hash: every rollout a consumer holds (pending or leased) -> how many consumers hold it
CONSUMER_REFS = "cref"
# set: rollouts that retired while a consumer held them: their blobs go with the last hold
CONSUMER_ORPHANS = "corph"
# set: units a rewind took back to no use after their first had reached 'trained' consumers:
# their next first use is not handed to them again (lua/lib/consumers.lua CON.first_use)
CONSUMER_REWOUND = "ctd"
CONSUMER_WAITING = "cwaiting"  # string with a TTL: a consumer's reader is long-polling the run
# stream: the run's operator actions (audit log entries), each written by the script that makes
# the change, in the same call; app/access/audit.py moves them into Postgres. A delete keeps it
# until the run leaves RUNS.
OUTBOX = "audit"
# Never written. Every script declares it beside RUN (see script_keys): while the run's slot is
# being moved between cluster nodes, a script that declares a key the node lacks is refused
# before it runs (TRYAGAIN or ASK), instead of failing half-way on a key already moved.
GUARD = "guard"

# Shard channel (SSUBSCRIBE/SPUBLISH, Redis 7), not a key: the run's wake-ups (see WORK_WAKE
# below), in the run's slot, so that on a Redis Cluster a wake-up stays on the node holding the
# run. Each API process subscribes to it while one of its requests long-polls the run
# (app/broker/notify.py). The scripts are given it as ARGV[1] (RedisStore._script).
WAKE = "wake"

# Written only by app/replicas.py, never by a script: a string with a 1 s TTL whose SET is the
# barrier before WAIT (BROKER_REDIS_WAIT_REPLICAS), a write of the run's slot that always
# propagates. It may outlive its run by that second.
SYNC = "sync"

# Families: the suffix is followed by an id (a version, unit, rollout or batch id).
VERSION_QUEUE = "qv:"  # zset per version: its ready units by uses · 2^38 + arrival seq
UNIT = "u:"  # hash per group still filling: need, have, v, seq, rmin/rmax, pk/att
MEMBERS = "m:"  # list per group unit: '<version> <tokens> <rollout_id>' in arrival order
BLOB = "d:"  # string per rollout: the packed rollout (read with MGET outside the scripts)
BATCH = "b:"  # hash per batch: state, its units and rollouts, size, version, stored ack answer
PASS = "pp:"  # hash per prompt pass '<prompt_id>#<pass>': st, att, tries, lease, seq
PROMPT = "pb:"  # string per prompt: the packed prompt (prompt_ids and data)
REWARD_LEASE = "rl:"  # hash per reward lease: state, expiry, worker, its units and rollouts
WORK = "w:"  # hash per work lease: state, version, expiry, its passes, groups still open
# hash per prompt pass: rollout_id -> a partial rollout given back with the pass, in the packed
# rollout format (app/broker/packing.py); lua/lib/partials.lua says when each comes and goes
PARTIALS = "pt:"
PARTIAL_META = "pm:"  # hash per prompt pass: rollout_id -> '<version> <tokens>' of its partial
# zset per consumer: its pending items '<version> <rollout_id>' by delivery seq (run hash 'cseq')
CONSUMER_QUEUE = "cq:"
CONSUMER_COUNTS = "cs:"  # hash per consumer: delivered, acked, dropped, leased
CONSUMER_LEASES = "cl:"  # zset per consumer: its live batches by expiry ms
# hash per consumer batch '<name>:<gen>:<batch_id>': st, items (JSON [item, seq, ...]), exp, n
CONSUMER_BATCH = "cb:"

# -- global keys and channels: the part after "<prefix>:" ------------------------------------
# zset: every run id by creation ms (listing); a deleted run leaves it once its outbox has moved
RUNS = "runs"
ACTIVE = "active"  # zset: the runs the workers visit, by activation token (see store.py)
DRAIN_CONSUMERS = "drain:consumers"  # zset: every accounting drain consumer by heartbeat ms
# stream: operator actions, written after each change by versions before the runs' outboxes
# (OUTBOX); the audit worker loop still moves what is left of it into Postgres
AUDIT = "audit"
TOKENS = "tokens"  # pub/sub channel: the id of a revoked token, for every process's cache
# A wake-up (on the run's channel, WAKE) names its run by the run's tag (see run_tag), followed by
# what woke up: nothing for trainers (units became ready), WORK_WAKE for generators (prompts or
# staleness budget), POLICY_WAKE for followers of the policy version (it moved), REWARD_WAKE for
# reward workers (units came to await a reward lease), CONSUMER_WAKE for consumers' readers (items
# were delivered; the scripts spell it CON.WAKE).
WORK_WAKE = "work"
POLICY_WAKE = "policy"
REWARD_WAKE = "reward"
CONSUMER_WAKE = "consumer"

# Never written: /readyz deletes it (under a hash tag, one per cluster master) to learn whether
# Redis takes writes; the delete of a missing key is a write Redis refuses like any other.
WRITE_PROBE = "writable"

# The consumer group of every run's events stream: the accounting drain reads through it.
CONSUMER_GROUP = "accounting"

GLOBAL_KEYS = (RUNS, ACTIVE, DRAIN_CONSUMERS, AUDIT)
"""The keys of a prefix outside every run (channels aside)."""

# The names the Lua scripts know the keys by: a local holding each fixed key, and a function
# `name(id)` building each family's key. The scripts spell no key name of their own.
LUA_KEYS: dict[str, str] = {
    "RUN": RUN,
    "EV": EVENTS,
    "DEAD": DEAD,
    "Q": QUEUE,
    "VS": VERSIONS,
    "OPEN": OPEN,
    "OV": OPEN_VERSIONS,
    "LEASES": LEASES,
    "US": UNITS,
    "SEEN": SEEN,
    "GDONE": GROUPS_DONE,
    "WAITING": WAITING,
    "PQ": PROMPT_QUEUE,
    "PSEEN": PROMPTS_SEEN,
    "WLEASES": WORK_LEASES,
    "WWAITING": WORK_WAITING,
    "PWAITING": POLICY_WAITING,
    "AUD": OUTBOX,
    "ACKED": ACKED,
    "XV": CROSS,
    "FLOORS": FLOORS,
    "AW": AWAITING,
    "AUN": AWAITING_UNITS,
    "AQ": AWAITING_QUEUE,
    "AV": AWAITING_VERSIONS,
    "RLEASES": REWARD_LEASES,
    "RWAITING": REWARD_WAITING,
    "UG": UNIT_GENERATORS,
    "GQ": GENERATORS_QUARANTINED,
    "GW": GENERATOR_WINDOWS,
    "PMEAN": PROMPT_MEANS,
    "PQE": POOL_EASY,
    "PQN": POOL_NORMAL,
    "PQH": POOL_HARD,
    "CON.CONS": CONSUMERS,
    "CON.CREF": CONSUMER_REFS,
    "CON.CORPH": CONSUMER_ORPHANS,
    "CON.WAITING": CONSUMER_WAITING,
    "CON.TD": CONSUMER_REWOUND,
}
LUA_FAMILIES: dict[str, str] = {
    "qvkey": VERSION_QUEUE,
    "ukey": UNIT,
    "mkey": MEMBERS,
    "dkey": BLOB,
    "bkey": BATCH,
    "ppkey": PASS,
    "pbkey": PROMPT,
    "wkey": WORK,
    "rlkey": REWARD_LEASE,
    "ptkey": PARTIALS,
    "pmkey": PARTIAL_META,
    "CON.qkey": CONSUMER_QUEUE,
    "CON.ckey": CONSUMER_COUNTS,
    "CON.lkey": CONSUMER_LEASES,
    "CON.bkey": CONSUMER_BATCH,
}


def run_base(prefix: str, run_id: str) -> str:
    """``<prefix>:{<run_id>}:``, the start of every key of the run."""
    return f"{prefix}:{{{run_id}}}:"


def run_key(prefix: str, run_id: str, suffix: str = RUN) -> str:
    """One of the run's fixed keys (by default the run hash, the key scripts are given)."""
    return run_base(prefix, run_id) + suffix


def script_keys(prefix: str, run_id: str) -> list[str]:
    """The keys a broker script is given: the run hash, which it derives every other key of
    the run from, and the never-written ``GUARD``."""
    return [run_key(prefix, run_id), run_key(prefix, run_id, GUARD)]


def sync_key(prefix: str, run_id: str) -> str:
    """The run's barrier key (:data:`SYNC`), in the slot of every other key of the run."""
    return run_key(prefix, run_id, SYNC)


def member_key(prefix: str, run_id: str, family: str, member_id: str) -> str:
    """The key of one member of a family (``BLOB``, ``BATCH``, ...)."""
    return run_base(prefix, run_id) + family + member_id


def events_key(prefix: str, run_id: str) -> str:
    return run_key(prefix, run_id, EVENTS)


def dead_key(prefix: str, run_id: str) -> str:
    return run_key(prefix, run_id, DEAD)


def outbox_key(prefix: str, run_id: str) -> str:
    return run_key(prefix, run_id, OUTBOX)


def runs_key(prefix: str) -> str:
    return f"{prefix}:{RUNS}"


def active_key(prefix: str) -> str:
    return f"{prefix}:{ACTIVE}"


def audit_key(prefix: str) -> str:
    return f"{prefix}:{AUDIT}"


def write_probe_key(prefix: str, tag: int = 0) -> str:
    """The never-written key of :data:`WRITE_PROBE` under hash tag ``{tag}``: tags 0, 1, ...
    land on every master of a cluster."""
    return f"{prefix}:{WRITE_PROBE}:{{{tag}}}"


def tokens_channel(prefix: str) -> str:
    return f"{prefix}:{TOKENS}"


def drain_consumers_key(prefix: str) -> str:
    return f"{prefix}:{DRAIN_CONSUMERS}"


def wake_channel(prefix: str, run_id: str) -> str:
    """The run's shard channel of wake-ups (:data:`WAKE`), in the slot of its keys."""
    return run_key(prefix, run_id, WAKE)


def work_wake(prefix: str, run_id: str) -> str:
    """The message that wakes a run's waiting generators."""
    return run_tag(prefix, run_id) + WORK_WAKE


def every_key(prefix: str) -> str:
    """A SCAN pattern matching every key of the prefix (tests and benchmarks clean up with it)."""
    return f"{prefix}:*"


def run_tag(prefix: str, run_id: str) -> str:
    """``<prefix>:{<run_id>}``: what the scripts publish on the run's wake channel (``TAG``)."""
    return run_base(prefix, run_id)[:-1]


def run_of_wake(prefix: str, message: str) -> tuple[str, str]:
    """(run id, what woke up: '', WORK_WAKE, POLICY_WAKE or REWARD_WAKE) of a wake-up message:
    the run's tag (:func:`run_tag`), then the kind. Run ids hold no '}'."""
    run_id, _, kind = message[len(prefix) + 2 :].rpartition("}")
    return run_id, kind


def run_of_wake_channel(prefix: str, channel: str) -> str:
    """The run id of a run's wake channel (:func:`wake_channel`)."""
    return channel[len(prefix) + 2 : -len(WAKE) - 2]


_LUA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")
_SUFFIX = re.compile(r"[a-z]+:?")


def lua_prologue() -> str:
    """The key names every script uses, derived from KEYS[1] (the run hash): declared once when
    Redis loads the library, each a local of its main chunk (or a field of a table such as
    ``CON``, so that a part's keys cost the main chunk one local however many they are), and
    set by ``bind(run)``, which every function calls first. The key functions (``ukey(id)``) are
    defined once: they read ``B``."""
    tables = sorted({name.split(".")[0] for name in (*LUA_KEYS, *LUA_FAMILIES) if "." in name})
    plain = [_lua_name(name) for name in LUA_KEYS if "." not in name and name != "RUN"]
    lines = [
        "-- Generated by app/keys.py from its key table; edit that table, not this.",
        "local RUN, B, TAG, WORK_WAKE, POLICY_WAKE, REWARD_WAKE",
        *(f"local {_lua_name(t)} = {{}}" for t in tables),
        *(f"local {', '.join(plain[i : i + 8])}" for i in range(0, len(plain), 8)),
    ]
    for name, family in LUA_FAMILIES.items():
        local = "" if "." in name else "local "
        suffix = _suffix(family)
        lines.append(f"{local}function {_lua_name(name)}(id) return B .. '{suffix}' .. id end")
    lines += [
        "local function bind(run)",
        "  RUN = run",
        f"  B = string.sub(RUN, 1, #RUN - {len(RUN)})  -- '<prefix>:{{<run_id>}}:'",
        "  TAG = string.sub(B, 1, #B - 1)  -- '<prefix>:{<run_id>}': what a wake-up publishes",
        f"  WORK_WAKE = TAG .. '{_suffix(WORK_WAKE)}'  -- the wake-up of waiting generators",
        f"  POLICY_WAKE = TAG .. '{_suffix(POLICY_WAKE)}'  -- the wake-up of version followers",
        f"  REWARD_WAKE = TAG .. '{_suffix(REWARD_WAKE)}'  -- the wake-up of reward workers",
        f"  CON.WAKE = TAG .. '{_suffix(CONSUMER_WAKE)}'  -- the wake-up of consumers",
    ]
    for name, suffix in LUA_KEYS.items():
        if name != "RUN":
            lines.append(f"  {_lua_name(name)} = B .. '{_suffix(suffix)}'")
    lines.append("end")
    return "\n".join(lines) + "\n"


def _lua_name(name: str) -> str:
    if not _LUA_NAME.fullmatch(name):
        raise ValueError(f"not a Lua name: {name!r}")
    return name


def _suffix(suffix: str) -> str:
    # Quoted as a Lua literal as is: keep suffixes to plain words.
    if not _SUFFIX.fullmatch(suffix):
        raise ValueError(f"not a key suffix: {suffix!r}")
    return suffix
