"""Run configuration (the SPEC's RunConfig) and the bounds every identifier and number obeys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import orjson
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from app.ids import MAX_VERSION

MAX_EPOCHS = 1000  # passes per prompt: the prompt queue's order stays exact (app/broker/lua)

KlEstimator = Literal["k1", "k2", "k3"]
Order = Literal["auto", "freshest", "fifo", "random"]
StaleTokens = Literal["keep", "mask"]
CorrectionLevel = Literal["token", "sequence", "geometric"]
CorrectionMode = Literal["truncate", "mask", "none"]

# The largest bound a correction takes: far below float32's largest value, where the weights it
# computes saturate (app/broker/correction.py), so a weight at the cap is always above `high`.
MAX_CORRECTION_BOUND = 1e30


class Correction(BaseModel):
    """The importance-weight rule of ``measure`` (SPEC "Correction before the update"): the
    ratio each weight comes from (``level``), what is done with it (``mode``) and the bounds;
    every field has the SPEC's default. ``low`` only matters to ``mask``, and may not be above
    ``high``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    level: CorrectionLevel = "token"
    mode: CorrectionMode = "truncate"
    low: float = Field(0.0, ge=0, le=MAX_CORRECTION_BOUND, allow_inf_nan=False)
    high: float = Field(2.0, gt=0, le=MAX_CORRECTION_BOUND, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Correction:
        """Bounds the wrong way round would mask every token: refused rather than obeyed."""
        if self.low > self.high:
            raise ValueError(f"correction low ({self.low}) is above high ({self.high})")
        return self


class PoolWeights(BaseModel):
    """How often work leases draw from each difficulty pool, per prompt queued in it; 0 skips
    the pool (its prompts finish their pass as ``skipped``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    easy: float = Field(1.0, ge=0, le=1e12, allow_inf_nan=False)
    normal: float = Field(1.0, ge=0, le=1e12, allow_inf_nan=False)
    hard: float = Field(1.0, ge=0, le=1e12, allow_inf_nan=False)


class Difficulty(BaseModel):
    """Prompt pools by past reward (SPEC "Difficulty"): a prompt whose last completed group's
    mean reward is above ``easy_above`` is easy, below ``hard_below`` hard, else (or with no
    such group yet) normal. A patch replaces it whole."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    easy_above: float = Field(ge=-1e12, le=1e12, allow_inf_nan=False)
    hard_below: float = Field(ge=-1e12, le=1e12, allow_inf_nan=False)
    weights: PoolWeights = Field(default_factory=PoolWeights)

    @model_validator(mode="after")
    def _ordered(self) -> Difficulty:
        """Thresholds the wrong way round would put a prompt in two pools; weights that are all
        0 would skip every prompt: both refused."""
        if self.hard_below > self.easy_above:
            raise ValueError(
                f"difficulty hard_below ({self.hard_below}) is above easy_above ({self.easy_above})"
            )
        w = self.weights
        if w.easy == w.normal == w.hard == 0:
            raise ValueError("difficulty weights are all 0: every prompt would be skipped")
        return self


class RunConfig(BaseModel):
    """Rules of one run; every field has the SPEC's default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_staleness: int = Field(1, ge=0, le=MAX_VERSION)
    max_reuse: int = Field(1, ge=1, le=10_000)
    kl_max: float = Field(0.05, ge=0, le=1e12, allow_inf_nan=False)
    kl_flush: float = Field(0.1, ge=0, le=1e12, allow_inf_nan=False)
    kl_flush_window: int = Field(1, ge=1, le=1_000_000)
    # The adaptive KL penalty (null: off); its β lives in the run hash (app/broker/lua/ack.lua).
    kl_coef: float | None = Field(None, ge=0, le=1e12, allow_inf_nan=False)
    kl_target: float = Field(0.02, gt=0, le=1e12, allow_inf_nan=False)
    kl_horizon: int = Field(10_000, ge=1, le=1_000_000_000)
    kl_estimator: KlEstimator = "k3"
    clip_epsilon: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False)
    group_size: int = Field(1, ge=1, le=4096)
    group_timeout_s: float = Field(600.0, gt=0, le=30 * 86400, allow_inf_nan=False)
    drop_zero_variance_groups: bool = False
    # 'auto' is 'fifo' while step_groups is set (the budget's promise needs oldest first), else
    # 'freshest': resolved at each lease (lua/lease.lua), so it follows a patch of step_groups.
    order: Order = "auto"
    # A rollout sampled across versions is judged by v_old ('keep'), or by v_new with its
    # tokens too stale at hand-out given with loss_mask 0 ('mask'): app/broker/tokens.py.
    stale_tokens: StaleTokens = "keep"
    capacity_rollouts: int = Field(100_000, ge=1, le=1_000_000_000)
    lease_timeout_s: float = Field(300.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    step_groups: int | None = Field(None, ge=1, le=1_000_000_000)
    work_timeout_s: float = Field(1800.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    max_attempts: int = Field(3, ge=1, le=1000)
    reward_timeout_s: float = Field(600.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    max_reward_attempts: int = Field(3, ge=1, le=1000)
    # measure's importance-weight rule (app/broker/correction.py); a patch replaces it whole.
    correction: Correction = Field(default_factory=Correction)
    # Per-generator quarantine (app/broker/lua/lib/generators.lua); null: off.
    generator_kl_max: float | None = Field(None, ge=0, le=1e12, allow_inf_nan=False)
    generator_window_tokens: int = Field(100_000, ge=1, le=1_000_000_000_000)
    # Prompt pools by past reward (app/broker/lua/lib/pools.lua); null: queue order.
    difficulty: Difficulty | None = None

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
    return annotation | None, FieldInfo.merge_field_infos(field, default=None, default_factory=None)


if TYPE_CHECKING:
    RunConfigPatch = _Patch
else:
    RunConfigPatch = create_model(
        "RunConfigPatch",
        __base__=_Patch,
        __doc__="A partial RunConfig: only the fields present change.",
        **{name: _patch_field(field) for name, field in RunConfig.model_fields.items()},
    )


NULLABLE_CONFIG: Final = frozenset(
    name
    for name, field in RunConfig.model_fields.items()
    if type(None) in get_args(field.annotation)
)
"""The RunConfig fields whose value may be null (step_groups: no staleness budget): the only
ones a config patch may set to null (app/broker/endpoints/runs.py refuses the others)."""
