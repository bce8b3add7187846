"""What the broker adds to the API description (:class:`app.api.OpenAPIPart`): the bounds of
its bodies and queries that are settings (what app/broker/service.py and packing.py enforce),
the config patch's null rule, the pattern of its path ids, and the models of its msgpack
answers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from pydantic import BaseModel, Field
from rollout_broker_client.protocol import MAX_TOKEN_ID

from app.api import Keywords, OpenAPIPart
from app.broker.config import NULLABLE_CONFIG, RunConfigPatch
from app.broker.consumer_schemas import ConsumerBatchOut, ConsumerRolloutOut, PairOut
from app.broker.schemas import (
    AckBody,
    BatchOut,
    IngestJSON,
    LeasedRolloutOut,
    MeasureBody,
    MeasureResult,
    PartialJSON,
    PromptJSON,
    PromptsBody,
    ReturnBody,
    RewardLeaseBody,
    RewardLeaseOut,
    RewardReturnBody,
    RewardRolloutOut,
    RolloutJSON,
    ScoreBody,
    WorkBody,
)
from app.ids import CONSUMER_NAME_PATTERN, LEASE_ID_PATTERN, RUN_ID_PATTERN
from app.settings import Settings

TOKEN_ID: Final[Mapping[str, Any]] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
LOGPROB: Final[Mapping[str, Any]] = {
    "type": "number",
    "maximum": 0,
    "minimum": float(np.finfo(np.float32).min),  # logprobs are stored as float32
}


def field_keywords(s: Settings) -> dict[tuple[type[BaseModel], str], Keywords]:
    """JSON Schema keywords of body fields, from the settings the broker enforces them with."""
    tokens = s.max_tokens_per_rollout
    data: Keywords = {
        "description": f"Free-form JSON, at most {s.max_prompt_data_bytes} bytes as compact "
        "JSON: finite numbers, 64-bit integers, nested at most 16 deep"
    }
    if s.max_prompt_data_bytes < 2:  # even {} is 2 bytes: no object fits
        data = {"type": "null", "description": "This broker takes no prompt data"}
    return {
        (IngestJSON, "rollouts"): {"maxItems": s.max_rollouts_per_request},
        **_rollout_keywords(RolloutJSON, tokens),
        **_rollout_keywords(PartialJSON, tokens),
        (ReturnBody, "partials"): {"maxItems": s.max_rollouts_per_request},
        (AckBody, "logprobs"): {
            "additionalProperties": {"type": "array", "maxItems": tokens, "items": LOGPROB},
            "description": "The current policy's logprobs of each rollout of the batch, one "
            "per response token, by rollout id",
        },
        (MeasureBody, "logprobs"): {
            "additionalProperties": {"type": "array", "maxItems": tokens, "items": LOGPROB},
            "description": "The trainer's logprobs of every rollout of the batch, one per "
            "response token, by rollout id, from its forward pass before the update",
        },
        (PromptsBody, "prompts"): {
            "maxItems": s.max_prompts_per_request,
            "description": f"At most {s.max_prompts_per_request} prompt passes (prompts × "
            "epochs) in one request",
        },
        (PromptJSON, "prompt_ids"): {"maxItems": s.max_tokens_per_prompt, "items": TOKEN_ID},
        (PromptJSON, "data"): data,
        (WorkBody, "max_prompts"): {"maximum": s.max_prompts_per_lease},
        (WorkBody, "wait_s"): {"maximum": s.max_wait_s},
        (RewardLeaseBody, "max_rollouts"): {"maximum": s.max_rollouts_per_request},
        (RewardLeaseBody, "wait_s"): {"maximum": s.max_wait_s},
        # Keys that are not rollout ids are refused too (patternProperties alone lets them by).
        (ScoreBody, "rewards"): {
            "maxProperties": s.max_rollouts_per_request,
            "additionalProperties": False,
        },
        (RewardReturnBody, "rollout_ids"): {"maxItems": s.max_rollouts_per_request},
    }


def _rollout_keywords(
    model: type[BaseModel], tokens: int
) -> dict[tuple[type[BaseModel], str], Keywords]:
    """The keywords of a rollout's fields, for rollouts posted and partials given back."""
    return {
        (model, "response_ids"): {"minItems": 1, "maxItems": tokens, "items": TOKEN_ID},
        (model, "prompt_ids"): {"maxItems": tokens, "items": TOKEN_ID},
        (model, "logprobs"): {
            "maxItems": tokens,
            "items": LOGPROB,
            "description": "One per response token (as many as response_ids)",
        },
        (model, "loss_mask"): {
            "maxItems": tokens,
            "items": {"type": "integer", "minimum": 0, "maximum": 1},
            "description": "0 for each response token not to train on, else 1 (as many as "
            "response_ids, at least one 1); default all 1",
        },
        (model, "versions"): {
            "maxItems": tokens,
            "description": "[[offset, version], ...]: the version that sampled each response "
            "token from offset on; offsets strictly increasing from 0 and inside the response, "
            "versions non-decreasing, the oldest over trained tokens the policy_version; "
            "default [[0, policy_version]]",
        },
        (model, "metadata"): {
            "description": "Free-form JSON: finite numbers, 64-bit integers, nested at most 16 deep"
        },
    }


def query_keywords(s: Settings) -> dict[tuple[str, str, str], Keywords]:
    """(method, path, query parameter) → the keywords of the bounds that are settings."""
    return {
        ("get", "/v1/runs/{run_id}/batch", "size"): {"maximum": s.max_batch_size},
        ("get", "/v1/runs/{run_id}/batch", "wait_s"): {"maximum": s.max_wait_s},
        ("get", "/v1/runs/{run_id}/policy", "wait_s"): {"maximum": s.max_wait_s},
        ("get", CONSUMER_BATCH, "size"): {"maximum": s.max_batch_size},
        ("get", CONSUMER_BATCH, "wait_s"): {"maximum": s.max_wait_s},
    }


CONSUMER_BATCH: Final = "/v1/runs/{run_id}/consumers/{name}/batch"


# -- documentation-only models ---------------------------------------------------------------


class LeasedRolloutMsgpack(LeasedRolloutOut):
    """A leased rollout in a msgpack answer: its arrays are raw little-endian bytes."""

    prompt_ids: bytes | None = Field(description="int32 token ids")  # type: ignore[assignment]
    response_ids: bytes = Field(description="int32 token ids")  # type: ignore[assignment]
    logprobs: bytes | None = Field(description="float32 logprobs")  # type: ignore[assignment]
    loss_mask: bytes | None = Field(description="uint8 0/1 per token")  # type: ignore[assignment]


class BatchOutMsgpack(BatchOut):
    """A leased batch as a msgpack answer."""

    rollouts: list[LeasedRolloutMsgpack]  # type: ignore[assignment]


class MeasureResultMsgpack(MeasureResult):
    """A measure's answer as a msgpack answer: each rollout's weights are float32 bytes."""

    weights: dict[str, bytes] = Field(  # type: ignore[assignment]
        description="Per rollout, one float32 (little-endian) weight per response token"
    )


class RewardRolloutMsgpack(RewardRolloutOut):
    """A rollout to score in a msgpack answer: its arrays are raw little-endian bytes."""

    prompt_ids: bytes | None = Field(description="int32 token ids")  # type: ignore[assignment]
    response_ids: bytes = Field(description="int32 token ids")  # type: ignore[assignment]
    loss_mask: bytes | None = Field(description="uint8 0/1 per token")  # type: ignore[assignment]


class ConsumerRolloutMsgpack(ConsumerRolloutOut):
    """A consumer's rollout in a msgpack answer: its arrays are raw little-endian bytes."""

    prompt_ids: bytes | None = Field(description="int32 token ids")  # type: ignore[assignment]
    response_ids: bytes = Field(description="int32 token ids")  # type: ignore[assignment]
    logprobs: bytes | None = Field(description="float32 logprobs")  # type: ignore[assignment]
    loss_mask: bytes | None = Field(description="uint8 0/1 per token")  # type: ignore[assignment]


class PairMsgpack(PairOut):
    """A preference pair in a msgpack answer."""

    chosen: ConsumerRolloutMsgpack
    rejected: ConsumerRolloutMsgpack


class ConsumerBatchOutMsgpack(ConsumerBatchOut):
    """A consumer's batch as a msgpack answer."""

    rollouts: list[ConsumerRolloutMsgpack] | None = None  # type: ignore[assignment]
    pairs: list[PairMsgpack] | None = None  # type: ignore[assignment]


class RewardLeaseOutMsgpack(RewardLeaseOut):
    """A reward lease as a msgpack answer."""

    rollouts: list[RewardRolloutMsgpack]  # type: ignore[assignment]


OPENAPI: Final = OpenAPIPart(
    field_keywords=field_keywords,
    query_keywords=query_keywords,
    # A config patch's field is absent or a value, null only where RunConfig allows it.
    never_null={RunConfigPatch: frozenset(RunConfigPatch.model_fields) - NULLABLE_CONFIG},
    # The endpoints take these ids by their types (app/ids.py): one of another shape is 422
    # (ids chosen by the broker match too: uuid4().hex).
    path_ids={
        "run_id": RUN_ID_PATTERN,
        "batch_id": LEASE_ID_PATTERN,
        "lease_id": LEASE_ID_PATTERN,
        "name": CONSUMER_NAME_PATTERN,
    },
)
"""The broker's part of the API description."""
