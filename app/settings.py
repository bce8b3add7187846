"""Process settings, read once from ``BROKER_*`` environment variables and validated at start-up."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HOST_NAME_RE = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*$")


class Settings(BaseSettings):
    """Everything a broker process needs to know about its environment."""

    model_config = SettingsConfigDict(env_prefix="BROKER_", extra="ignore")

    redis_url: str | None = Field(
        default=None, description="Redis URL; unset (with database_url unset) = embedded Redis"
    )
    redis_cluster: bool = Field(
        default=False,
        description="BROKER_REDIS_URL is any node of a Redis Cluster (the client discovers the "
        "rest and follows the cluster's redirections)",
    )
    redis_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="A Redis command or connection attempt unanswered for this long fails, and "
        "the request that needed it is a 503 (a Redis that stops answering, as behind a network "
        "partition, otherwise holds requests for good)",
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        le=1000,
        description="Answer a request that changed state only once its write reached this many "
        "Redis replicas (WAIT on the master of the run's slot), and let the accounting drain "
        "commit events only once they have; too few within BROKER_REDIS_WAIT_TIMEOUT_MS is a 503 "
        "with Retry-After, and the client's resend is idempotent. 0: off (no WAIT is sent)",
    )
    redis_wait_timeout_ms: int = Field(
        default=1000,
        ge=1,
        le=150_000,
        description="How long a write waits for BROKER_REDIS_WAIT_REPLICAS replicas; at most half "
        "of redis_timeout_s, so that a WAIT is not taken for a Redis that stopped answering",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy async URL (postgresql+asyncpg://...); unset = embedded Postgres",
    )
    redis_prefix: str = Field(
        default="rb", description="Prefix of every Redis key and channel this broker owns"
    )
    data_dir: Path | None = Field(default=None, description="Data folder of embedded services")

    auth: bool | None = Field(
        default=None,
        description="Require a bearer token on every /v1 request (on/off); unset: on whenever "
        "the API listens on a non-loopback address",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        min_length=32,
        description="Accepted as an admin token named `bootstrap` (at least 32 characters)",
    )
    allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="With auth off, the host names a request may be addressed to (its `Host`) "
        "besides `localhost`, any IP address and the name `serve --host` binds; "
        "comma-separated. A name not listed is refused (403), so that a web page cannot reach "
        "the broker through a name of its own that resolves to it (DNS rebinding)",
    )
    token_cache_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How long a token look-up is trusted without news from Redis (revocations "
        "reach every process at once through Redis; this bounds a lost subscription)",
    )

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    keep_freed_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="Freed memory each API process keeps for its next requests rather than "
        "returning it to the OS, so that requests of megabytes do not fault in fresh pages each "
        "time (glibc's trim threshold; 0: the C library's defaults)",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="A request body that sends no byte for this long is answered 408 and its "
        "connection closed (the wait between two reads, not the whole upload)",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="A connection closed unless its request line and headers arrive in full "
        "within this long of its opening, or of its first byte after a keep-alive pause "
        "(`serve`)",
    )
    keep_alive_timeout_s: int = Field(
        default=5,
        ge=1,
        le=3600,
        description="An idle keep-alive connection is closed after this many seconds without "
        "a new request (`serve`)",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="A request line and headers over this size are answered 400 and the "
        "connection closed (`serve`)",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Open connections per API process; beyond them a new connection's request "
        "is answered 503 with Retry-After and the connection closed (`serve`). Keep it under the "
        "process's open-file limit (`ulimit -n`), which its Redis and Postgres connections "
        "share",
    )
    max_rollouts_per_request: int = Field(default=4096, ge=1, le=65536)
    max_tokens_per_rollout: int = Field(default=262_144, ge=1, le=16_777_216)
    max_batch_size: int = Field(default=8192, ge=1, le=1_000_000)
    max_prompts_per_request: int = Field(default=4096, ge=1, le=65536)
    max_tokens_per_prompt: int = Field(default=262_144, ge=1, le=16_777_216)
    max_prompt_data_bytes: int = Field(default=65_536, ge=0, le=16 * 1024 * 1024)
    max_prompts_per_lease: int = Field(default=1024, ge=1, le=65536)
    max_wait_s: float = Field(default=60.0, ge=0, le=3600)
    wake_fallback_s: float = Field(
        default=1.0,
        gt=0,
        le=3600,
        description="A long poll re-checks for work this often even without a pub/sub wake-up",
    )
    sweep_interval_s: float = Field(default=1.0, gt=0, le=60)
    audit_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Seconds between the workers' moves of audit entries left in Redis",
    )
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    worker_heartbeat_file: Path | None = Field(
        default=None,
        description="File the workers touch whenever each of their loops has completed a pass "
        "(a container health check reads its age)",
    )
    behaviour_cache_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="Behaviour logprobs of leased batches kept in this process until their ack "
        "(0: always read them back from Redis)",
    )
    workers_in_process: bool = Field(
        default=False, description="Run the background workers inside the API process"
    )
    metrics: bool = Field(
        default=True,
        description="Serve GET /metrics and time every request for it (off: /metrics is 404)",
    )
    metrics_max_runs: int = Field(
        default=100,
        ge=0,
        le=100_000,
        description="Open runs with a `run` label in GET /metrics (the newest first); the "
        "others are left out and counted in rollout_broker_metrics_runs_omitted",
    )
    metrics_generators: int = Field(
        default=16,
        ge=0,
        le=10_000,
        description="Generators per run with a `generator` label of their own in GET /metrics "
        "(those with the most rollouts, and every quarantined one); the others are summed "
        'under generator="other"',
    )
    metrics_consumers: int = Field(
        default=16,
        ge=0,
        le=10_000,
        description="Consumers per run with a `consumer` label of their own in GET /metrics "
        "(those delivered the most items); the others are summed under "
        'consumer="(other)"',
    )

    # The accounting drain (``BROKER_DRAIN_*``); see docs/accounting.md.
    drain_batch_size: int = Field(
        default=500, ge=1, le=10_000, description="Stream entries per read and per transaction"
    )
    drain_block_ms: int = Field(
        default=200,
        ge=1,
        le=60_000,
        description="How long an idle pass waits (XREADGROUP BLOCK); at most half of "
        "redis_timeout_s, so that a blocked read is not taken for a Redis that stopped answering",
    )
    drain_claim_idle_ms: int = Field(
        default=30_000,
        ge=0,
        description="Idle time after which any consumer's pending entries are claimed (the "
        "fallback for consumers that send no heartbeat)",
    )
    drain_heartbeat_timeout_ms: int = Field(
        default=3_000,
        ge=100,
        le=600_000,
        description="A drain consumer with no heartbeat for this long is taken over: its pending "
        "entries move to a live one and it is deleted from the groups (heartbeats every quarter, "
        "at least every 15 s)",
    )
    drain_max_deliveries: int = Field(
        default=5, ge=1, le=1000, description="Failed deliveries before an entry is dead-lettered"
    )
    drain_trim: bool = Field(default=True, description="XTRIM acknowledged entries")
    drain_consumer: str | None = Field(
        default=None, description="Consumer name, unique per process; unset: host-pid-random"
    )

    @field_validator("redis_prefix")
    @classmethod
    def _safe_prefix(cls, v: str) -> str:
        if not _PREFIX_RE.match(v):
            raise ValueError("redis_prefix must be 1-64 characters of [A-Za-z0-9_.-]")
        return v

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_names(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.split(",")
        if not isinstance(v, list | tuple):
            return v
        names = [str(name).strip().lower().removesuffix(".") for name in v]
        for name in names:
            if name and not _HOST_NAME_RE.match(name):
                raise ValueError(
                    f"allowed_hosts: {name!r} is not a host name (no port, scheme or path)"
                )
        return tuple(name for name in names if name)

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("postgresql://") or v.startswith("postgres://"):
            # Accept the plain libpq form and pick the async driver for it.
            return "postgresql+asyncpg://" + v.split("://", 1)[1]
        if not v.startswith("postgresql+asyncpg://"):
            raise ValueError("database_url must be a postgresql+asyncpg:// URL")
        return v

    @model_validator(mode="after")
    def _waits_within_timeout(self) -> Settings:
        if self.drain_block_ms > self.redis_timeout_s * 1000 / 2:
            raise ValueError(
                f"BROKER_DRAIN_BLOCK_MS ({self.drain_block_ms} ms) must be at most half of "
                f"BROKER_REDIS_TIMEOUT_S ({self.redis_timeout_s:g} s): a blocked read that "
                "outlasts it fails as if Redis had stopped answering"
            )
        if self.redis_wait_replicas and self.redis_wait_timeout_ms > self.redis_timeout_s * 500:
            raise ValueError(
                f"BROKER_REDIS_WAIT_TIMEOUT_MS ({self.redis_wait_timeout_ms} ms) must be at most "
                f"half of BROKER_REDIS_TIMEOUT_S ({self.redis_timeout_s:g} s): a WAIT that "
                "outlasts it fails as if Redis had stopped answering"
            )
        return self

    @property
    def embedded(self) -> bool:
        """True when neither service is configured: start embedded Redis and Postgres."""
        return self.redis_url is None and self.database_url is None
