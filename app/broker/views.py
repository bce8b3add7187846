"""The broker's records as the API shows them: runs and work leases."""

from __future__ import annotations

from datetime import UTC, datetime

import msgpack

from app.broker.packing import unpack_rollouts
from app.broker.partials import partial_out
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
                partials=[partial_out(p, item.group_id) for p in unpack_rollouts(item.partials)],
            )
        )
    return WorkOut(
        lease_id=lease.lease_id,
        policy_version=lease.policy_version,
        expires_at=iso_ms(lease.expires_at_ms),
        prompts=prompts,
    )
