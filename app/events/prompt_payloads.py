"""The payloads of the events about prompts: registration, work leases, prompt passes' states,
partial rollouts and each prompt's group means (see app/events/payloads.py for the rest)."""

from __future__ import annotations

from app.events.wire import _wire_class, wire


@_wire_class
class RegisteredItem:
    prompt_id: str = wire("text")
    passes: int = wire("int", minimum=1, note="`epochs`: passes 1..passes are queued")


@_wire_class
class Registered:
    items: tuple[RegisteredItem, ...] = wire("items", of=RegisteredItem)


@_wire_class
class WorkItem:
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    attempt: int = wire("int", minimum=1)


@_wire_class
class WorkLeased:
    lease_id: str = wire("text")
    generator_id: str | None = wire("text", optional=True, note="str or nil")
    policy_version: int = wire("int", note="the run's V when handed out")
    expires_at_ms: int = wire("int", key="expires_at", minimum=0, note="ms")
    items: tuple[WorkItem, ...] = wire("items", of=WorkItem)
    wait_ms: int = wire(
        "int", optional=True, minimum=0, default=0, note="ms the generator's request waited"
    )


@_wire_class
class PassItem:
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    attempt: int = wire("int", minimum=1, note="the attempt this state belongs to")
    state: str = wire(
        "text", note="`queued`, `in_flight`, `done`, `failed`, `skipped`, `cancelled`"
    )
    tries: int = wire("int", minimum=0, note="attempts that retired unused or expired")


@_wire_class
class PassesChanged:
    cause: str = wire(
        "text",
        note="`returned`, `expired` (work lease), `rejected` (a rollout of its attempt was "
        "rejected `stale`, in `rejected`: the attempt ended), `retired` (its group retired: the "
        "reason is in `retired`), `acked` (first use), `rewound` (a rewind undid the batches "
        "that completed it: `in_flight` at a later attempt while its group is buffered, else "
        "`queued`; or it ended the pass's work lease, taken above `W`: `queued`; neither is a "
        "try), `skipped` (queued in a pool of weight 0: `skipped`, its pass over without "
        "generation), `closed` (queued when its run closed: `cancelled`); a pass of a closed "
        "run that would go back to the queue is `cancelled` under the cause that ended it",
    )
    lease_id: str | None = wire("text", optional=True, note="the work lease, when one")
    items: tuple[PassItem, ...] = wire("items", of=PassItem)


@_wire_class
class PromptScoredItem:
    prompt_id: str = wire("text")
    mean: float = wire("float", note="the mean reward of the group")
    rollouts: int = wire("int", minimum=1, note="the group's size")


@_wire_class
class PromptScored:
    """Groups of prompt passes' attempts complete with every reward in: each prompt's newest
    mean reward, by which its difficulty pool is judged."""

    items: tuple[PromptScoredItem, ...] = wire("items", of=PromptScoredItem)


@_wire_class
class PartialItem:
    rollout_id: str = wire("text")
    prompt_id: str = wire("text")
    pass_: int = wire("int", key="pass", minimum=1)
    policy_version: int = wire("int", note="the partial's (its oldest token's version)")
    tokens: int = wire("int", minimum=0, note="response tokens sampled so far")


@_wire_class
class PartialsChanged:
    change: str = wire(
        "text",
        note="`returned` (given back with its prompt, or brought back by an attempt that ended "
        "unfinished), `resumed` (handed out with a work lease), `dropped`",
    )
    reason: str | None = wire(
        "text",
        optional=True,
        note="`dropped`: `stale` / `kl_flush` (too stale when handed out), `unused` (its group "
        "completed without it), `failed` (its pass failed), `skipped` (its pass was skipped), "
        "`cancelled` (its pass was cancelled: the run closed), "
        "`rewound` (a token sampled above the run's version when handed out, after a rewind)",
    )
    lease_id: str | None = wire("text", optional=True, note="the work lease, when one")
    items: tuple[PartialItem, ...] = wire("items", of=PartialItem)
