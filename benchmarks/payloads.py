"""The rollouts every benchmark sends: 1024 response tokens with behaviour logprobs.

Bodies are built from byte templates split around the rollout id, so building a request of 64
rollouts costs a join rather than a fresh encode of 64 x 2048 numbers: the client stays cheap
and the figures measure the server. Every rollout of a request still has its own id. The
long-rollout rows build the same payload at ``LONG_TOKENS`` (``make_payload(tokens=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import orjson

TOKENS = 1024
VOCAB = 151_936  # a current LLM vocabulary size (token ids need 18 bits)
RAW_BYTES = TOKENS * 4 + TOKENS * 4  # int32 ids + float32 logprobs
LONG_TOKENS = 32_768  # a reasoning run's rollout: the long-rollout rows
ID_LEN = 32  # the length of a uuid4 hex, a common rollout id
_PLACEHOLDER = "Q" * ID_LEN


def rollout_id(tag: str, worker: int, i: int) -> str:
    """A unique 32-character id: ``tag`` (a short name of the scenario), worker, sequence."""
    rid = f"{tag}-{worker:03d}-{i:010d}"
    if len(rid) > ID_LEN:
        raise ValueError(f"rollout id {rid!r} is longer than {ID_LEN}")
    return rid.rjust(ID_LEN, "0")


@dataclass(frozen=True)
class Payload:
    ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    ack_logprobs: np.ndarray  # float32: the "current policy" a trainer acks with
    json_pre: bytes
    json_post: bytes
    mp_pre: bytes
    mp_post: bytes
    ack_json: bytes  # the ack logprobs as a JSON list
    ack_raw: bytes  # the ack logprobs as little-endian float32 bytes

    def json_item(self, rid: str) -> bytes:
        return self.json_pre + orjson.dumps(rid) + self.json_post

    def msgpack_item(self, rid: str) -> bytes:
        return self.mp_pre + msgpack.packb(rid) + self.mp_post

    def item(self, fmt: str, rid: str) -> bytes:
        return self.msgpack_item(rid) if fmt == "msgpack" else self.json_item(rid)


def _split(blob: bytes, marker: bytes) -> tuple[bytes, bytes]:
    if blob.count(marker) != 1:
        raise RuntimeError("the rollout id placeholder is not unique in the template")
    pre, post = blob.split(marker)
    return pre, post


def raw_bytes(tokens: int) -> int:
    """The raw array bytes of a rollout of ``tokens`` tokens: int32 ids + float32 logprobs."""
    return tokens * 4 + tokens * 4


def segmented(tokens: int, segments: int) -> dict[str, Any]:
    """The fields of a multi-turn rollout sampled across ``segments`` versions (0 upwards, one
    per segment of equal length): ``versions``, and a ``loss_mask`` with the last quarter of
    every other segment masked (a tool's output). JSON lists; ``loss_mask`` as uint8 bytes for
    msgpack is made by the caller."""
    seg = tokens // segments
    mask = np.ones(tokens, dtype=np.uint8)
    for i in range(1, segments, 2):
        mask[(i + 1) * seg - seg // 4 : (i + 1) * seg] = 0
    return {"versions": [[i * seg, i] for i in range(segments)], "loss_mask": mask}


def make_payload(seed: int = 0, tokens: int = TOKENS, segments: int = 0) -> Payload:
    """A rollout's payload; with ``segments``, a multi-turn one (:func:`segmented`)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, tokens, dtype=np.int64).astype("<i4")
    # Sampled-token logprobs: mostly near 0, a tail of unlikely tokens.
    logprobs = (-rng.exponential(0.7, tokens)).astype("<f4")
    # The current policy after one small step: KL far below kl_max, nothing retires for KL.
    ack_lp = np.minimum(logprobs + rng.normal(0.0, 0.01, tokens), 0.0).astype("<f4")
    base = {
        "rollout_id": _PLACEHOLDER,
        "policy_version": 0,
        "reward": 1.0,
        "finish_reason": "stop",
    }
    js_extra: dict[str, Any] = {}
    mp_extra: dict[str, Any] = {}
    if segments:
        extra = segmented(tokens, segments)
        js_extra = {**extra, "loss_mask": extra["loss_mask"].tolist()}
        mp_extra = {**extra, "loss_mask": extra["loss_mask"].tobytes()}
    js = orjson.dumps(
        {
            **base,
            "response_ids": ids.tolist(),
            "logprobs": [float(x) for x in logprobs],  # float32 values as a client has them
            **js_extra,
        }
    )
    mp = msgpack.packb(
        {**base, "response_ids": ids.tobytes(), "logprobs": logprobs.tobytes(), **mp_extra},
        use_bin_type=True,
    )
    json_pre, json_post = _split(js, orjson.dumps(_PLACEHOLDER))
    mp_pre, mp_post = _split(mp, msgpack.packb(_PLACEHOLDER))
    return Payload(
        ids=ids,
        logprobs=logprobs,
        ack_logprobs=ack_lp,
        json_pre=json_pre,
        json_post=json_post,
        mp_pre=mp_pre,
        mp_post=mp_post,
        ack_json=orjson.dumps([float(x) for x in ack_lp]),
        ack_raw=ack_lp.tobytes(),
    )


def ingest_body(fmt: str, items: list[bytes]) -> bytes:
    """``{"rollouts": [...]}`` around already-encoded items."""
    if fmt == "msgpack":
        head = msgpack.Packer().pack_map_header(1) + msgpack.packb("rollouts")
        return head + msgpack.Packer().pack_array_header(len(items)) + b"".join(items)
    return b'{"rollouts":[' + b",".join(items) + b"]}"


def ack_body(fmt: str, rollout_ids: list[str], payload: Payload) -> bytes:
    """An ack carrying the current policy's logprobs for every rollout of the batch."""
    if fmt == "msgpack":
        return msgpack.packb(
            {"logprobs": dict.fromkeys(rollout_ids, payload.ack_raw)}, use_bin_type=True
        )
    parts = [orjson.dumps(rid) + b":" + payload.ack_json for rid in rollout_ids]
    return b'{"logprobs":{' + b",".join(parts) + b"}}"


CONTENT_TYPE = {"msgpack": "application/msgpack", "json": "application/json"}


# -- prompts (work leases) ------------------------------------------------------------------
PROMPT_TOKENS = 256  # prompt_ids per registered prompt: a long-ish maths or code question


@dataclass(frozen=True)
class PromptPayload:
    """One prompt's JSON item split around its id, and the stored form the raw ceiling keeps."""

    pre: bytes
    post: bytes
    stored: bytes  # msgpack {"i": prompt_ids, "d": data}, the broker's stored form

    def body(self, prompt_ids: list[str]) -> bytes:
        """``{"prompts": [...]}`` for these prompt ids, every prompt the same but its id."""
        items = [self.pre + orjson.dumps(pid) + self.post for pid in prompt_ids]
        return b'{"prompts":[' + b",".join(items) + b"]}"


def make_prompt(seed: int = 1) -> PromptPayload:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int64).tolist()
    data = {"answer": "42", "source": "bench"}
    item = orjson.dumps({"prompt_id": _PLACEHOLDER, "prompt_ids": ids, "data": data})
    pre, post = _split(item, orjson.dumps(_PLACEHOLDER))
    return PromptPayload(pre, post, msgpack.packb({"i": ids, "d": data}))


# -- one maximal body -------------------------------------------------------------------------
BIG_TOKENS = 262_144  # the broker's default max_tokens_per_rollout
BIG_BODY_LIMIT = 64 * 1024 * 1024  # its default max_body_bytes


def big_json_body(rollouts: int, tag: str = "big") -> bytes:
    """``{"rollouts": [...]}`` of ``rollouts`` JSON rollouts of 262,144 tokens each, about 9
    bytes of JSON a token (ids below 1,000, one-decimal logprobs, as in the trial that found a
    64 MB ingest stalling the server for a second); 28 of them are the most that fit in 64 MiB."""
    rng = np.random.default_rng(2)
    ids = b",".join(b"%d" % x for x in rng.integers(0, 1000, BIG_TOKENS).tolist())
    lps = b",".join(b"-%.1f" % x for x in rng.uniform(0.0, 9.9, BIG_TOKENS).tolist())
    items = [
        b'{"rollout_id":'
        + orjson.dumps(rollout_id(tag, 0, i))
        + b',"policy_version":0,"reward":1.0,"response_ids":['
        + ids
        + b'],"logprobs":['
        + lps
        + b"]}"
        for i in range(rollouts)
    ]
    return ingest_body("json", items)
