"""The broker's records as the API shows them: runs and work leases."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgpack

from app.broker.packing import StoredRollout, unpack_rollouts
from app.broker.partials import partial_doc
from app.broker.records import RunState, WorkLease
from app.broker.schemas import Run, WorkOut, WorkPrompt


def iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")


def run_view(state: RunState) -> Run:
    return Run(
        run_id=state.run_id,
        config=state.config,
        policy_version=state.policy_version,
        status=state.status,
        created_at=iso_ms(state.created_at_ms),
    )


@dataclass(frozen=True, slots=True)
class WorkAnswer:
    """A work lease as the API answers it: its :class:`WorkOut` (without partials) and the
    partials of each of its prompts, in order, unpacked."""

    out: WorkOut
    partials: list[list[StoredRollout]]

    def body(self) -> dict[str, Any]:
        """The answer's body (arrays as numpy: raw bytes in msgpack, lists in JSON)."""
        doc = self.out.model_dump(by_alias=True)
        for prompt, partials in zip(doc["prompts"], self.partials, strict=True):
            prompt["partials"] = [partial_doc(p, prompt["group_id"]) for p in partials]
        return doc


def work_answer(lease: WorkLease) -> WorkAnswer:
    return WorkAnswer(work_out(lease), [unpack_rollouts(item.partials) for item in lease.items])


def work_out(lease: WorkLease) -> WorkOut:
    prompts = []
    for item in lease.items:
        stored = msgpack.unpackb(item.blob, raw=False)
        prompts.append(
            WorkPrompt(
                prompt_id=item.prompt_id,
                pass_=item.pass_,
                attempt=item.attempt,
                group_id=item.group_id,
                prompt_ids=stored["i"],
                data=stored["d"],
            )
        )
    return WorkOut(
        lease_id=lease.lease_id,
        policy_version=lease.policy_version,
        expires_at=iso_ms(lease.expires_at_ms),
        prompts=prompts,
    )
