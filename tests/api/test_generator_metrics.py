"""The per-generator figures of ``GET /metrics``: a bounded set of ``generator`` labels, the
rest summed under ``other``, and a quarantined generator always under its own."""

from __future__ import annotations

import msgpack
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.events import (
    Accepted,
    AcceptedItem,
    Acked,
    AckedGen,
    AckStats,
    AckSums,
    Event,
    GeneratorChanged,
    Payload,
    decode_entry,
    encode_payload,
)
from app.settings import Settings
from tests.api.test_metrics import Samples, app_client, scrape, value
from tests.helpers import make_run

RUN = "gm1"
# generator -> rollouts; and the sums of its acks: samples, kl_tokens, kl_sum, ratio_tokens,
# clipped, zero_weight.
ROLLOUTS = {"gen-a": 4, "gen-b": 3, "gen-c": 2, "gen-d": 1}
ACKED = {
    "gen-a": (2, 10, 0.5, 10, 1, 0),
    "gen-c": (3, 20, 2.0, 30, 6, 3),
    "gen-d": (1, 5, 1.5, 10, 4, 1),
}


def _event(n: int, event_type: str, body: Payload) -> Event:
    payload = encode_payload(event_type, body, t_ms=1_750_000_000_000 + n)
    fields = {b"e": event_type.encode(), b"d": msgpack.packb(payload, use_bin_type=True)}
    return decode_entry(RUN, f"{n}-0", fields)


def _events() -> list[Event]:
    items = tuple(
        AcceptedItem(f"{g}-{i}", f"{g}-{i}", 0, 10, True, 0, False, g)
        for g, n in ROLLOUTS.items()
        for i in range(n)
    )
    gens = tuple(
        AckedGen(g, samples, 0, kl_tokens, kl_sum, ratio_tokens, float(ratio_tokens), clipped, zero)
        for g, (samples, kl_tokens, kl_sum, ratio_tokens, clipped, zero) in ACKED.items()
    )
    acked = Acked("b-1", None, 0, (), AckStats(), AckSums(), gens=gens)
    return [_event(1, "accepted", Accepted(items)), _event(2, "acked", acked)]


def _generators(samples: Samples) -> dict[str, dict[str, float | None]]:
    labels = {
        dict(key)["generator"]
        for name, key in samples
        if name == "rollout_broker_generator_rollouts" and ("run", RUN) in key
    }
    return {
        g: {
            figure: value(samples, f"rollout_broker_generator_{figure}", run=RUN, generator=g)
            for figure in (
                "rollouts",
                "samples_consumed",
                "kl_mean",
                "importance_ratio_clip_fraction",
                "masked_fraction",
                "quarantined",
            )
        }
        for g in labels
    }


def _figures(*generators: str, quarantined: bool = False) -> dict[str, float | None]:
    """What one label shows: the figures of ``generators`` summed."""
    acked = [ACKED[g] for g in generators if g in ACKED]
    kl_tokens = sum(a[1] for a in acked)
    ratio_tokens = sum(a[3] for a in acked)
    return {
        "rollouts": sum(ROLLOUTS[g] for g in generators),
        "samples_consumed": sum(a[0] for a in acked),
        "kl_mean": sum(a[2] for a in acked) / kl_tokens if kl_tokens else None,
        "importance_ratio_clip_fraction": sum(a[4] for a in acked) / ratio_tokens
        if ratio_tokens
        else None,
        "masked_fraction": sum(a[5] for a in acked) / ratio_tokens if ratio_tokens else None,
        "quarantined": 1 if quarantined else 0,
    }


async def test_generator_labels_stay_bounded_and_the_rest_is_summed_under_other(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    async with app_client(settings.model_copy(update={"metrics_generators": 2})) as c:
        await make_run(c, RUN)
        async with sessionmaker() as s, s.begin():
            await repository.apply_events(s, RUN, _events())
        got = _generators(await scrape(c))
        # The two with the most rollouts, and the others summed.
        assert got == {
            "gen-a": _figures("gen-a"),
            "gen-b": _figures("gen-b"),
            "other": _figures("gen-c", "gen-d"),  # never quarantined: those have their own
        }
        assert got["other"]["kl_mean"] == pytest.approx(3.5 / 25)

        # The one with the fewest rollouts is quarantined: it keeps a label of its own.
        told = GeneratorChanged("gen-d", True, 0.3, 5)
        async with sessionmaker() as s, s.begin():
            await repository.apply_events(s, RUN, [_event(3, "generator", told)])
        got = _generators(await scrape(c))
        assert got == {
            "gen-a": _figures("gen-a"),
            "gen-b": _figures("gen-b"),
            "gen-d": _figures("gen-d", quarantined=True),
            "other": _figures("gen-c"),
        }
