"""The default generator_id added to a packed rollout (app/broker/generators.py): the blob's
msgpack map gains the pair whatever the size of its header."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from app.broker.generators import attempt_of_group, named_by
from app.broker.packing import pack_rollout, unpack_rollouts


def packed(**extra: object):
    return pack_rollout(
        rollout_id="r",
        group_id="p#1.2",
        policy_version=0,
        prompt_ids=None,
        response_ids=[1, 2, 3],
        logprobs=None,
        reward=1.0,
        finish_reason=None,
        metadata=None,
        max_tokens=16,
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("pairs", [0, 9, 10, 20])  # of 6 pairs to 6, 15 (fixmap), 16, 26 (map16)
def test_the_pair_is_added_to_maps_of_every_header(pairs):
    r = packed()
    assert r.generator_id is None
    doc = msgpack.unpackb(r.blob)
    doc.update({f"x{i}": i for i in range(pairs)})
    r = dataclasses.replace(r, blob=msgpack.packb(doc, use_bin_type=True))
    named = named_by(r, "gen-a")
    assert named.generator_id == "gen-a"  # what ingest.lua is given beside the blob
    assert msgpack.unpackb(named.blob, raw=False) == {**doc, "gi": "gen-a"}
    (stored,) = unpack_rollouts([named.blob])
    assert stored.generator_id == "gen-a"


def test_a_rollout_that_names_its_generator_says_so():
    assert packed(generator_id="gen-b").generator_id == "gen-b"


@pytest.mark.parametrize(
    ("gid", "attempt"),
    [("p#1.2", ("p#1", 2)), ("a.b#3.10", ("a.b#3", 10)), ("p#1", None), ("p", None), (None, None)],
)
def test_the_attempt_a_group_names(gid, attempt):
    assert attempt_of_group(gid) == attempt
