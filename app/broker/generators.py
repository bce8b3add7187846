"""A rollout's ``generator_id`` by default (SPEC "Rollouts"): the work lease's, for a rollout of
a prompt attempt handed out in a lease that named a generator and still live when the rollout is
posted. Filled in before the ingest script runs, in the packed blob, so that the script stores
the blob as it is given.

An attempt's lease, and that lease's generator, never change, so the read holds for a rollout the
ingest accepts: an attempt that ended since is ``stale_attempt`` (its default does not matter), and
one not yet handed out when read has no lease to default to (a client can only post to it by
guessing its ``group_id``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import msgpack

from app.broker.packing import PackedRollout
from app.broker.partials import pass_of_group

__all__ = ["attempt_of_group", "named_by", "unnamed_attempts", "with_lease_generators"]


def attempt_of_group(group_id: str | None) -> tuple[str, int] | None:
    """The prompt attempt ('<prompt_id>#<pass>', attempt) a group id names when it has the form
    of one (:func:`~app.broker.partials.pass_of_group`), else None."""
    pk = pass_of_group(group_id)
    if pk is None or group_id is None:
        return None
    return pk, int(group_id.rpartition(".")[2])


def named_by(r: PackedRollout, generator_id: str) -> PackedRollout:
    """``r`` (which names no generator) with ``generator_id``: its blob, a msgpack map, gains
    the pair ``gi`` by a new header and the pair appended, without unpacking it."""
    blob = r.blob
    b = blob[0]
    if 0x80 <= b < 0x8F:
        head, rest = bytes([b + 1]), 1  # fixmap
    elif b == 0x8F:
        head, rest = b"\xde\x00\x10", 1  # 15 pairs and one more: map16
    elif b == 0xDE and blob[1:3] != b"\xff\xff":
        head, rest = b"\xde" + (int.from_bytes(blob[1:3], "big") + 1).to_bytes(2, "big"), 3
    else:
        raise ValueError(f"rollout {r.rollout_id!r}: its packed form is not a msgpack map")
    pair = msgpack.packb("gi") + msgpack.packb(generator_id)
    return dataclasses.replace(
        r, blob=b"".join((head, memoryview(blob)[rest:], pair)), generator_id=generator_id
    )


def unnamed_attempts(packed: Sequence[PackedRollout]) -> list[tuple[str, int]]:
    """The prompt attempts of the rollouts in ``packed`` that name no generator, each once:
    whose generators :func:`with_lease_generators` needs (``attempt_reads`` of
    app/broker/pass_reads.py reads them)."""
    wanted: dict[tuple[str, int], None] = {}
    for r in packed:
        if not r.has_generator:
            a = attempt_of_group(r.group_id)
            if a is not None:
                wanted[a] = None
    return list(wanted)


def with_lease_generators(
    packed: Sequence[PackedRollout], gens: Mapping[tuple[str, int], str]
) -> list[PackedRollout]:
    """``packed``, each rollout that names no generator and belongs to a live prompt attempt
    of a work lease that named one given that lease's ``generator_id``: ``gens``, by attempt,
    of :func:`unnamed_attempts`."""
    if not gens:
        return list(packed)
    out = []
    for r in packed:
        a = None if r.has_generator else attempt_of_group(r.group_id)
        gen = None if a is None else gens.get(a)
        out.append(r if gen is None else named_by(r, gen))
    return out
