"""Run configuration (the SPEC's RunConfig) and the bounds every identifier and number obeys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model
from pydantic.fields import FieldInfo

from app.accounting.events import text_fault

# Versions and lags are exact doubles inside Redis's Lua: stay within 2**53.
MAX_VERSION = 2**53 - 1


def _ledger_text(value: str) -> str:
    """An id the scripts record must be one the accounting drain can apply: the ledger's own
    text rule (app/accounting/events.py), checked here on top of each id's pattern, so a
    pattern widened later cannot let through an id that would be dead-lettered."""
    fault = text_fault(value)
    if fault is not None:
        raise ValueError(fault)
    return value


LedgerText = AfterValidator(_ledger_text)

# Ids end up in Redis key names and in the ledger: printable, no spaces, bounded.
# A run id is a URL path segment: '.' and '..' would resolve away (a non-dot first, a non-dot
# second, or three characters or more).
RUN_ID_PATTERN = (
    r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,126}"
    r"|\.\.[A-Za-z0-9._-]{1,126})$"
)
# Not in an id: control characters, braces (Redis hash tags) and whitespace, spelled out rather
# than written \s, whose meaning differs between the regex engines that read these patterns:
# ECMA-262's (OpenAPI clients, JSON Schema) counts U+FEFF and not U+0085, Python's and Rust's
# (pydantic) the other way round. This is the union, so every reader admits the same ids.
ID_EXCLUDED = r"\x00-\x20\x7f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff{}"
ITEM_ID_PATTERN = rf"^[^{ID_EXCLUDED}]{{1,256}}$"
PROMPT_ID_PATTERN = rf"^[^{ID_EXCLUDED}]{{1,200}}$"
LEASE_ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN), LedgerText]
# Rollout, group, trainer and generator ids.
ItemId = Annotated[str, StringConstraints(pattern=ITEM_ID_PATTERN), LedgerText]
# A prompt's group ids are '<prompt_id>#<pass>.<attempt>': an ItemId whatever the numbers.
PromptId = Annotated[str, StringConstraints(pattern=PROMPT_ID_PATTERN), LedgerText]
# Client-chosen ids of batches and work leases, which make their calls safe to retry.
LeaseId = Annotated[str, StringConstraints(pattern=LEASE_ID_PATTERN), LedgerText]
MAX_EPOCHS = 1000  # passes per prompt: the prompt queue's order stays exact (app/broker/lua)

KlEstimator = Literal["k1", "k2", "k3"]
Order = Literal["freshest", "fifo", "random"]


class RunConfig(BaseModel):
    """Rules of one run; every field has the SPEC's default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_staleness: int = Field(1, ge=0, le=MAX_VERSION)
    max_reuse: int = Field(1, ge=1, le=10_000)
    kl_max: float = Field(0.05, ge=0, le=1e12, allow_inf_nan=False)
    kl_flush: float = Field(0.1, ge=0, le=1e12, allow_inf_nan=False)
    kl_estimator: KlEstimator = "k3"
    clip_epsilon: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False)
    group_size: int = Field(1, ge=1, le=4096)
    group_timeout_s: float = Field(600.0, gt=0, le=30 * 86400, allow_inf_nan=False)
    drop_zero_variance_groups: bool = False
    order: Order = "freshest"
    capacity_rollouts: int = Field(100_000, ge=1, le=1_000_000_000)
    lease_timeout_s: float = Field(300.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    step_groups: int | None = Field(None, ge=1, le=1_000_000_000)
    work_timeout_s: float = Field(1800.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    max_attempts: int = Field(3, ge=1, le=1000)

    def canonical_json(self) -> str:
        """The one text form of a config: how Redis stores it and how equality is judged."""
        return orjson.dumps(self.model_dump(), option=orjson.OPT_SORT_KEYS).decode()

    def merged(self, patch: RunConfigPatch) -> RunConfig:
        """This config with the patch's set fields applied, validated as a whole."""
        data: dict[str, Any] = self.model_dump()
        data.update(patch.model_dump(exclude_unset=True))
        return RunConfig.model_validate(data)


class _Patch(BaseModel):
    """What every RunConfigPatch is, as far as a type checker knows: its fields are RunConfig's,
    made at import time (create_model), so that a bound is written once."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _patch_field(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """A RunConfig field as a patch takes it: its bounds, None when absent. For step_groups,
    null is a value too (no staleness budget): absent is told apart by exclude_unset."""
    annotation: Any = field.annotation
    return annotation | None, FieldInfo.merge_field_infos(field, default=None)


if TYPE_CHECKING:
    RunConfigPatch = _Patch
else:
    RunConfigPatch = create_model(
        "RunConfigPatch",
        __base__=_Patch,
        __doc__="A partial RunConfig: only the fields present change.",
        **{name: _patch_field(field) for name, field in RunConfig.model_fields.items()},
    )
