"""A leased batch as the arrays a trainer feeds its model (``Batch.padded``, ``Batch.packed``
and their ``to_torch``), checked against a per-rollout reference written with Python loops."""

from __future__ import annotations

import dataclasses
import math
import statistics
import subprocess
import sys
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
import torch
from rollout_broker_client import (
    Batch,
    BrokerClient,
    LeasedRollout,
    PackedArrays,
    Rollout,
    TrainArrays,
)

from tests.client.live import REPO
from tests.client.test_readme import blocks

NAN = float("nan")
PER_TOKEN = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "old_logprobs",
    "token_versions",
    "token_advantages",
)


def leased(
    rollout_id: str,
    prompt: Sequence[int] | None,
    response: Sequence[int],
    reward: float = 0.0,
    *,
    group_id: str | None = None,
    logprobs: Sequence[float] | None = None,
    loss_mask: Sequence[int] | None = None,
    versions: tuple[tuple[int, int], ...] = (),
    policy_version: int = 3,
) -> LeasedRollout:
    if logprobs is None:
        logprobs = [-0.5 - 0.25 * k for k in range(len(response))]
    return LeasedRollout(
        rollout_id=rollout_id,
        group_id=group_id,
        policy_version=policy_version,
        prompt_ids=None if prompt is None else np.array(prompt, dtype=np.int32),
        response_ids=np.array(response, dtype=np.int32),
        logprobs=np.array(logprobs, dtype=np.float32),
        reward=reward,
        finish_reason="stop",
        metadata=None,
        uses=0,
        lag=0,
        loss_mask=None if loss_mask is None else np.array(loss_mask, dtype=np.uint8),
        versions=versions,
    )


def without_logprobs(r: LeasedRollout) -> LeasedRollout:
    return dataclasses.replace(r, logprobs=None)


def batch_of(rollouts: list[LeasedRollout]) -> Batch:
    return Batch("b-1", 3, datetime.now(UTC), rollouts)


def mixed() -> list[LeasedRollout]:
    """Groups of three, of two equal rewards and of one; a rollout without a group, one without
    a prompt, one with tool tokens masked, one sampled over two versions and one without
    logprobs."""
    return [
        leased("a0", [5, 6, 7], [11, 12], 1.0, group_id="a"),
        leased("b0", [8], [13, 14, 15, 16], 0.5, group_id="b", loss_mask=[1, 0, 0, 1]),
        leased("a1", [5, 6, 7], [17], 0.0, group_id="a", versions=((0, 3),)),
        leased("c0", None, [18, 19, 20], 1.0, group_id="c"),
        leased("a2", [5, 6, 7], [21, 22, 23], 0.25, group_id="a", versions=((0, 2), (2, 4))),
        leased("b1", [8], [24], 0.5, group_id="b"),
        leased("solo", [9, 9], [25, 26], 3.0),
        without_logprobs(leased("d0", [4], [27, 28], -1.0, group_id="d")),
        leased("d1", [4], [29], 2.0, group_id="d", loss_mask=[0]),
    ]


def reference_advantages(
    rollouts: Sequence[LeasedRollout], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        if r.group_id is not None:
            groups.setdefault(r.group_id, []).append(r.reward)
    out = []
    for r in rollouts:
        members = groups.get(r.group_id or "", [])
        if r.group_id is None or len(members) < 2:
            out.append(0.0)
        elif scale_by_std:
            out.append((r.reward - statistics.fmean(members)) / (statistics.stdev(members) + eps))
        else:
            out.append(r.reward - statistics.fmean(members))
    return out


def reference_sequences(
    rollouts: Sequence[LeasedRollout], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[dict[str, list[Any]]]:
    """Each rollout's sequence, token by token."""
    advantages = reference_advantages(rollouts, scale_by_std=scale_by_std, eps=eps)
    out = []
    for r, advantage in zip(rollouts, advantages, strict=True):
        prompt = [] if r.prompt_ids is None else r.prompt_ids.tolist()
        response = r.response_ids.tolist()
        mask = [1] * len(response) if r.loss_mask is None else r.loss_mask.tolist()
        logprobs = [NAN] * len(response) if r.logprobs is None else r.logprobs.tolist()
        segments = list(r.versions or ((0, r.policy_version),))
        versions = []
        for k in range(len(response)):
            versions.append(max((o, v) for o, v in segments if o <= k)[1])
        loss_mask = [0] * len(prompt) + mask
        loss_mask[0] = 0  # nothing before a sequence's first token predicts it
        out.append(
            {
                "input_ids": prompt + response,
                "position_ids": list(range(len(prompt) + len(response))),
                "loss_mask": loss_mask,
                "old_logprobs": [0.0] * len(prompt) + logprobs,
                "token_versions": [-1] * len(prompt) + versions,
                "token_advantages": [advantage if m else 0.0 for m in loss_mask],
            }
        )
    return out


def reference_rows(
    rollouts: Sequence[LeasedRollout], width: int, pad_id: int, side: str, **options: Any
) -> dict[str, list[list[Any]]]:
    fills = {"input_ids": pad_id, "position_ids": 0, "loss_mask": 0, "old_logprobs": 0.0}
    fills |= {"token_versions": -1, "token_advantages": 0.0, "attention_mask": 0}
    rows: dict[str, list[list[Any]]] = {name: [] for name in fills}
    for seq in reference_sequences(rollouts, **options):
        seq = {**seq, "attention_mask": [1] * len(seq["input_ids"])}
        for name, fill in fills.items():
            padding = [fill] * (width - len(seq[name]))
            rows[name].append(seq[name] + padding if side == "right" else padding + seq[name])
    return rows


def check_per_rollout(
    arrays: TrainArrays[Any] | PackedArrays[Any], rollouts: Sequence[LeasedRollout], **opts: Any
) -> None:
    assert arrays.rewards.dtype == np.float32 and arrays.advantages.dtype == np.float32
    np.testing.assert_array_equal(arrays.rewards, [np.float32(r.reward) for r in rollouts])
    np.testing.assert_allclose(
        arrays.advantages, reference_advantages(rollouts, **opts), rtol=1e-6, atol=1e-7
    )
    prompts = [0 if r.prompt_ids is None else r.prompt_ids.size for r in rollouts]
    np.testing.assert_array_equal(arrays.prompt_lengths, prompts)
    np.testing.assert_array_equal(arrays.response_lengths, [r.response_ids.size for r in rollouts])
    assert arrays.prompt_lengths.dtype == arrays.response_lengths.dtype == np.int64


def check_padded(
    arrays: TrainArrays[Any],
    rollouts: Sequence[LeasedRollout],
    *,
    width: int,
    pad_id: int = 0,
    side: str = "right",
    **opts: Any,
) -> None:
    dtypes = {"input_ids": np.int64, "attention_mask": np.int64, "position_ids": np.int64}
    dtypes |= {"loss_mask": np.float32, "old_logprobs": np.float32, "token_versions": np.int64}
    dtypes |= {"token_advantages": np.float32}
    expected = reference_rows(rollouts, width, pad_id, side, **opts)
    for name, dtype in dtypes.items():
        got = getattr(arrays, name)
        assert got.dtype == dtype and got.shape == (len(rollouts), width), name
        if name == "token_advantages":
            np.testing.assert_allclose(got, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(got, expected[name], err_msg=name)
    check_per_rollout(arrays, rollouts, **opts)
    assert arrays.padding_side == side


@pytest.mark.parametrize(("side", "pad_id"), [("right", 0), ("left", 151643)])
def test_padded_rows_match_a_per_rollout_reference(side: Any, pad_id: int) -> None:
    rollouts = mixed()
    arrays = batch_of(rollouts).padded(pad_id, padding_side=side)
    check_padded(arrays, rollouts, width=6, pad_id=pad_id, side=side)


def test_padded_width_rounds_up_and_max_length_fixes_it() -> None:
    rollouts = mixed()  # the longest sequence has 6 tokens
    check_padded(batch_of(rollouts).padded(pad_to_multiple_of=4), rollouts, width=8)
    check_padded(batch_of(rollouts).padded(max_length=6), rollouts, width=6)
    fixed = batch_of(rollouts).padded(max_length=16, pad_to_multiple_of=16)
    check_padded(fixed, rollouts, width=16)


def test_a_sequence_longer_than_max_length_is_refused_not_cut() -> None:
    rollouts = mixed()
    with pytest.raises(ValueError, match=r"rollout 'a2' has 6 tokens \(3 prompt, 3 response\), "
                       r"more than max_length 5\. A sequence is never cut"):  # fmt: skip
        batch_of(rollouts).padded(max_length=5)
    with pytest.raises(ValueError, match=r"^rollout 'a0' .* max_length 4 \(and 2 more\)"):
        batch_of(rollouts).padded(max_length=4)
    with pytest.raises(ValueError, match=r"^rollout 'b0' has 5 tokens .* \(and 1 more\)"):
        batch_of(rollouts[1:]).padded(max_length=4)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"pad_id": -1}, ValueError, "pad_id must be an int from 0 to 2147483647, not -1"),
        ({"pad_id": 2**31}, ValueError, "pad_id must be an int from 0 to 2147483647"),
        ({"pad_id": 1.0}, TypeError, "pad_id must be an int, not 1.0"),
        ({"pad_id": True}, TypeError, "pad_id must be an int, not True"),
        ({"max_length": 0}, ValueError, "max_length must be an int of at least 1, not 0"),
        ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be an int of at least 1"),
        ({"max_length": 12, "pad_to_multiple_of": 8}, ValueError, "not a multiple of"),
        ({"padding_side": "middle"}, ValueError, "padding_side must be 'right' or 'left'"),
        ({"eps": 0.0}, ValueError, "eps must be a finite number above 0, not 0.0"),
        ({"eps": math.nan}, ValueError, "eps must be a finite number above 0, not nan"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        batch_of(mixed()).padded(**options)


def test_numpy_integer_pad_id_is_accepted() -> None:
    arrays = batch_of(mixed()).padded(np.int64(7))
    assert arrays.input_ids[-1, -1] == 7


def test_rollouts_whose_arrays_disagree_are_refused_by_name() -> None:
    short = leased("short", [1], [2, 3], logprobs=[-1.0])
    with pytest.raises(ValueError, match="rollout 'short' has 1 logprobs for 2 response tokens"):
        batch_of([short]).packed()
    masked = leased("masked", [1], [2, 3], loss_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="rollout 'masked' has 3 loss_mask values for 2 resp"):
        batch_of([masked]).padded()


def test_a_rollout_without_prompt_is_its_response_alone() -> None:
    arrays = batch_of([leased("r", None, [7, 8, 9], group_id="g")]).padded()
    assert arrays.input_ids.tolist() == [[7, 8, 9]]
    assert arrays.token_versions.tolist() == [[3, 3, 3]]
    assert arrays.loss_mask.tolist() == [[0, 1, 1]]  # no position before the first token


@pytest.mark.parametrize(
    ("scale_by_std", "eps"), [(True, 1e-6), (True, 0.5), (False, 1e-6)], ids=["grpo", "eps", "dr"]
)
def test_advantages_are_normalised_within_each_group(scale_by_std: bool, eps: float) -> None:
    rollouts = mixed()
    b = batch_of(rollouts)
    opts = {"scale_by_std": scale_by_std, "eps": eps}
    check_padded(b.padded(**opts), rollouts, width=6, **opts)
    check_per_rollout(b.packed(**opts), rollouts, **opts)


def test_the_std_is_the_sample_std_and_lone_rollouts_get_zero() -> None:
    rollouts = [
        leased("x0", [1], [2], 0.0, group_id="x"),
        leased("x1", [1], [2], 1.0, group_id="x"),
        leased("x2", [1], [2], 2.0, group_id="x"),
        leased("alone", [1], [2], 5.0, group_id="y"),
        leased("none", [1], [2], 7.0),
        leased("none2", [1], [2], 8.0),
        leased("same0", [1], [2], 0.5, group_id="z"),
        leased("same1", [1], [2], 0.5, group_id="z"),
    ]
    # mean 1 and sample std 1 (the population std would be 0.816)
    want = [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(batch_of(rollouts).padded().advantages, want, rtol=1e-6)
    dr = batch_of(rollouts).packed(scale_by_std=False).advantages
    np.testing.assert_array_equal(dr, [-1, 0, 1, 0, 0, 0, 0, 0])


def test_packed_row_matches_the_reference_and_unpacks_to_the_padded_rows() -> None:
    rollouts = mixed()
    b = batch_of(rollouts)
    packed, padded = b.packed(), b.padded()
    sequences = reference_sequences(rollouts)
    lengths = [len(s["input_ids"]) for s in sequences]
    assert packed.cu_seqlens.dtype == np.int32
    assert packed.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert packed.max_seqlen == max(lengths) and isinstance(packed.max_seqlen, int)
    for name in PER_TOKEN:
        got = getattr(packed, name)
        assert got.shape == (1, sum(lengths)) and got.dtype == getattr(padded, name).dtype
        want = [x for s in sequences for x in s[name]]
        np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-7, err_msg=name)
        for i, n in enumerate(lengths):
            start, end = packed.cu_seqlens[i], packed.cu_seqlens[i + 1]
            np.testing.assert_array_equal(got[0, start:end], getattr(padded, name)[i, :n], name)
    check_per_rollout(packed, rollouts)


def test_a_batch_without_logprobs_has_no_old_logprobs() -> None:
    b = batch_of([without_logprobs(leased(f"r{i}", [1], [2, 3], group_id="g")) for i in "ab"])
    assert b.padded().old_logprobs is None and b.packed().old_logprobs is None
    assert b.padded().to_torch().old_logprobs is None


def test_an_empty_batch_has_rows_of_nothing() -> None:
    padded = batch_of([]).padded(pad_to_multiple_of=8)
    for name in ("input_ids", "attention_mask", "position_ids", "token_versions"):
        assert getattr(padded, name).shape == (0, 0) and getattr(padded, name).dtype == np.int64
    assert padded.loss_mask.dtype == padded.token_advantages.dtype == np.float32
    assert padded.rewards.shape == padded.advantages.shape == padded.prompt_lengths.shape == (0,)
    assert padded.old_logprobs is None
    packed = batch_of([]).packed()
    assert packed.input_ids.shape == (1, 0) and packed.input_ids.dtype == np.int64
    assert packed.cu_seqlens.tolist() == [0] and packed.max_seqlen == 0
    assert packed.to_torch().cu_seqlens.dtype == torch.int32
    assert padded.to_torch().input_ids.shape == (0, 0)


TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
TORCH_DTYPES[np.dtype(np.float32)] = torch.float32


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_to_torch_gives_the_same_fields_sharing_memory(form: str) -> None:
    arrays = getattr(batch_of(mixed()), form)()
    tensors = arrays.to_torch()
    assert type(tensors) is type(arrays)
    for name in arrays.__slots__:
        a, t = getattr(arrays, name), getattr(tensors, name)
        if not isinstance(a, np.ndarray):
            assert t == a, name  # max_seqlen, padding_side
            continue
        assert isinstance(t, torch.Tensor) and t.dtype == TORCH_DTYPES[a.dtype], name
        assert t.data_ptr() == a.ctypes.data, name  # torch.from_numpy: no copy
        np.testing.assert_array_equal(t.numpy(), a, err_msg=name)
    moved = arrays.to_torch(device="cpu")
    assert moved.input_ids.device == torch.device("cpu")


def test_to_torch_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = batch_of(mixed()).padded()
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ImportError, match=r"to_torch\(\) needs PyTorch.*pip install torch"):
        arrays.to_torch()
    with pytest.raises(ImportError, match="needs PyTorch"):
        batch_of(mixed()).packed().to_torch()


def test_the_arrays_never_import_torch() -> None:
    code = (
        "import sys; from datetime import datetime, UTC; import numpy as np\n"
        "from rollout_broker_client import Batch, LeasedRollout\n"
        "r = LeasedRollout('a', 'g', 0, None, np.array([1, 2], np.int32), None, 1.0, None, None,"
        " 0, 0)\n"
        "b = Batch('b', 0, datetime.now(UTC), [r])\n"
        "b.padded(); b.packed()\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"


def bigram_policy(vocab: int) -> torch.Tensor:
    """Log-probabilities of the next token given the last one: a model whose logits at a
    position depend on that position's token alone."""
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)).log_softmax(-1)


def sampled(policy: torch.Tensor) -> list[LeasedRollout]:
    """Rollouts whose behaviour logprobs are the policy's: each token's, given the one before."""
    rng = np.random.default_rng(1)
    out = []
    for i, (p, n) in enumerate([(3, 4), (1, 6), (5, 2), (2, 5)]):
        seq = rng.integers(0, policy.shape[0], size=p + n)
        logprobs = [float(policy[seq[t - 1], seq[t]]) for t in range(p, p + n)]
        mask = [1] * n
        mask[n // 2] = 0  # a tool token
        out.append(
            leased(
                f"r{i}", seq[:p], seq[p:], float(i % 2), group_id=f"g{i // 2}",
                logprobs=logprobs, loss_mask=mask,
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize("form", ["right", "left", "packed"])
def test_logprobs_sit_at_their_tokens_and_shifted_logits_predict_them(form: str) -> None:
    """The logits at t - 1 scored through input_ids[:, 1:] give old_logprobs[:, 1:] on every
    trained token; put back at the tokens' own positions, the response values split out per
    rollout are what the generator posted, ready for the ack."""
    policy = bigram_policy(32)
    rollouts = sampled(policy)
    b = batch_of(rollouts)
    x = b.packed().to_torch() if form == "packed" else b.padded(padding_side=form).to_torch()
    assert x.old_logprobs is not None
    logits = policy[x.input_ids]  # any model: (rows, tokens, vocab)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, x.input_ids[:, 1:, None]).squeeze(-1)
    trained = x.loss_mask[:, 1:].bool()
    want = sum(int(r.mask.sum()) for r in rollouts)
    assert int(trained.sum()) == want
    torch.testing.assert_close(logp[trained], x.old_logprobs[:, 1:][trained])
    at_tokens = torch.nn.functional.pad(logp, (1, 0)).requires_grad_()
    for got, r in zip(x.split_responses(at_tokens), rollouts, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, r.logprobs, rtol=1e-6)


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_split_responses_wants_the_shape_of_input_ids(form: str) -> None:
    arrays = getattr(batch_of(mixed()), form)()
    with pytest.raises(ValueError, match="input_ids' shape"):
        arrays.split_responses(np.zeros((2, 2)))


@pytest.mark.parametrize("form", ["right", "left", "packed"])
def test_join_responses_lays_per_rollout_values_back_where_split_took_them(form: str) -> None:
    b = batch_of(mixed())
    x = b.packed() if form == "packed" else b.padded(padding_side=form)
    values = [np.arange(1, r.response_ids.size + 1, dtype=np.float32) for r in b.rollouts]
    joined = x.join_responses(values, fill=-7.0)
    assert joined.dtype == np.float32 and joined.shape == x.input_ids.shape
    for got, want in zip(x.split_responses(joined), values, strict=True):
        np.testing.assert_array_equal(got, want)
    # Everywhere else, the fill: prompts, padding, and nothing of one rollout in another's row.
    assert int((joined != -7.0).sum()) == sum(v.size for v in values)
    t = x.to_torch()
    tensors = [torch.from_numpy(v) for v in values]
    joined_t = t.join_responses(tensors, fill=-7.0)
    assert isinstance(joined_t, torch.Tensor) and joined_t.device == t.input_ids.device
    np.testing.assert_array_equal(joined_t.numpy(), joined)


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_join_responses_wants_one_value_per_response_token(form: str) -> None:
    b = batch_of(mixed())
    x = getattr(b, form)()
    values = [np.zeros(r.response_ids.size) for r in b.rollouts]
    with pytest.raises(ValueError, match="the batch has"):
        x.join_responses(values[:-1])
    values[1] = np.zeros(values[1].size + 1)
    with pytest.raises(ValueError, match="rollout 1: values of shape"):
        x.join_responses(values)


def run_id() -> str:
    return f"arrays-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
def test_a_leased_batch_over_the_network(sync_broker: BrokerClient) -> None:
    """A real lease: a posted loss mask, a rollout sampled over two versions whose old tokens
    the broker masks as too stale, and an ack carrying the split responses."""
    run = run_id()
    sync_broker.create_run(run, {"group_size": 2, "max_staleness": 1, "stale_tokens": "mask"})
    sync_broker.set_policy(run, 1)
    old = np.array([-0.5, -0.25, -3.0, -4.0, -0.75, -1.0], np.float32)
    posted = [
        Rollout(
            "turns", 0, np.arange(10, 16), 1.0, old, group_id="g", prompt_ids=[1, 2, 3],
            loss_mask=[1, 1, 0, 0, 1, 1], versions=[(0, 0), (4, 1)],
        ),
        Rollout("plain", 1, [20, 21], 0.0, [-0.1, -0.2], group_id="g", prompt_ids=[1, 2, 3]),
    ]  # fmt: skip
    assert sync_broker.post_rollouts(run, posted).accepted == 2
    sync_broker.set_policy(run, 2)  # the version-0 tokens are now too stale to train on
    with sync_broker.lease(run, size=2) as batch:
        assert batch is not None
        i = [r.rollout_id for r in batch].index("turns")
        padded, packed = batch.padded(), batch.packed()
        check_padded(padded, batch.rollouts, width=9)
        check_per_rollout(packed, batch.rollouts)
        assert padded.loss_mask[i].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
        assert padded.token_versions[i].tolist() == [-1, -1, -1, 0, 0, 0, 0, 1, 1]
        assert padded.advantages[i] == pytest.approx(0.5 / (0.5**0.5 + 1e-6), rel=1e-6)
        assert padded.advantages[1 - i] == -padded.advantages[i]
        (start, end) = packed.cu_seqlens[i : i + 2]
        np.testing.assert_array_equal(packed.loss_mask[0, start:end], padded.loss_mask[i])
        assert padded.old_logprobs is not None
        batch.ack_with(padded.split_responses(padded.old_logprobs))
    assert batch.ack_result is not None and batch.ack_result.consumed == 2
    assert batch.ack_result.stats.kl_max == 0.0


class StandIn(torch.nn.Module):
    """A stand-in language model: logits from the token at each position."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(bigram_policy(vocab).clone())

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        return type("Out", (), {"logits": self.table[input_ids]})()


@pytest.mark.slow
def test_the_readme_feeding_a_trainer_runs(sync_broker: BrokerClient) -> None:
    """The README's trainer, with a stand-in model, leases, steps and acks a real batch."""
    (code,) = [b for b in blocks("python", REPO / "clients/python/README.md") if ".padded(" in b]
    run = run_id()
    sync_broker.create_run(run, {"group_size": 2})
    policy = bigram_policy(64)
    posted = [
        Rollout(
            r.rollout_id, 0, r.response_ids, r.reward, r.logprobs, group_id=r.group_id,
            prompt_ids=r.prompt_ids, loss_mask=r.mask,
        )
        for r in sampled(policy)
    ]  # fmt: skip
    assert sync_broker.post_rollouts(run, posted).accepted == 4
    model = StandIn(64)
    names: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "tokenizer": type("Tokenizer", (), {"pad_token_id": 0})(),
    }
    for old, new in [("http://broker:8000", sync_broker.base_url), ('"my-run"', repr(run))]:
        code = code.replace(old, new)
    exec(code.replace("size=64", "size=4").replace('"cuda"', '"cpu"'), names)
    batch = names["batch"]
    assert batch.ack_result is not None and batch.ack_result.consumed == 4
    assert batch.ack_result.stats.kl_max == pytest.approx(0.0, abs=1e-6)  # same policy
    assert not torch.equal(model.table, policy)  # it took a step
