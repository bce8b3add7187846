"""``measure`` (SPEC "Correction before the update") through the API on both backends: its
weights against a float64 recompute for every level and mode, its msgpack answer, the logprobs
it keeps for the ack, and what it refuses."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from app import keys
from app.broker.replies import StoreError
from app.events import Acked, decode_payload
from app.main import create_app
from tests.api.support import MSGPACK, asgi_client, assert_error, events, nack, set_policy
from tests.helpers import ack, lease, make_run, post, rollout

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "none")
TOKENS = 8
F32 = np.float32


def _f32(values: Any) -> list[float]:
    """Values exact in float32: JSON floats then equal the float32 bytes of the same values."""
    return np.asarray(values, dtype=F32).astype(np.float64).tolist()


def _rollouts(rng: np.random.Generator, n: int, gens: list[str | None]) -> list[dict[str, Any]]:
    """``n`` rollouts sampled across versions 2 and 3 (policy_version 2), with loss masks;
    the last has no behaviour logprobs."""
    out = []
    for i in range(n):
        r = rollout(f"x{i}", 2, tokens=TOKENS)
        mask = (rng.random(TOKENS) < 0.7).astype(int)
        mask[0] = mask[-1] = 1
        split = int(rng.integers(1, TOKENS))
        r |= {
            "logprobs": _f32(-rng.random(TOKENS) * 2),
            "loss_mask": mask.tolist(),
            "versions": [[0, 2], [split, 3]],
        }
        if gens[i % len(gens)] is not None:
            r["generator_id"] = gens[i % len(gens)]
        if i == n - 1:
            del r["logprobs"]
        out.append(r)
    return out


async def _leased(api: Any, run_id: str, seed: int, n: int = 6, **config: Any) -> dict[str, Any]:
    """A leased batch whose rollouts have masks from the lease (stale tokens) and their own."""
    rng = np.random.default_rng(seed)
    gens = config.pop("gens", [None])
    await make_run(
        api,
        run_id,
        **{"kl_max": 1e6, "kl_flush": 1e6, "max_staleness": 1, "stale_tokens": "mask", **config},
    )
    await set_policy(api, run_id, 3)
    resp = await post(api, run_id, *_rollouts(rng, n, gens))
    assert resp.json()["accepted"] == n, resp.text
    await set_policy(api, run_id, 4)  # tokens of version 2 are masked at hand-out
    resp = await lease(api, run_id, n)
    assert resp.status_code == 200, resp.text
    batch: dict[str, Any] = resp.json()
    return batch


def _new(
    batch: dict[str, Any], seed: int, scale: float = 0.3, *, exact: bool = True
) -> dict[str, list[float]]:
    """The trainer's logprobs: the behaviour's shifted at random; ``exact``: float32 values."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in batch["rollouts"]:
        n = len(r["response_ids"])
        old = np.asarray(r["logprobs"] if r["logprobs"] is not None else [-1.0] * n)
        values = np.minimum(old + rng.normal(0, scale, n), 0.0)
        out[r["rollout_id"]] = _f32(values) if exact else values.tolist()
    return out


def _expected(batch: dict[str, Any], new: dict[str, list[float]], c: dict[str, Any]) -> Any:
    """The SPEC's correction in float64, rollout by rollout."""
    weights, seq, seq_logs, zero, trained = {}, {}, [], 0, 0
    for r in batch["rollouts"]:
        rid, n = r["rollout_id"], len(r["response_ids"])
        mask = np.asarray(r["loss_mask"] if r["loss_mask"] is not None else [1] * n, bool)
        if r["logprobs"] is None:
            weights[rid], seq[rid] = mask.astype(float), 1.0
            continue
        # The lease's JSON gives float32 values at their shortest: read back as float32.
        old = np.asarray(r["logprobs"], dtype=F32).astype(np.float64)
        log_r = (np.asarray(new[rid]) - old)[mask]
        seq_logs.append(log_r.sum())
        if c["level"] == "token":
            x = np.exp(log_r)
        else:
            x = np.array([math.exp(log_r.sum() if c["level"] == "sequence" else log_r.mean())])
        if c["mode"] == "truncate":
            w = np.minimum(x, c["high"])
        elif c["mode"] == "mask":
            w = np.where((x >= c["low"]) & (x <= c["high"]), x, 0.0)
        else:
            w = x
        full = np.zeros(n)
        full[mask] = w
        weights[rid] = full
        seq[rid] = float(w.mean())
        zero += int(np.count_nonzero(full[mask] == 0))
        trained += int(mask.sum())
    rho = np.exp(np.array(seq_logs))
    rho /= rho.mean()
    return weights, seq, zero / trained, float(np.mean(rho**2) - 1)


async def _measure(api: Any, run_id: str, bid: str, logprobs: Any) -> Any:
    return await api.post(f"/v1/runs/{run_id}/batches/{bid}/measure", json={"logprobs": logprobs})


def _f32_body(new: dict[str, list[float]]) -> bytes:
    return msgpack.packb(
        {"logprobs": {rid: np.asarray(v, "<f4").tobytes() for rid, v in new.items()}},
        use_bin_type=True,
    )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
async def test_weights_match_a_float64_recompute(api, level, mode):
    c = {"level": level, "mode": mode, "low": 0.8, "high": 1.25}
    batch = await _leased(api, "r1", seed=7, correction=c)
    assert any(r["loss_mask"] for r in batch["rollouts"])
    new = _new(batch, seed=11)
    resp = await _measure(api, "r1", batch["batch_id"], new)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    weights, seq, masked, chi2 = _expected(batch, new, c)
    assert body["weights"].keys() == weights.keys()
    for rid, w in weights.items():
        assert body["weights"][rid] == pytest.approx(w.tolist(), rel=2e-6, abs=1e-30), rid
        assert body["sequence_weights"][rid] == pytest.approx(seq[rid], rel=2e-6), rid
    assert body["stats"]["masked_fraction"] == pytest.approx(masked, abs=1e-12)
    assert body["stats"]["chi2"] == pytest.approx(chi2, rel=1e-9, abs=1e-12)
    assert body["kl_coef"] is None
    # The ack's figures, as an ack with the same logprobs answers them.
    acked = (await ack(api, "r1", batch["batch_id"], logprobs=new)).json()["stats"]
    assert {k: body["stats"][k] for k in acked} == acked


async def test_msgpack_answers_carry_float32_bytes_equal_to_the_json_answer(api):
    batch = await _leased(api, "r1", seed=3, kl_coef=0.05)
    new = _new(batch, seed=4)
    as_json = (await _measure(api, "r1", batch["batch_id"], new)).json()
    resp = await api.post(
        f"/v1/runs/r1/batches/{batch['batch_id']}/measure",
        content=_f32_body(new),
        headers={**MSGPACK, "accept": "application/msgpack"},
    )
    assert resp.status_code == 200, resp.text
    got = msgpack.unpackb(resp.content, raw=False)
    assert got["weights"].keys() == as_json["weights"].keys()
    for rid, raw in got["weights"].items():
        assert isinstance(raw, bytes)
        assert np.frombuffer(raw, "<f4").tolist() == _f32(as_json["weights"][rid])
    assert got["sequence_weights"] == as_json["sequence_weights"]
    assert got["stats"] == as_json["stats"]
    assert got["kl_coef"] == as_json["kl_coef"] == 0.05


def _acked(evs: list[tuple[str, dict[str, Any]]]) -> Acked:
    [d] = [d for e, d in evs if e == "acked"]
    got = decode_payload("acked", d)
    assert isinstance(got, Acked)
    return dataclasses.replace(got, batch_id="")


@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("form", ["json", "float32"])
async def test_an_ack_without_logprobs_after_a_measure_uses_the_kept_ones(
    api, redis, prefix, form, with_kl
):
    """The same batch on two runs: measured then acked with no logprobs, and acked with the
    logprobs. JSON floats not exact in float32 are kept as they came; a ready-made ``kl`` in
    the ack stands for its rollout's kept logprobs."""
    gens = ["g-a", "g-b", None]
    one = await _leased(api, "r1", seed=5, gens=gens)
    two = await _leased(api, "r2", seed=5, gens=gens)
    new = _new(one, seed=6, exact=form == "float32")
    kl = {one["rollouts"][0]["rollout_id"]: 0.0125} if with_kl else {}
    rest = {rid: v for rid, v in new.items() if rid not in kl}
    path = "/v1/runs/{}/batches/{}/{}"
    if form == "json":
        resp = await _measure(api, "r1", one["batch_id"], new)
        carried = await ack(api, "r2", two["batch_id"], logprobs=rest, kl=kl)
    else:
        resp = await api.post(
            path.format("r1", one["batch_id"], "measure"), content=_f32_body(new), headers=MSGPACK
        )
        body = msgpack.packb(
            {"logprobs": {r: np.asarray(v, "<f4").tobytes() for r, v in rest.items()}, "kl": kl}
        )
        carried = await api.post(
            path.format("r2", two["batch_id"], "ack"), content=body, headers=MSGPACK
        )
    assert resp.status_code == 200, resp.text
    kept = await ack(api, "r1", one["batch_id"], **({"kl": kl} if kl else {}))
    assert kept.status_code == carried.status_code == 200, (kept.text, carried.text)
    assert kept.json()["stats"] == carried.json()["stats"]
    assert kept.json()["stats"]["kl_mean"] is not None
    a1, a2 = _acked(await events(redis, prefix, "r1")), _acked(await events(redis, prefix, "r2"))
    assert a1 == a2
    assert [g.generator_id for g in a1.gens] == ["g-a", "g-b"]
    if not kl:  # the measure's stats are the figures of the ack that follows it
        stats = {k: resp.json()["stats"][k] for k in kept.json()["stats"]}
        assert stats == kept.json()["stats"]


async def test_a_second_measure_replaces_the_first_and_an_ack_with_logprobs_uses_its_own(api):
    batch = await _leased(api, "r1", seed=8)
    bid = batch["batch_id"]
    first, second = _new(batch, seed=1), _new(batch, seed=2, scale=0.05)
    m1 = (await _measure(api, "r1", bid, first)).json()["stats"]
    m2 = (await _measure(api, "r1", bid, second)).json()["stats"]
    assert m1 != m2
    acked = (await ack(api, "r1", bid)).json()["stats"]
    assert acked == {k: m2[k] for k in acked}
    # An ack that carries logprobs uses its own, not the kept ones.
    other = await _leased(api, "r2", seed=8)
    await _measure(api, "r2", other["batch_id"], first)
    own = (await ack(api, "r2", other["batch_id"], logprobs=second)).json()["stats"]
    assert own == acked


async def test_bad_logprobs_are_422_and_leave_the_kept_ones(api):
    batch = await _leased(api, "r1", seed=9)
    bid = batch["batch_id"]
    good = _new(batch, seed=1)
    kept = (await _measure(api, "r1", bid, good)).json()["stats"]
    some = batch["rollouts"][1]["rollout_id"]
    bad = {
        "unknown rollout": {**good, "nope": [-1.0]},
        "missing rollout": {k: v for k, v in good.items() if k != some},
        "wrong length": {**good, some: good[some][:-1]},
        "positive logprob": {**good, some: [0.5, *good[some][1:]]},
    }
    for what, logprobs in bad.items():
        detail = assert_error(await _measure(api, "r1", bid, logprobs), 422, "ValidationFailed")
        assert ("'nope'" if what == "unknown rollout" else repr(some)) in detail, (what, detail)
    nan = dict(good)
    nan[some] = [math.nan, *good[some][1:]]
    resp = await api.post(
        f"/v1/runs/r1/batches/{bid}/measure",
        content=msgpack.packb({"logprobs": nan}),
        headers=MSGPACK,
    )
    assert "finite" in assert_error(resp, 422, "ValidationFailed")
    resp = await api.post(f"/v1/runs/r1/batches/{bid}/measure", json={})
    assert_error(resp, 422, "ValidationFailed")
    acked = (await ack(api, "r1", bid)).json()["stats"]
    assert acked == {k: kept[k] for k in acked}


async def test_measure_of_a_settled_expired_or_unknown_batch_is_refused(api, redis, prefix, store):
    await make_run(api, "r1", max_reuse=5)
    await post(api, "r1", *(rollout(f"x{i}") for i in range(6)))
    lp = {f"x{i}": [-0.5] * 4 for i in range(6)}

    async def measured(b: dict[str, Any]) -> Any:
        return await _measure(api, "r1", b["batch_id"], {r: lp[r] for r in _ids(b)})

    acked = (await lease(api, "r1", 2)).json()
    assert (await measured(acked)).status_code == 200
    assert (await ack(api, "r1", acked["batch_id"])).status_code == 200
    assert "acked" in assert_error(await measured(acked), 409, "BatchSettled")
    # The script refuses too (a measure that read the batch just before its ack).
    with pytest.raises(StoreError) as refused:
        await store.measure("r1", acked["batch_id"], b"f")
    assert (refused.value.code, refused.value.args_) == ("batch_settled", ("acked",))
    nacked = (await lease(api, "r1", 2)).json()
    assert (await measured(nacked)).status_code == 200
    assert (await nack(api, "r1", nacked["batch_id"])).status_code == 200
    bkey = keys.member_key(prefix, "r1", keys.BATCH, nacked["batch_id"])
    assert not await redis.hexists(bkey, "ml")  # freed when the batch ended
    assert "nacked" in assert_error(await measured(nacked), 409, "BatchSettled")
    with pytest.raises(StoreError) as refused:
        await store.measure("r1", nacked["batch_id"], b"f")
    assert (refused.value.code, refused.value.args_) == ("batch_settled", ("nacked",))
    unknown = {"batch_id": "no-such-batch", "rollouts": []}
    assert_error(await measured(unknown), 404, "BatchNotFound")
    await api.patch("/v1/runs/r1/config", json={"lease_timeout_s": 0.2})
    expiring = (await lease(api, "r1", 2)).json()
    leased_by = time.monotonic()
    await asyncio.sleep(max(0.0, leased_by + 0.3 - time.monotonic()))
    assert_error(await measured(expiring), 409, "LeaseExpired")
    kinds = [e for e, _ in await events(redis, prefix, "r1")]
    assert kinds.count("expired") == 1  # expired by the measure itself
    assert_error(await measured(expiring), 409, "LeaseExpired")


def _ids(batch: dict[str, Any]) -> list[str]:
    return [r["rollout_id"] for r in batch["rollouts"]]


async def test_a_measure_on_one_app_serves_the_ack_on_another(settings):
    async with asgi_client(create_app(settings)) as one, asgi_client(create_app(settings)) as two:
        batch = await _leased(one, "r1", seed=12)
        new = _new(batch, seed=13)
        measured = (await _measure(one, "r1", batch["batch_id"], new)).json()["stats"]
        acked = (await ack(two, "r1", batch["batch_id"])).json()["stats"]
        assert acked["kl_mean"] is not None
        assert acked == {k: measured[k] for k in acked}


def _gen_sums(batch: dict[str, Any], new: dict[str, list[float]], kl: dict[str, float]) -> Any:
    """Per generator, the acked event's sums recomputed in float64 (k3, clip_epsilon 0.2, the
    correction of the run below)."""
    out: dict[str, dict[str, Any]] = {}
    for r in batch["rollouts"]:
        g = r["generator_id"]
        if g is None:
            continue
        n = len(r["response_ids"])
        mask = np.asarray(r["loss_mask"] if r["loss_mask"] is not None else [1] * n, bool)
        s = out.setdefault(
            g, dict.fromkeys(("samples", "tokens", "kl_tokens", "ratio_tokens", "clipped"), 0)
        )
        s.setdefault("kl_sum", 0.0)
        s.setdefault("ratio_sum", 0.0)
        s.setdefault("zero_weight", 0)
        s.setdefault("kl_max", None)
        s["samples"] += 1
        s["tokens"] += int(mask.sum())
        rid = r["rollout_id"]
        if rid in kl:
            s["kl_tokens"] += int(mask.sum())
            s["kl_sum"] += kl[rid] * int(mask.sum())
            s["kl_max"] = max(s["kl_max"] or kl[rid], kl[rid])
            continue
        if r["logprobs"] is None:
            continue
        old = np.asarray(r["logprobs"], dtype=F32).astype(np.float64)
        log_r = (np.asarray(new[rid]) - old)[mask]
        ratio = np.exp(log_r)
        k3 = (ratio - 1) - log_r
        s["kl_tokens"] += log_r.size
        s["kl_sum"] += float(k3.sum())
        s["ratio_tokens"] += log_r.size
        s["ratio_sum"] += float(ratio.sum())
        s["clipped"] += int(np.count_nonzero(np.abs(ratio - 1) > 0.2))
        s["zero_weight"] += int(np.count_nonzero((ratio < 0.8) | (ratio > 1.25)))
        s["kl_max"] = max(s["kl_max"] or 0.0, float(k3.mean()))
    return out


async def test_the_acked_event_sums_each_generator(api, redis, prefix):
    gens = ["g-a", "g-b", None, "g-c", None]
    c = {"level": "token", "mode": "mask", "low": 0.8, "high": 1.25}
    batch = await _leased(api, "r1", seed=21, n=15, gens=gens, correction=c)
    new = _new(batch, seed=22)
    measured = [r["rollout_id"] for r in batch["rollouts"] if r["logprobs"] is not None]
    kl = {measured[0]: 0.125}  # one ready-made KL: it counts in kl_tokens and kl_sum
    logprobs = {rid: v for rid, v in new.items() if rid not in kl}
    assert (await ack(api, "r1", batch["batch_id"], logprobs=logprobs, kl=kl)).status_code == 200
    got = _acked(await events(redis, prefix, "r1"))
    want = _gen_sums(batch, new, kl)
    assert [g.generator_id for g in got.gens] == ["g-a", "g-b", "g-c"]
    assert all(want[g]["zero_weight"] for g in want)  # the mask mode weighs some tokens 0
    for g in got.gens:
        w = want[g.generator_id]
        for name in ("samples", "tokens", "kl_tokens", "ratio_tokens", "clipped", "zero_weight"):
            assert getattr(g, name) == w[name], (g.generator_id, name)
        for name in ("kl_sum", "ratio_sum", "kl_max"):
            assert getattr(g, name) == pytest.approx(w[name], rel=1e-9), (g.generator_id, name)
    # With the rollouts of no generator, they add up to the batch's sums.
    unnamed = [r for r in batch["rollouts"] if r["generator_id"] is None]
    rest = _gen_sums({"rollouts": [{**r, "generator_id": "-"} for r in unnamed]}, new, kl)["-"]
    for name in ("kl_tokens", "ratio_tokens", "clipped"):
        assert sum(getattr(g, name) for g in got.gens) + rest[name] == getattr(got.sums, name)
    for name in ("kl_sum", "ratio_sum"):
        total = sum(getattr(g, name) for g in got.gens) + rest[name]
        assert total == pytest.approx(getattr(got.sums, name), rel=1e-12)


async def test_no_generator_no_gens(api, redis, prefix):
    batch = await _leased(api, "r1", seed=23)
    assert (
        await ack(api, "r1", batch["batch_id"], logprobs=_new(batch, seed=1))
    ).status_code == 200
    [d] = [d for e, d in await events(redis, prefix, "r1") if e == "acked"]
    assert "gens" not in d
