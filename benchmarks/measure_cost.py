"""What the correction of ``measure`` costs: ``python -m benchmarks.measure_cost``.

The correction (app/broker/correction.py) is computed in the API process on every ``measure``,
beside the statistics an ack computes (app/broker/stats.py). This times both on the same batch,
in the same run: 256 rollouts of 1,024 tokens by default, float32 logprobs on both sides (the
trainer's a small shift from the behaviour's, as near on-policy), with every token trained or
with a loss mask of about 3/4 trained tokens on each rollout. Each row is the median of
``--repeat`` calls; the ratio is the correction's time over the statistics' (k3, ε 0.2). No
Redis, no HTTP: the arithmetic alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from app.broker.config import Correction, CorrectionLevel, CorrectionMode
from app.broker.correction import correct
from app.broker.stats import Measured, batch_figures


def batch(rollouts: int, tokens: int, masked: bool, seed: int = 0) -> list[Measured]:
    """A batch as an ack sees it: behaviour logprobs, the trainer's, and the lease's mask."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(rollouts):
        old = -rng.exponential(1.0, tokens).astype(np.float32)
        new = np.minimum(old + rng.normal(0, 0.05, tokens), 0).astype(np.float32)
        mask = (rng.random(tokens) < 0.75).astype(np.uint8) if masked else None
        trained = tokens if mask is None else int(mask.sum())
        items.append(Measured(old, new, None, trained, mask))
    return items


def medians_us(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """The median wall time of each of ``fns`` in µs. The calls take turns, one of each per
    round after a first round to warm caches and allocations, so a load elsewhere on the machine
    weighs on all of them alike and the ratios hold even when the times drift."""
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeat + 1):
        for fn, out in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            if round_:
                out.append(time.perf_counter() - t)
    return [statistics.median(t) * 1e6 for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    print(f"{args.rollouts} rollouts × {args.tokens:,} tokens, median of {args.repeat}")
    print("| mask | correction | correction time | ack statistics | ×stats |")
    print("|---|---|---|---|---|")
    for masked in (False, True):
        items = batch(args.rollouts, args.tokens, masked)
        pairs: list[tuple[CorrectionLevel, CorrectionMode]] = [
            ("token", "truncate"),
            ("token", "mask"),
            ("sequence", "truncate"),
            ("geometric", "mask"),
        ]
        fns: list[Callable[[], object]] = [partial(batch_figures, items, "k3", 0.2)]
        for level, mode in pairs:
            c = Correction(level=level, mode=mode, low=0.5, high=2.0)
            fns.append(partial(correct, items, c))
        stats_us, *corrections = medians_us(fns, args.repeat)
        for (level, mode), us in zip(pairs, corrections, strict=True):
            print(
                f"| {'¾ trained' if masked else 'none'} | {level} / {mode} | {us:,.0f} µs "
                f"| {stats_us:,.0f} µs | ×{us / stats_us:.2f} |"
            )


if __name__ == "__main__":
    main()
