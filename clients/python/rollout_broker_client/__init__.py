"""The Python client of Rollout Broker, blocking (:class:`BrokerClient`) and asyncio
(:class:`AsyncBrokerClient`), over httpx.

Generators post rollouts through a writer that batches them, retries safely and waits out
``429`` backpressure, or take their prompts from the broker in a loop of work leases that gives
back every prompt it did not post; reward workers score rollouts posted without a reward in a
loop of reward leases that gives back every rollout it did not score; trainers lease batches in
a context manager that acks on a normal exit and nacks on an exception; operators register
prompts and read runs and the accounting, and manage access tokens and read the audit log of a
broker with auth on. A client sends ``token=`` (default: the ``BROKER_TOKEN`` environment
variable) as a bearer token::

    from rollout_broker_client import BrokerClient, Rollout

    with BrokerClient("http://127.0.0.1:8000") as broker:
        broker.create_run("demo", {"group_size": 4, "max_reuse": 2})
        with broker.writer("demo") as w:
            w.add(*[Rollout(f"p0-{k}", 0, tokens[k], rewards[k], logprobs[k], group_id="p0")
                    for k in range(4)])
        with broker.lease("demo", size=4, wait_s=5) as batch:
            if batch is not None:
                batch.ack_with([policy_logprobs(r) for r in batch])
        print(broker.wait_for_accounting("demo").samples_consumed)
"""

from rollout_broker_client._asgi import SyncASGITransport
from rollout_broker_client._async import (
    AsyncBrokerClient,
    AsyncLease,
    AsyncRewardLoop,
    AsyncRewardWork,
    AsyncRolloutWriter,
    AsyncWork,
    AsyncWorkLoop,
)
from rollout_broker_client._errors import (
    BadRequest,
    BatchNotFound,
    BatchSettled,
    BrokerError,
    BrokerHTTPError,
    BrokerUnreachable,
    Conflict,
    Forbidden,
    InternalError,
    LeaseExpired,
    NotFound,
    OverCapacity,
    PayloadTooLarge,
    RewardConflict,
    RewardLeaseNotFound,
    RewardLeaseOver,
    RunClosed,
    RunConflict,
    RunNotFound,
    ServerError,
    TokenNotFound,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    ValidationFailed,
    VersionConflict,
    WorkLeaseNotFound,
    WorkLeaseOver,
)
from rollout_broker_client._models import (
    AccessToken,
    Accounting,
    AckResult,
    AuditEntry,
    AuditPage,
    Batch,
    BatchCounts,
    BatchStats,
    GeneratorAccounting,
    IngestResult,
    IsRatioStats,
    KlStats,
    LagStats,
    LeasedRollout,
    NewToken,
    Partial,
    PartialCounts,
    PolicyResult,
    PolicyVersion,
    Prompt,
    PromptCounts,
    PromptState,
    PromptStateName,
    RegisterResult,
    Rejection,
    RewardCounts,
    RewardLease,
    RewardRollout,
    Rollout,
    Run,
    RunConfig,
    Scope,
    ScoreResult,
    TrainingVersion,
    VersionAccounting,
    WaitStats,
    WorkLease,
    WorkPrompt,
)
from rollout_broker_client._sync import (
    DEFAULT_URL,
    BrokerClient,
    Lease,
    RewardLoop,
    RewardWork,
    RolloutWriter,
    Work,
    WorkLoop,
)
from rollout_broker_client._wire import Retry

__version__ = "0.1.0"  # the distribution's, as in clients/python/pyproject.toml (a test keeps both)

__all__ = [
    "DEFAULT_URL",
    "AccessToken",
    "Accounting",
    "AckResult",
    "AsyncBrokerClient",
    "AsyncLease",
    "AsyncRewardLoop",
    "AsyncRewardWork",
    "AsyncRolloutWriter",
    "AsyncWork",
    "AsyncWorkLoop",
    "AuditEntry",
    "AuditPage",
    "BadRequest",
    "Batch",
    "BatchCounts",
    "BatchNotFound",
    "BatchSettled",
    "BatchStats",
    "BrokerClient",
    "BrokerError",
    "BrokerHTTPError",
    "BrokerUnreachable",
    "Conflict",
    "Forbidden",
    "GeneratorAccounting",
    "IngestResult",
    "InternalError",
    "IsRatioStats",
    "KlStats",
    "LagStats",
    "Lease",
    "LeaseExpired",
    "LeasedRollout",
    "NewToken",
    "NotFound",
    "OverCapacity",
    "Partial",
    "PartialCounts",
    "PayloadTooLarge",
    "PolicyResult",
    "PolicyVersion",
    "Prompt",
    "PromptCounts",
    "PromptState",
    "PromptStateName",
    "RegisterResult",
    "Rejection",
    "Retry",
    "RewardConflict",
    "RewardCounts",
    "RewardLease",
    "RewardLeaseNotFound",
    "RewardLeaseOver",
    "RewardLoop",
    "RewardRollout",
    "RewardWork",
    "Rollout",
    "RolloutWriter",
    "Run",
    "RunClosed",
    "RunConfig",
    "RunConflict",
    "RunNotFound",
    "Scope",
    "ScoreResult",
    "ServerError",
    "SyncASGITransport",
    "TokenNotFound",
    "TrainingVersion",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "ValidationFailed",
    "VersionAccounting",
    "VersionConflict",
    "WaitStats",
    "Work",
    "WorkLease",
    "WorkLeaseNotFound",
    "WorkLeaseOver",
    "WorkLoop",
    "WorkPrompt",
]
