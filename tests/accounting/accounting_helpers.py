"""Test helpers: a small broker simulator that emits accounting events through the schema's
encoder (app/events/, as docs/events.md describes them), and computes the expected
accounting from its own rollout states (not from the events), so the drain and the queries are
checked independently.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.accounting import repository
from app.accounting.consumers import as_text
from app.accounting.endpoints import router
from app.api import install_error_handlers
from app.events import (
    Accepted,
    AcceptedItem,
    Acked,
    AckedGen,
    AckedItem,
    AckStats,
    AckSums,
    ConsumerItem,
    ConsumersChanged,
    Duplicate,
    GeneratorChanged,
    Leased,
    LeasedItem,
    PartialItem,
    PartialsChanged,
    PassesChanged,
    PassItem,
    Payload,
    PromptScored,
    PromptScoredItem,
    Registered,
    RegisteredItem,
    Rejected,
    RejectedItem,
    Retired,
    RetiredItem,
    Returned,
    ReturnedItem,
    RewardExpired,
    RewardExpiredItem,
    RewardItem,
    RewardLeased,
    RewardReturned,
    Rewound,
    RewoundGen,
    RewoundItem,
    RunChanged,
    Scored,
    ScoredItem,
    Waited,
    WorkItem,
    WorkLeased,
    decode_entry,
    encode_payload,
    lag_of,
)
from app.events import Event as StreamEvent
from app.keys import events_key, run_key, runs_key
from app.settings import Settings
from workers.drain import DrainContext, drain_once

Event = tuple[str, dict[str, Any]]


async def drain_all(ctx: DrainContext, *, max_passes: int = 50, claim: bool | None = None) -> int:
    """Run passes until one reads nothing; return the number of passes."""
    for n in range(1, max_passes + 1):
        counts = await drain_once(ctx, claim=claim)
        if counts.read == 0 and counts.missing == 0:
            return n
    raise AssertionError(f"still reading after {max_passes} passes")


def build_app(sessionmaker: async_sessionmaker[AsyncSession], redis: Redis, prefix: str) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.state.db_sessionmaker = sessionmaker
    app.state.redis = redis
    app.state.settings = Settings(
        redis_prefix=prefix, redis_url="redis://unused", database_url=None
    )
    install_error_handlers(app)  # the app's one renderer of errors
    return app


def pack(payload: dict[str, Any]) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def entry(event_type: str, payload: dict[str, Any]) -> dict[bytes, bytes]:
    return {b"e": event_type.encode(), b"d": pack(payload)}


T0 = 1_750_000_000_000  # the time of the events tests build by hand: T0 + n at stream id n-0


def event_at(run_id: str, n: int, event_type: str, body: Payload) -> StreamEvent:
    """An event of ``run_id`` with stream id ``n-0`` and time ``T0 + n``."""
    payload = encode_payload(event_type, body, t_ms=T0 + n)
    return decode_entry(run_id, f"{n}-0", entry(event_type, payload))


async def apply_batches(
    sm: async_sessionmaker[AsyncSession],
    run_id: str,
    batches: Sequence[Sequence[StreamEvent]],
) -> None:
    """Apply each batch of events to the ledger in a transaction of its own, in order."""
    for batch in batches:
        async with sm() as s, s.begin():
            await repository.apply_events(s, run_id, batch)


async def register_run(redis: Redis, prefix: str, run_id: str, score: int = 0) -> None:
    """What the broker does on run creation, as far as the drain can see."""
    await redis.zadd(runs_key(prefix), {run_id: score})
    await redis.zadd(keys.active_key(prefix), {run_id: score})
    await redis.set(run_key(prefix, run_id), b"1")


async def xadd_events(
    redis: Redis, prefix: str, run_id: str, events: Iterable[Event]
) -> list[bytes]:
    key = events_key(prefix, run_id)
    ids: list[bytes] = []
    batch = list(events)
    for start in range(0, len(batch), 200):
        async with redis.pipeline(transaction=False) as pipe:
            for event_type, payload in batch[start : start + 200]:
                pipe.xadd(key, entry(event_type, payload))
            ids.extend(await pipe.execute())
    return ids


async def miscount_entries_read(redis: Redis, key: str, group: str, entries_read: int) -> None:
    """Give the consumer group a wrong ``entries-read``, as a Redis 7.0 replica that joined by
    full sync keeps it (issue 31, finding 3): ``XINFO GROUPS`` then reports a wrong ``lag`` for
    good, however much the group reads. Skips the test on Redis 6.2, which has neither
    ``ENTRIESREAD`` nor a lag to mislead."""
    info = next(g for g in await redis.xinfo_groups(key) if as_text(g["name"]) == group)
    try:
        await redis.xgroup_setid(key, group, info["last-delivered-id"], entries_read=entries_read)
    except ResponseError as exc:
        pytest.skip(f"no XGROUP SETID ... ENTRIESREAD: {exc}")


def lua_style(value: Any) -> Any:
    """What Redis's Lua msgpack encoder makes of an encoded payload: whole floats become
    integers (the encoder already leaves out nils, as Lua tables hold none)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [lua_style(v) for v in value]
    if isinstance(value, dict):
        return {k: lua_style(v) for k, v in value.items()}
    return value


@dataclass
class SimRollout:
    rollout_id: str
    unit_id: str
    version: int
    tokens: int
    state: str = "buffered"  # buffered | leased | retired
    uses: int = 0
    retired_reason: str | None = None
    kl: float | None = None
    trained: int = 0  # uses ever acked, those a rewind gave back too
    rewound: int = 0  # uses a rewind gave back
    # Posted without a reward: "awaiting" a reward lease, "leased" in one, None once scored (or
    # for one posted with its reward); scored through the API, reward-lease expiries, and the
    # ms from ingest to score.
    reward: str | None = None
    posted_unscored: bool = False
    scored: bool = False
    reward_lease: str | None = None
    reward_expiries: int = 0
    reward_wait_ms: int = 0
    ingest_ms: int = 0
    generator: str | None = None  # its generator_id, when posted with one

    def unscored_place(self) -> int:
        """Its ``unscored`` in a ``retired`` item."""
        return {"awaiting": 1, "leased": 2}.get(self.reward or "", 0)


@dataclass
class SimGen:
    """What a generator's samples measured (the sums its `acked` `gens` carried), and whether
    it is quarantined now."""

    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0
    zero_weight: int = 0
    quarantined: bool = False


@dataclass
class SimBatch:
    batch_id: str
    version: int
    rollout_ids: list[str]
    outcome: str = "leased"
    rewound: bool = False  # an acked batch a rewind undid


@dataclass
class SimPass:
    """One pass of a prompt taken as work: its attempt, state and the attempts it lost."""

    attempt: int = 1
    state: str = "queued"  # queued | in_flight | done | failed
    tries: int = 0
    partials: list[tuple[str, int, int]] = field(default_factory=list)  # (id, version, tokens)


@dataclass
class RunSim:
    """Drives one run through the rollout life cycle and records the events it would emit.

    Prompts (registered, handed out in work leases, settled) and waits run on a random stream
    of their own, so a seed's rollout workload is the same with or without them."""

    run_id: str
    seed: int = 0
    group_size: int = 1
    max_reuse: int = 2
    max_staleness: int = 2
    kl_max: float = 0.05
    kl_flush: float = 0.1
    lua: bool = True
    rng: random.Random = field(init=False)
    t: int = 1_750_000_000_000
    events: list[Event] = field(default_factory=list)
    rollouts: dict[str, SimRollout] = field(default_factory=dict)
    batches: dict[str, SimBatch] = field(default_factory=dict)
    policy: int = 0
    duplicates: int = 0
    rejections: list[tuple[str, int, int]] = field(default_factory=list)  # reason, version, tokens
    samples: list[tuple[int, int]] = field(default_factory=list)  # (rollout version, lag)
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_values: list[float] = field(default_factory=list)
    version_kl: dict[int, list[tuple[float, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0
    max_attempts: int = 2
    work_rng: random.Random = field(init=False)
    passes: dict[tuple[str, int], SimPass] = field(default_factory=dict)  # (prompt_id, pass)
    work_leases: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # live ones
    prompts_registered: int = 0
    wait_ms: Counter[str] = field(default_factory=Counter)  # role -> ms
    partial_rng: random.Random = field(init=False)
    partial_counts: Counter[str] = field(default_factory=Counter)  # the `partials` figures
    rewinds: bool = False  # the workload rewinds the version now and then
    max_reward_attempts: int = 2
    reward_rng: random.Random = field(init=False)
    reward_leases: list[str] = field(default_factory=list)  # reward leases still live
    work_versions: dict[str, int] = field(default_factory=dict)  # work lease -> the run's V
    # Generators: rollouts name one of `generators` (or none), and their acks carry `gens`;
    # now and then one is quarantined or released. `beta`: the adaptive KL penalty's β (None:
    # off), moved by each ack, and the β after the newest ack at each version of the trainer.
    generators: int = 0
    beta: float | None = None
    betas: dict[int, float | None] = field(default_factory=dict)
    gen_rng: random.Random = field(init=False)
    gens: dict[str, SimGen] = field(default_factory=lambda: defaultdict(SimGen))
    # Difficulty pools: now and then a prompt's group completes with a mean reward
    # (`prompt_scored`); per prompt the newest mean and the groups told.
    score_rng: random.Random = field(init=False)
    means: dict[str, tuple[float, int]] = field(default_factory=dict)
    # Consumers: now and then a `consumers` event; per name [delivered, acked, dropped].
    consumer_rng: random.Random = field(init=False)
    consumer_counts: dict[str, list[int]] = field(default_factory=dict)
    _n: int = 0
    _work_n: int = 0
    _reward_n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.work_rng = random.Random(self.seed + 1_000_003)
        self.partial_rng = random.Random(self.seed + 2_000_003)
        self.reward_rng = random.Random(self.seed + 3_000_003)
        self.gen_rng = random.Random(self.seed + 4_000_003)
        self.score_rng = random.Random(self.seed + 5_000_003)
        self.consumer_rng = random.Random(self.seed + 6_000_003)

    # --- emitting ---------------------------------------------------------------------

    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{kind}-{self._n}"

    def _work_id(self, kind: str) -> str:
        self._work_n += 1
        return f"{kind}-{self._work_n}"

    def _emit(self, event_type: str, body: Payload, rng: random.Random | None = None) -> None:
        self.t += (rng or self.rng).randint(0, 5)
        payload = encode_payload(event_type, body, t_ms=self.t)
        self.events.append((event_type, lua_style(payload) if self.lua else payload))

    def _run_event(self, change: str, status: str = "open") -> None:
        self._emit(
            "run",
            RunChanged(
                run_id=self.run_id,
                change=change,
                config={
                    "max_staleness": self.max_staleness,
                    "max_reuse": self.max_reuse,
                    "kl_max": self.kl_max,
                    "kl_flush": self.kl_flush,
                    "group_size": self.group_size,
                },
                policy_version=self.policy,
                status=status,
                created_at_ms=1_750_000_000_000,
            ),
        )

    def create(self) -> None:
        self._run_event("created")

    # --- the life cycle ---------------------------------------------------------------

    def ingest(self, groups: int, version: int | None = None) -> None:
        """Accept ``groups`` new units, plus some duplicates and policy rejections."""
        version = self.policy if version is None else version
        items: list[AcceptedItem] = []
        for _ in range(groups):
            unit = self._id("g") if self.group_size > 1 else None
            for k in range(self.group_size):
                rid = self._id("r")
                tokens = self.rng.randint(1, 300)
                unit_id = unit or rid
                generator = self._generator_of()
                self.rollouts[rid] = SimRollout(rid, unit_id, version, tokens, generator=generator)
                items.append(
                    AcceptedItem(rid, unit_id, version, tokens, k == 0, 0, False, generator)
                )
        self._emit("accepted", Accepted(tuple(items)))
        for item in items:
            self.rollouts[item.rollout_id].ingest_ms = self.t
        if self.rollouts and self.rng.random() < 0.7:
            known = sorted(k for k, r in self.rollouts.items() if not r.posted_unscored)
            ids = self.rng.sample(known, k=min(3, len(known)))
            self.duplicates += len(ids)
            self._emit("duplicate", Duplicate(n=len(ids), ids=tuple(ids)))
        if self.rng.random() < 0.6:
            rejected: list[RejectedItem] = []
            for reason, v in (("future_version", self.policy + 1), ("stale", self.policy - 9)):
                tokens = self.rng.randint(1, 50)
                self.rejections.append((reason, v, tokens))
                rejected.append(RejectedItem(self._id("x"), reason, v, tokens))
            self._emit("rejected", Rejected(tuple(rejected)))

    def eligible(self) -> list[SimRollout]:
        return [
            r
            for r in self.rollouts.values()
            if r.state == "buffered"
            and r.uses < self.max_reuse
            and not r.posted_unscored  # kept from trainers: the rollout workload stays a seed's
            and self.policy - r.version <= self.max_staleness
        ]

    def lease(self, size: int, trainer: str | None = "trainer-0") -> str | None:
        pool = self.eligible()
        if not pool:
            self.waited("trainer", self.work_rng.randint(1, 3000))
            return None
        wait_ms = self.work_rng.choice((0, 0, self.work_rng.randint(1, 5000)))
        self.wait_ms["trainer"] += wait_ms
        chosen = self.rng.sample(pool, k=min(size, len(pool)))
        batch_id = self._id("b")
        self.batches[batch_id] = SimBatch(batch_id, self.policy, [r.rollout_id for r in chosen])
        for r in chosen:
            r.state = "leased"
        self._emit(
            "leased",
            Leased(
                batch_id=batch_id,
                trainer_id=trainer,
                policy_version=self.policy,
                expires_at_ms=self.t + 300_000,
                items=tuple(
                    LeasedItem(
                        r.rollout_id, r.version, r.tokens, lag_of(self.policy, r.version), r.uses
                    )
                    for r in chosen
                ),
                wait_ms=wait_ms,
            ),
        )
        return batch_id

    def _return(self, batch: SimBatch) -> list[SimRollout]:
        rollouts = [self.rollouts[rid] for rid in batch.rollout_ids]
        for r in rollouts:
            r.state = "buffered"
        return rollouts

    def ack(self, batch_id: str, *, kl_scale: float = 0.03, measured: bool = True) -> None:
        batch = self.batches[batch_id]
        batch.outcome = "acked"
        rollouts = self._return(batch)
        items: list[AckedItem] = []
        kl_tokens, kl_sum, kls = 0, 0.0, []
        for r in rollouts:
            r.uses += 1
            r.trained += 1
            self.samples.append((r.version, batch.version - r.version, r.tokens))
            kl: float | None = None
            if measured and self.rng.random() < 0.85:
                # Some whole values, which a Lua encoder writes as integers.
                kl = 0.0 if self.rng.random() < 0.1 else self.rng.random() * kl_scale
                kl_tokens += r.tokens
                kl_sum += kl * r.tokens
                kls.append(kl)
                self.version_kl[r.version].append((kl, r.tokens))
            r.kl = kl
            items.append(AckedItem(r.rollout_id, r.version, r.tokens, kl))
        tokens = sum(r.tokens for r in rollouts)
        ratio_tokens = tokens if measured else 0
        ratio_sum = ratio_tokens * (1 + self.rng.uniform(-0.1, 0.1))
        clipped = self.rng.randint(0, ratio_tokens) if ratio_tokens else 0
        self.kl_tokens += kl_tokens
        self.kl_sum += kl_sum
        self.kl_values.extend(kls)
        self.ratio_tokens += ratio_tokens
        self.ratio_sum += ratio_sum
        self.clipped += clipped
        kl_mean = kl_sum / kl_tokens if kl_tokens else None
        gens = self._acked_gens(rollouts, measured)
        if self.beta is not None:
            self.beta *= 1 + self.gen_rng.uniform(-0.2, 0.2)
        self.betas[batch.version] = self.beta
        self._emit(
            "acked",
            Acked(
                batch_id=batch_id,
                step=self.rng.randint(0, 10_000),
                policy_version=batch.version,
                items=tuple(items),
                stats=AckStats(
                    kl_mean=kl_mean,
                    kl_max=max(kls) if kls else None,
                    is_ratio_mean=ratio_sum / ratio_tokens if ratio_tokens else None,
                    clip_fraction=clipped / ratio_tokens if ratio_tokens else None,
                    ess_fraction=self.rng.uniform(0.5, 1.0) if measured else None,
                ),
                sums=AckSums(
                    kl_tokens=kl_tokens,
                    kl_sum=kl_sum,
                    ratio_tokens=ratio_tokens,
                    ratio_sum=ratio_sum,
                    clipped=clipped,
                ),
                gens=gens,
                kl_coef=self.beta,
            ),
        )
        self.retire([r for r in rollouts if r.uses >= self.max_reuse], "max_reuse")
        self.retire(
            [
                r
                for r in rollouts
                if r.state == "buffered" and r.kl is not None and r.kl > self.kl_max
            ],
            "kl",
        )
        if kl_mean is not None and kl_mean > self.kl_flush:
            self.retire(
                [
                    r
                    for r in self.rollouts.values()
                    if r.state == "buffered" and r.version < batch.version
                ],
                "kl_flush",
            )

    def _generator_of(self) -> str | None:
        if not self.generators:
            return None
        n = self.gen_rng.randint(0, self.generators)  # one in generators + 1 names none
        return f"gen-{n}" if n < self.generators else None

    def _acked_gens(self, rollouts: Sequence[SimRollout], measured: bool) -> tuple[AckedGen, ...]:
        """The `gens` of an ack: per generator of its samples, their figures (ratios drawn
        here, per rollout; the KL is each rollout's own)."""
        rng = self.gen_rng
        shares: dict[str, list[SimRollout]] = defaultdict(list)
        for r in rollouts:
            if r.generator is not None:
                shares[r.generator].append(r)
        gens = []
        for generator, mine in sorted(shares.items()):
            g = self.gens[generator]
            kl_tokens = sum(r.tokens for r in mine if r.kl is not None)
            kl_sum = sum(r.kl * r.tokens for r in mine if r.kl is not None)
            kl_max = max((r.kl for r in mine if r.kl is not None), default=None)
            ratio_tokens = sum(r.tokens for r in mine) if measured else 0
            ratio_sum = ratio_tokens * rng.uniform(0.8, 1.2)
            clipped = rng.randint(0, ratio_tokens)
            zero_weight = rng.randint(0, clipped)
            g.kl_tokens += kl_tokens
            g.kl_sum += kl_sum
            if kl_max is not None:
                g.kl_max = kl_max if g.kl_max is None else max(g.kl_max, kl_max)
            g.ratio_tokens += ratio_tokens
            g.ratio_sum += ratio_sum
            g.clipped += clipped
            g.zero_weight += zero_weight
            gens.append(
                AckedGen(
                    generator, len(mine), sum(r.tokens for r in mine), kl_tokens, kl_sum,
                    ratio_tokens, ratio_sum, clipped, zero_weight, kl_max,
                )
            )  # fmt: skip
        return tuple(gens)

    def quarantine(self, generator: str, quarantined: bool = True) -> None:
        """The generator is quarantined (its buffered rollouts retire `quarantined`) or
        released."""
        rng = self.gen_rng
        self.gens[generator].quarantined = quarantined
        body = GeneratorChanged(
            generator,
            quarantined,
            rng.uniform(0.1, 1.0) if quarantined else None,
            rng.randint(1, 10_000) if quarantined else None,
        )
        self._emit("generator", body, rng)
        if quarantined:
            mine = [r for r in self.rollouts.values() if r.generator == generator]
            self.retire(mine, "quarantined", rng)

    def nack(self, batch_id: str) -> None:
        self._settle(batch_id, "nacked")

    def expire(self, batch_id: str) -> None:
        self._settle(batch_id, "expired")

    def _settle(self, batch_id: str, outcome: str) -> None:
        batch = self.batches[batch_id]
        batch.outcome = outcome
        rollouts = self._return(batch)
        self._emit(
            outcome,
            Returned(
                batch_id, tuple(ReturnedItem(r.rollout_id, r.version, r.tokens) for r in rollouts)
            ),
        )

    def retire(
        self, rollouts: Sequence[SimRollout], reason: str, rng: random.Random | None = None
    ) -> None:
        rollouts = [r for r in rollouts if r.state == "buffered"]
        if not rollouts:
            return
        for r in rollouts:
            r.state = "retired"
            r.retired_reason = reason
        self._emit(
            "retired",
            Retired(
                reason,
                tuple(
                    RetiredItem(r.rollout_id, r.version, r.tokens, r.uses, r.unscored_place())
                    for r in rollouts
                ),
            ),
            # Only rollouts posted unscored: an event the rollout workload would not have.
            rng or (self.reward_rng if all(r.posted_unscored for r in rollouts) else None),
        )

    def set_policy(self, version: int) -> None:
        self.policy = version
        self._run_event("policy")
        self.retire(
            [r for r in self.rollouts.values() if self.policy - r.version > self.max_staleness],
            "stale",
        )

    def rewind(self, to: int) -> None:
        """Back to version ``to``, as the rewind does: trainer leases taken above it expire,
        the batches acked above it are undone (their rollouts still kept get those uses back),
        rollouts above it retire `rewound`, the passes those batches completed go back (a share
        of them, as the broker sends back only those whose group no later batch completed)
        and so do those of work leases taken above it."""
        assert to < self.policy
        for batch_id in self.live_batches():
            if self.batches[batch_id].version > to:
                self.expire(batch_id)
        undone = [
            b
            for b in self.batches.values()
            if b.outcome == "acked" and b.version > to and not b.rewound
        ]
        items: list[RewoundItem] = []
        gens: Counter[str] = Counter()
        for b in undone:
            b.rewound = True
            for r in (self.rollouts[rid] for rid in b.rollout_ids):
                if r.state != "retired":
                    r.uses -= 1
                    r.rewound += 1
                    items.append(RewoundItem(r.rollout_id, r.version, r.tokens, b.version))
                    if r.generator is not None:
                        gens[r.generator] += 1
        before, self.policy = self.policy, to
        body = Rewound(
            before,
            to,
            tuple(b.batch_id for b in undone),
            tuple(items),
            tuple(RewoundGen(g, n) for g, n in sorted(gens.items())),
        )
        self._emit("rewound", body)
        self.retire([r for r in self.rollouts.values() if r.version > to], "rewound")
        self._rewind_passes(to)
        self._run_event("policy")

    def _rewind_passes(self, to: int) -> None:
        rng = self.work_rng
        undone = [k for k, p in self.passes.items() if p.state == "done" and rng.random() < 0.5]
        for key in undone:  # not a try: `tries` stays
            self.passes[key].attempt += 1
            self.passes[key].state = rng.choice(("queued", "in_flight"))
        self._passes("rewound", None, undone)
        for lease_id in [w for w, v in self.work_versions.items() if v > to]:
            del self.work_versions[lease_id]
            keys = self.work_leases.pop(lease_id, [])
            for key in keys:
                self.passes[key].attempt += 1
                self.passes[key].state = "queued"
            self._passes("rewound", lease_id, keys)
            for key in keys:
                self._settle_partials(key, lease_id)

    def close(self) -> None:
        self._run_event("closed", status="closed")
        self.retire(list(self.rollouts.values()), "run_closed")

    # --- rewards: rollouts posted without one, reward leases -----------------------------

    def post_unscored(self, n: int) -> list[SimRollout]:
        """Rollouts posted without a reward (single ones): buffered, awaiting a reward lease."""
        rng = self.reward_rng
        posted = []
        for _ in range(n):
            self._reward_n += 1
            rid = f"ra-{self._reward_n}"
            posted.append(
                SimRollout(
                    rid, rid, self.policy, rng.randint(1, 200), reward="awaiting",
                    posted_unscored=True,
                )
            )  # fmt: skip
        items = tuple(AcceptedItem(r.rollout_id, r.unit_id, r.version, r.tokens, True, 0, True)
                      for r in posted)  # fmt: skip
        self._emit("accepted", Accepted(items), rng)
        for r in posted:
            r.ingest_ms = self.t
            self.rollouts[r.rollout_id] = r
        return posted

    def lease_rewards(self, k: int) -> str | None:
        """A reward lease of the ``k`` oldest rollouts awaiting one."""
        rng = self.reward_rng
        pool = [
            r for r in self.rollouts.values() if r.state == "buffered" and r.reward == "awaiting"
        ]
        if not pool:
            return None
        chosen = pool[:k]
        self._reward_n += 1
        lease_id = f"rl-{self._reward_n}"
        for r in chosen:
            r.reward, r.reward_lease = "leased", lease_id
        self.reward_leases.append(lease_id)
        body = RewardLeased(
            lease_id=lease_id,
            worker_id=rng.choice((None, "rw-0")),
            expires_at_ms=self.t + 600_000,
            items=tuple(RewardItem(r.rollout_id, r.version, r.tokens) for r in chosen),
            wait_ms=rng.choice((0, rng.randint(1, 3000))),
        )
        self._emit("reward_leased", body, rng)
        return lease_id

    def reward_members(self, lease_id: str) -> list[SimRollout]:
        """The rollouts of a reward lease still in it (not scored, retired or given back)."""
        return [
            r
            for r in self.rollouts.values()
            if r.state == "buffered" and r.reward == "leased" and r.reward_lease == lease_id
        ]

    def score(self, rollouts: Sequence[SimRollout]) -> None:
        """Rewards posted for ``rollouts`` (awaiting, or in a live reward lease)."""
        rng = self.reward_rng
        items = []
        for r in rollouts:
            # Now and then a score later than the histogram's last bound (30 min).
            late = rng.choice((0, 0, 0, rng.randint(1, 2_500_000)))
            r.reward_wait_ms = max(0, self.t - r.ingest_ms) + late
            items.append(ScoredItem(r.rollout_id, r.version, rng.choice((0.0, 1.0, rng.random())),
                                    r.reward_wait_ms, r.reward == "leased"))  # fmt: skip
            r.reward, r.reward_lease, r.scored = None, None, True
        if items:
            self._emit("scored", Scored(tuple(items)), rng)

    def expire_rewards(self, lease_id: str) -> None:
        """The reward lease runs out: its rollouts await again, one more attempt each; those at
        ``max_reward_attempts`` retire ``reward_timeout``."""
        members = self.reward_members(lease_id)
        self.reward_leases.remove(lease_id)
        for r in members:
            r.reward, r.reward_lease = "awaiting", None
            r.reward_expiries += 1
        items = tuple(
            RewardExpiredItem(r.rollout_id, r.version, r.reward_expiries) for r in members
        )
        self._emit("reward_expired", RewardExpired(lease_id, items), self.reward_rng)
        self.retire(
            [r for r in members if r.reward_expiries >= self.max_reward_attempts], "reward_timeout"
        )

    def return_rewards(self, lease_id: str) -> None:
        members = self.reward_members(lease_id)
        self.reward_leases.remove(lease_id)
        for r in members:
            r.reward, r.reward_lease = "awaiting", None
        items = tuple(RewardItem(r.rollout_id, r.version, r.tokens) for r in members)
        self._emit("reward_returned", RewardReturned(lease_id, items), self.reward_rng)

    def reward_work(self) -> None:
        """One round of the reward workers: rollouts posted unscored, reward leases taken, and
        each live one scored (whole or in part), given back, let expire or kept."""
        rng = self.reward_rng
        if rng.random() < 0.3:
            self.post_unscored(rng.randint(1, 2))
        if rng.random() < 0.6:
            self.lease_rewards(rng.randint(1, 4))
        for lease_id in list(self.reward_leases):
            members = self.reward_members(lease_id)
            roll = rng.random()
            if roll < 0.3 or not members:
                self.score(members)
                self.reward_leases.remove(lease_id)
            elif roll < 0.45:
                self.score(members[: len(members) // 2 or 1])
            elif roll < 0.55:
                self.return_rewards(lease_id)
            elif roll < 0.8:
                self.expire_rewards(lease_id)
        awaiting = [
            r for r in self.rollouts.values() if r.state == "buffered" and r.reward == "awaiting"
        ]
        if awaiting and rng.random() < 0.2:
            self.score(awaiting[:1])  # scored with no lease

    # --- prompts, work leases and waits ------------------------------------------------

    def waited(self, role: str, wait_ms: int) -> None:
        """A long poll of ``role`` that waited ``wait_ms`` and got nothing."""
        self.wait_ms[role] += wait_ms
        self._emit("waited", Waited(role=role, wait_ms=wait_ms), self.work_rng)

    def register(self, prompts: int, epochs: int = 1) -> list[str]:
        """New prompts, each queued for ``epochs`` passes at attempt 1."""
        ids = [self._work_id("p") for _ in range(prompts)]
        for prompt_id in ids:
            for pass_ in range(1, epochs + 1):
                self.passes[(prompt_id, pass_)] = SimPass()
        self.prompts_registered += prompts * epochs
        self._emit(
            "registered",
            Registered(tuple(RegisteredItem(p, epochs) for p in ids)),
            self.work_rng,
        )
        return ids

    def take_work(self, max_prompts: int, generator: str | None = "gen-0") -> str | None:
        """A work lease of up to ``max_prompts`` queued passes, those that came back first."""
        queued = [key for key, p in self.passes.items() if p.state == "queued"]
        if not queued:
            self.waited("generator", self.work_rng.randint(1, 2000))
            return None
        queued.sort(key=lambda key: (-self.passes[key].attempt, key[1]))
        chosen = queued[:max_prompts]
        lease_id = self._work_id("w")
        self.work_leases[lease_id] = chosen
        self.work_versions[lease_id] = self.policy
        for key in chosen:
            self.passes[key].state = "in_flight"
            self._hand_out_partials(key, lease_id)
        wait_ms = self.work_rng.choice((0, self.work_rng.randint(1, 4000)))
        self.wait_ms["generator"] += wait_ms
        self._emit(
            "work_leased",
            WorkLeased(
                lease_id=lease_id,
                generator_id=generator,
                policy_version=self.policy,
                expires_at_ms=self.t + 60_000,
                items=tuple(WorkItem(p, n, self.passes[(p, n)].attempt) for p, n in chosen),
                wait_ms=wait_ms,
            ),
            self.work_rng,
        )
        return lease_id

    def _pass_item(self, key: tuple[str, int]) -> PassItem:
        p = self.passes[key]
        return PassItem(key[0], key[1], p.attempt, p.state, p.tries)

    def _passes(self, cause: str, lease_id: str | None, keys: Sequence[tuple[str, int]]) -> None:
        if keys:
            self._emit(
                "passes",
                PassesChanged(cause, lease_id, tuple(self._pass_item(k) for k in keys)),
                self.work_rng,
            )

    def _back(self, key: tuple[str, int], *, lost: bool) -> None:
        """Back to the queue at the next attempt; an attempt ``lost`` counts towards failing."""
        p = self.passes[key]
        if lost:
            p.tries += 1
        if p.tries >= self.max_attempts:
            p.state = "failed"
        else:
            p.attempt += 1
            p.state = "queued"

    def settle_work(self, lease_id: str) -> None:
        """The lease expires whole, or each pass is done, retried, returned or still out."""
        keys = self.work_leases[lease_id]
        if self.work_rng.random() < 0.15:
            del self.work_leases[lease_id]
            for key in keys:
                self._back(key, lost=True)
            self._passes("expired", lease_id, keys)
            for key in keys:
                self._settle_partials(key, lease_id)
            return
        causes: dict[str, list[tuple[str, int]]] = defaultdict(list)
        still: list[tuple[str, int]] = []
        for key in keys:
            roll = self.work_rng.random()
            if roll < 0.5:
                self.passes[key].state = "done"  # its group reached a gradient
                causes["acked"].append(key)
            elif roll < 0.6:
                self.passes[key].state = "done"  # retired zero_variance
                causes["retired"].append(key)
            elif roll < 0.8:
                self._back(key, lost=True)  # retired unused for another reason
                causes["retired"].append(key)
            elif roll < 0.9:
                self._back(key, lost=False)  # given back unstarted
                causes["returned"].append(key)
            else:
                still.append(key)
        for cause, settled in causes.items():
            self._passes(cause, lease_id if cause == "returned" else None, settled)
            for key in settled:
                self._settle_partials(key, lease_id)
        for key in causes["returned"]:
            self._give_back_partials(key, lease_id)
        if still:
            self.work_leases[lease_id] = still
        else:
            del self.work_leases[lease_id]

    def _partials(self, change: str, reason: str | None, lease_id: str, key, parts) -> None:  # type: ignore[no-untyped-def]
        items = tuple(PartialItem(rid, key[0], key[1], v, n) for rid, v, n in parts)
        body = PartialsChanged(change, reason, lease_id, items)
        self._emit("partials", body, self.partial_rng)
        self.partial_counts[change] += len(parts)
        self.partial_counts[f"tokens_{change}"] += sum(n for _, _, n in parts)

    def _give_back_partials(self, key: tuple[str, int], lease_id: str) -> None:
        """Half the prompts given back come with one or two partial rollouts."""
        rng = self.partial_rng
        if rng.random() < 0.5:
            return
        parts = [
            (self._work_id("part"), max(0, self.policy - rng.randint(0, 3)), rng.randint(1, 9))
            for _ in range(rng.randint(1, 2))
        ]
        self.passes[key].partials = self.passes[key].partials[len(parts) :] + parts
        self._partials("returned", None, lease_id, key, parts)

    def _hand_out_partials(self, key: tuple[str, int], lease_id: str) -> None:
        """A pass's partials go out with it (and stay kept until their rollouts come), but for
        those already too stale: dropped."""
        kept = self.passes[key].partials
        above = [p for p in kept if p[1] > self.policy]  # sampled above a rewind's version
        if above:
            self._partials("dropped", "rewound", lease_id, key, above)
        kept = [p for p in kept if p not in above]
        stale = [p for p in kept if p[1] < self.policy - self.max_staleness]
        self.passes[key].partials = [p for p in kept if p not in stale]
        if stale:
            self._partials("dropped", "stale", lease_id, key, stale)
        if self.passes[key].partials:
            self._partials("resumed", None, lease_id, key, self.passes[key].partials)

    def _settle_partials(self, key: tuple[str, int], lease_id: str | None) -> None:
        """The attempt of ``key`` ended: the partials still kept come back with a pass sent back
        to the queue, and are dropped with one that is done (some completed first) or failed."""
        p = self.passes[key]
        kept = p.partials
        if not kept:
            return
        if p.state == "queued":
            self._partials("returned", None, lease_id or "", key, kept)
            return
        p.partials = []
        left = kept[self.partial_rng.randint(0, len(kept)) :]  # the others were completed
        if left:
            reason = "unused" if p.state == "done" else "failed"
            self._partials("dropped", reason, lease_id or "", key, left)

    def prompt_work(self) -> None:
        """One round of the generator side: sometimes new prompts, take work, settle some."""
        rng = self.work_rng
        if rng.random() < 0.3:
            self.register(rng.randint(1, 3), epochs=rng.randint(1, 3))
        for _ in range(rng.randint(0, 2)):
            self.take_work(rng.randint(1, 4))
        for lease_id in list(self.work_leases):
            if rng.random() < 0.7:
                self.settle_work(lease_id)

    def live_batches(self) -> list[str]:
        return [b.batch_id for b in self.batches.values() if b.outcome == "leased"]

    # --- a mixed workload -------------------------------------------------------------

    def workload(self, steps: int, *, close: bool = False) -> None:
        """Ingest, lease, ack (reuse), nack, expire, flush and retire, in random order."""
        if not self.events:
            self.create()
        for step in range(steps):
            self.prompt_work()
            self.reward_work()
            self.ingest(self.rng.randint(1, 4))
            for _ in range(self.rng.randint(1, 3)):
                self.lease(self.rng.randint(1, 6) * self.group_size)
            for batch_id in self.live_batches():
                roll = self.rng.random()
                if roll < 0.6:
                    self.ack(batch_id, kl_scale=0.3 if self.rng.random() < 0.15 else 0.06)
                elif roll < 0.7:
                    self.ack(batch_id, measured=False)
                elif roll < 0.8:
                    self.nack(batch_id)
                elif roll < 0.9:
                    self.expire(batch_id)
                # else: stays leased for now
            if step % 7 == 6:
                # Now and then a jump of several versions, which makes buffered rollouts stale.
                self.set_policy(self.policy + (self.max_staleness + 1 if step % 21 == 20 else 1))
            if self.rewinds and step % 13 == 12 and self.policy > 0:
                self.rewind(self.policy - self.rng.randint(1, min(self.policy, 3)))
            if self.generators and step % 9 == 8:
                self._quarantine_or_release()
            if step % 5 == 4:
                self.score_prompts()
            if step % 3 == 2:
                self.consumers_step()
            if step % 11 == 10:
                buffered = [
                    r
                    for r in self.rollouts.values()
                    if r.state == "buffered" and not r.posted_unscored
                ]
                self.retire(buffered[:2], "incomplete_group")
                self.retire(buffered[2:3], "zero_variance")
        if close:
            for batch_id in self.live_batches():
                self.nack(batch_id)
            self.close()
        else:
            self.lease(2 * self.group_size)  # leave a live lease behind
            self.post_unscored(3)
            self.lease_rewards(2)  # and a live reward lease, and rollouts awaiting one
            self.register(2)
            self.take_work(3)  # and a live work lease

    def score_prompts(self) -> None:
        """Groups of some done passes complete with every reward in: a `prompt_scored` event
        (none when no pass is done)."""
        rng = self.score_rng
        done = sorted({p for (p, _), s in self.passes.items() if s.state == "done"})
        if not done:
            return
        told = rng.sample(done, min(len(done), rng.randint(1, 3)))
        items = tuple(PromptScoredItem(p, round(rng.uniform(0, 1), 4), 2) for p in told)
        for item in items:
            self.means[item.prompt_id] = (item.mean, self.means.get(item.prompt_id, (0, 0))[1] + 1)
        self._emit("prompt_scored", PromptScored(items), rng)

    def consumers_step(self) -> None:
        """One call's `consumers` event: per consumer it names, something delivered, and of
        what it holds some acked and some dropped (never more than it holds)."""
        rng = self.consumer_rng
        items = []
        for name in sorted(rng.sample(["cons-a", "cons-b", "cons-c"], rng.randint(1, 2))):
            counts = self.consumer_counts.setdefault(name, [0, 0, 0])
            delivered = rng.randint(1, 4)
            held = counts[0] - counts[1] - counts[2] + delivered
            acked = rng.randint(0, held)
            dropped = rng.randint(0, held - acked)
            for i, n in enumerate((delivered, acked, dropped)):
                counts[i] += n
            items.append(ConsumerItem(name, delivered, acked, dropped))
        self._emit("consumers", ConsumersChanged(tuple(items)), rng)

    def expected_consumers(self) -> dict[str, dict[str, int]]:
        return {
            name: {"delivered": d, "acked": a, "pending": d - a - x, "dropped": x}
            for name, (d, a, x) in sorted(self.consumer_counts.items())
        }

    def _quarantine_or_release(self) -> None:
        generator = f"gen-{self.gen_rng.randrange(self.generators)}"
        self.quarantine(generator, not self.gens[generator].quarantined)

    # --- what the accounting must say -------------------------------------------------

    def expected_generators(self) -> dict[str, dict[str, Any]]:
        """`GET .../accounting/generators` from the rollouts' own states (last_seen in ms)."""
        mine: dict[str, list[SimRollout]] = defaultdict(list)
        for r in self.rollouts.values():
            if r.generator is not None:
                mine[r.generator].append(r)
        out = {}
        for generator in sorted(set(mine) | set(self.gens)):
            rs, g = mine.get(generator, []), self.gens[generator]
            out[generator] = {
                "rollouts": len(rs),
                "tokens": sum(r.tokens for r in rs),
                "samples_consumed": sum(r.trained - r.rewound for r in rs),
                "kl": {
                    "mean": g.kl_sum / g.kl_tokens if g.kl_tokens else None,
                    "max": g.kl_max,
                },
                "is_ratio": {
                    "mean": g.ratio_sum / g.ratio_tokens if g.ratio_tokens else None,
                    "clip_fraction": g.clipped / g.ratio_tokens if g.ratio_tokens else None,
                },
                "masked_fraction": g.zero_weight / g.ratio_tokens if g.ratio_tokens else None,
                "last_seen": max((r.ingest_ms for r in rs), default=None),
                "quarantined": g.quarantined,
            }
        return out

    def expected(self) -> dict[str, Any]:
        states = Counter(p.state for p in self.passes.values())
        return {
            **self.expected_rollouts(),
            "prompts": {
                "registered": self.prompts_registered,
                "queued": states["queued"],
                "in_flight": states["in_flight"],
                "done": states["done"] + states["cancelled"],
                "failed": states["failed"],
                "retried": sum(p.attempt - 1 for p in self.passes.values()),
                "skipped": 0,
                "cancelled": states["cancelled"],
                "pools": None,
            },
            "partials": {
                k: self.partial_counts[k]
                for k in ("returned", "resumed", "dropped", "tokens_resumed", "tokens_dropped")
            },
            "consumers": self.expected_consumers(),
            "wait": {
                "generator_s": self.wait_ms["generator"] / 1000,
                "trainer_s": self.wait_ms["trainer"] / 1000,
                "reward_s": sum(r.reward_wait_ms for r in self.rollouts.values()) / 1000,
            },
        }

    def expected_passes(self, state: str | None = None) -> list[dict[str, Any]]:
        """The prompt listing, in (prompt_id, pass) order."""
        return [
            {
                "prompt_id": p,
                "pass": n,
                "attempt": s.attempt,
                "state": s.state,
                "tries": s.tries,
                "mean": self.means[p][0] if p in self.means else None,
            }
            for (p, n), s in sorted(self.passes.items())
            if state is None or s.state == state
        ]

    def expected_rollouts(self) -> dict[str, Any]:
        return _expected(
            list(self.rollouts.values()),
            self.rejections,
            self.samples,
            duplicates=self.duplicates,
            batches=Counter(b.outcome for b in self.batches.values()),
            n_batches=len(self.batches),
            kl_tokens=self.kl_tokens,
            kl_sum=self.kl_sum,
            kl_values=self.kl_values,
            ratio=(self.ratio_tokens, self.ratio_sum, self.clipped),
        )

    def expected_versions(self) -> dict[int, dict[str, Any]]:
        versions = {r.version for r in self.rollouts.values()} | {v for _, v, _ in self.rejections}
        result = {}
        for v in sorted(versions):
            pairs = self.version_kl.get(v, [])
            result[v] = _expected(
                [r for r in self.rollouts.values() if r.version == v],
                [x for x in self.rejections if x[1] == v],
                [s for s in self.samples if s[0] == v],
                kl_tokens=sum(t for _, t in pairs),
                kl_sum=sum(k * t for k, t in pairs),
                kl_values=[k for k, _ in pairs],
            )
        return result


def _expected(
    rollouts: list[SimRollout],
    rejections: list[tuple[str, int, int]],
    samples: list[tuple[int, int, int]],
    *,
    duplicates: int | None = None,
    batches: Counter[str] | None = None,
    n_batches: int = 0,
    kl_tokens: int,
    kl_sum: float,
    kl_values: list[float],
    ratio: tuple[int, float, int] | None = None,
) -> dict[str, Any]:
    received = len(rollouts)
    samples_consumed = sum(r.trained for r in rollouts)
    lags = [lag for _, lag, _ in samples]
    sample_tokens = sum(t for _, _, t in samples)
    out: dict[str, Any] = {
        "rollouts_received": received,
        "groups_received": len({r.unit_id for r in rollouts}),
        "rejected": dict(Counter(reason for reason, _, _ in rejections)),
        "tokens_generated": sum(r.tokens for r in rollouts),
        "tokens_masked": 0,
        "tokens_masked_stale": 0,
        "buffered": sum(r.state == "buffered" for r in rollouts),
        "leased": sum(r.state == "leased" for r in rollouts),
        "samples_consumed": samples_consumed,
        "samples_rewound": sum(r.rewound for r in rollouts),
        "tokens_consumed": sum(r.trained * r.tokens for r in rollouts),
        "reuse_factor": samples_consumed / received if received else 0.0,
        "retired": dict(Counter(r.retired_reason for r in rollouts if r.state == "retired")),
        "wasted_tokens": sum(r.tokens for r in rollouts if r.state == "retired" and r.uses == 0),
        "lag": {
            "mean": sum(lags) / len(lags) if lags else None,
            "max": max(lags) if lags else None,
            "histogram": {str(k): v for k, v in sorted(Counter(lags).items())},
            "token_mean": sum(lag * t for _, lag, t in samples) / sample_tokens
            if sample_tokens
            else None,
        },
        "rewards": {
            "awaiting": sum(r.state == "buffered" and r.reward == "awaiting" for r in rollouts),
            "leased": sum(r.state == "buffered" and r.reward == "leased" for r in rollouts),
            "scored": sum(r.scored for r in rollouts),
            "timed_out": sum(r.reward_expiries for r in rollouts),
        },
        "kl": {
            "mean": kl_sum / kl_tokens if kl_tokens else None,
            "max": max(kl_values) if kl_values else None,
        },
    }
    if duplicates is not None:
        out["duplicates"] = duplicates
    if batches is not None:
        out["batches"] = {
            "leased": n_batches,
            "acked": batches["acked"],
            "nacked": batches["nacked"],
            "expired": batches["expired"],
        }
    if ratio is not None:
        tokens, total, clipped = ratio
        out["is_ratio"] = {
            "mean": total / tokens if tokens else None,
            "clip_fraction": clipped / tokens if tokens else None,
        }
    return out


def fields_of(row: Any) -> dict[str, Any]:
    """A mapped row's values by attribute name (``PromptPass.pass_`` is column ``pass``)."""
    return {attr.key: getattr(row, attr.key) for attr in sa_inspect(type(row)).column_attrs}


def assert_matches(actual: dict[str, Any], expected: dict[str, Any], path: str = "") -> None:
    """Equal, with a relative tolerance for floats (sums of doubles in another order)."""
    for key, want in expected.items():
        where = f"{path}.{key}" if path else key
        assert key in actual, f"{where} missing"
        got = actual[key]
        if isinstance(want, dict):
            assert isinstance(got, dict), f"{where}: {got!r}"
            assert set(got) == set(want), f"{where}: {got!r} != {want!r}"
            assert_matches(got, want, where)
        elif isinstance(want, float) and not isinstance(got, bool) and got is not None:
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {got} != {want}"
        else:
            assert got == want, f"{where}: {got!r} != {want!r}"
