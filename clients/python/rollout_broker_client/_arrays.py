"""The arrays a trainer feeds its model, built from the rollouts of a leased batch: padded rows
(:class:`TrainArrays`) or one packed row (:class:`PackedArrays`), with GRPO advantages; numpy,
or torch tensors with ``to_torch()`` when PyTorch is installed (it is never imported before)."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

    from rollout_broker_client._models import LeasedRollout

__all__ = ["PackedArrays", "PaddingSide", "TrainArrays", "group_advantages", "pack", "pad"]

ArrayT = TypeVar("ArrayT")
NDArray = npt.NDArray[Any]
PaddingSide = Literal["right", "left"]

_MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32


@dataclass(frozen=True, slots=True, eq=False)
class TrainArrays(Generic[ArrayT]):
    """A leased batch as padded rows, one per rollout in batch order, each its prompt tokens
    then its response tokens (a rollout without ``prompt_ids``: its response alone), padded on
    ``padding_side`` to a common width. Built by :meth:`Batch.padded`; numpy arrays, or torch
    tensors after :meth:`to_torch`.

    Per token, shape ``(rows, width)``:

    - ``input_ids`` (int64): the tokens, ``pad_id`` on padding.
    - ``attention_mask`` (int64): 1 on real tokens, 0 on padding.
    - ``position_ids`` (int64): 0, 1, ... over each row's real tokens, 0 on padding.
    - ``loss_mask`` (float32): 1 on the response tokens to train on (the rollout's loss mask:
      0 on tool output, environment turns and tokens the broker masked as too stale), 0 on the
      prompt and padding. A sequence's first token is never in it, as no position comes before
      it to predict it (this matters only for a rollout without ``prompt_ids``). A float, to
      multiply a per-token loss: ``(loss * loss_mask).sum() / loss_mask.sum()``.
    - ``old_logprobs`` (float32): the behaviour policy's logprob of each response token, at the
      token's own position (``old_logprobs[i, t]`` is that of ``input_ids[i, t]``), 0 on the
      prompt and padding; NaN on the response of a rollout posted without logprobs, and None
      when no rollout of the batch has them. The logits at position ``t - 1`` predict the
      token at ``t``, so a trainer shifts by one as usual::

          logp = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
          ratio = (logp - old_logprobs[:, 1:]).exp()  # under loss_mask[:, 1:]

    - ``token_versions`` (int64): the policy version that sampled each response token, -1 on
      the prompt and padding.
    - ``token_advantages`` (float32): the rollout's advantage on its ``loss_mask`` positions, 0
      elsewhere.

    Per rollout, shape ``(rows,)``: ``rewards`` and ``advantages`` (float32), and
    ``prompt_lengths`` and ``response_lengths`` (int64). ``advantages`` are GRPO's, normalised
    within each group of the batch: ``(reward - group mean) / (group std + eps)``, the std
    over the group's rollouts in the batch with Bessel's correction (as ``torch.std``), or
    ``reward - group mean`` with ``scale_by_std=False`` (Dr. GRPO). A rollout without a
    ``group_id``, or alone of its group in the batch, has advantage 0: there is nothing to
    compare it with.
    """

    input_ids: ArrayT
    attention_mask: ArrayT
    position_ids: ArrayT
    loss_mask: ArrayT
    old_logprobs: ArrayT | None
    token_versions: ArrayT
    token_advantages: ArrayT
    rewards: ArrayT
    advantages: ArrayT
    prompt_lengths: ArrayT
    response_lengths: ArrayT
    padding_side: PaddingSide = "right"

    def to_torch(self, device: str | torch.device | None = None) -> TrainArrays[torch.Tensor]:
        """The same fields as torch tensors of the same dtypes (int64 ids, positions and
        attention mask, float32 ``loss_mask``: ``.bool()`` makes it a boolean mask), sharing
        the numpy arrays' memory (``torch.from_numpy``), then moved to ``device`` when one is
        given. Raises ImportError when PyTorch is not installed."""
        out: TrainArrays[torch.Tensor] = TrainArrays(**_tensors(self, device))
        return out

    def split_responses(self, values: Any) -> list[npt.NDArray[np.float32]]:
        """The values at each rollout's response tokens of an array (or tensor) shaped as
        ``input_ids``, one float32 array per rollout in batch order: the current policy's
        logprobs at the tokens' own positions, say, ready for :meth:`Batch.ack_with`. A tensor
        is detached and copied to the CPU first."""
        return _split(self.input_ids, values, self._spans())

    def join_responses(self, values: Sequence[Any], fill: float = 0.0) -> ArrayT:
        """The inverse of :meth:`split_responses`: one array (or tensor) per rollout in batch
        order, each as long as its response, laid at the response tokens of a float32 array
        shaped as ``input_ids`` and ``fill`` elsewhere; a tensor on ``input_ids``' device
        after :meth:`to_torch`. The importance weights :meth:`Batch.measure` answers per
        rollout, say, laid out to multiply a per-token loss."""
        joined: ArrayT = _join(self.input_ids, values, self._spans(), fill)
        return joined

    def _spans(self) -> list[tuple[int, int, int]]:
        """(row, first column, length) of each rollout's response."""
        ids: Any = self.input_ids
        width = int(ids.shape[1])
        return [
            (i, p if self.padding_side == "right" else width - r, r)
            for i, (p, r) in enumerate(
                zip(_ints(self.prompt_lengths), _ints(self.response_lengths), strict=True)
            )
        ]


@dataclass(frozen=True, slots=True, eq=False)
class PackedArrays(Generic[ArrayT]):
    """A leased batch packed into one row without padding, for variable-length attention
    (flash-attn's ``varlen`` functions, or a model that reads sequence starts from
    ``position_ids``): the sequences (prompt then response, as in :class:`TrainArrays`)
    concatenated in batch order. Built by :meth:`Batch.packed`; numpy arrays, or torch tensors
    after :meth:`to_torch`.

    ``input_ids``, ``position_ids`` (restarting at 0 at each sequence), ``loss_mask``,
    ``old_logprobs``, ``token_versions`` and ``token_advantages`` are shaped ``(1, tokens)``,
    with the dtypes and meaning of :class:`TrainArrays`' (``old_logprobs[0, t]`` is the
    behaviour logprob of ``input_ids[0, t]``; shifting by one across the row pairs a
    sequence's first token with the previous sequence's last logit, but that token is never in
    ``loss_mask``). Sequence ``i`` is ``[cu_seqlens[i], cu_seqlens[i + 1])``: ``cu_seqlens``
    (int32, ``rows + 1``, starting with 0) and ``max_seqlen`` (an int) are what flash-attn's
    ``varlen`` functions take. ``rewards``, ``advantages``, ``prompt_lengths`` and
    ``response_lengths`` are per rollout, as in :class:`TrainArrays`.
    """

    input_ids: ArrayT
    position_ids: ArrayT
    cu_seqlens: ArrayT
    max_seqlen: int
    loss_mask: ArrayT
    old_logprobs: ArrayT | None
    token_versions: ArrayT
    token_advantages: ArrayT
    rewards: ArrayT
    advantages: ArrayT
    prompt_lengths: ArrayT
    response_lengths: ArrayT

    def to_torch(self, device: str | torch.device | None = None) -> PackedArrays[torch.Tensor]:
        """The same fields as torch tensors of the same dtypes (int32 ``cu_seqlens``, as
        flash-attn wants; ``max_seqlen`` stays an int), sharing the numpy arrays' memory
        (``torch.from_numpy``), then moved to ``device`` when one is given. Raises ImportError
        when PyTorch is not installed."""
        out: PackedArrays[torch.Tensor] = PackedArrays(**_tensors(self, device))
        return out

    def split_responses(self, values: Any) -> list[npt.NDArray[np.float32]]:
        """The values at each rollout's response tokens of an array (or tensor) shaped as
        ``input_ids``, one float32 array per rollout in batch order, ready for
        :meth:`Batch.ack_with`. A tensor is detached and copied to the CPU first."""
        return _split(self.input_ids, values, self._spans())

    def join_responses(self, values: Sequence[Any], fill: float = 0.0) -> ArrayT:
        """The inverse of :meth:`split_responses`, as :meth:`TrainArrays.join_responses`."""
        joined: ArrayT = _join(self.input_ids, values, self._spans(), fill)
        return joined

    def _spans(self) -> list[tuple[int, int, int]]:
        """(row, first column, length) of each rollout's response."""
        return [
            (0, c + p, r)
            for c, p, r in zip(
                _ints(self.cu_seqlens)[:-1],
                _ints(self.prompt_lengths),
                _ints(self.response_lengths),
                strict=True,
            )
        ]


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Every sequence's per-token values concatenated, and the per-rollout values."""

    input_ids: npt.NDArray[np.int64]
    position_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.float32]
    old_logprobs: npt.NDArray[np.float32] | None
    token_versions: npt.NDArray[np.int64]
    token_advantages: npt.NDArray[np.float32]
    rewards: npt.NDArray[np.float32]
    advantages: npt.NDArray[np.float32]
    prompt_lengths: npt.NDArray[np.int64]
    response_lengths: npt.NDArray[np.int64]

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        return self.prompt_lengths + self.response_lengths


def pad(
    rollouts: Sequence[LeasedRollout],
    pad_id: int = 0,
    *,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding_side: PaddingSide = "right",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> TrainArrays[NDArray]:
    """The rollouts as :class:`TrainArrays`; see :meth:`Batch.padded`."""
    pad_id = _int("pad_id", pad_id, 0, _MAX_TOKEN_ID)
    limit = None if max_length is None else _int("max_length", max_length, 1)
    multiple = (
        None if pad_to_multiple_of is None else _int("pad_to_multiple_of", pad_to_multiple_of, 1)
    )
    if limit is not None and multiple is not None and limit % multiple:
        raise ValueError(
            f"max_length {limit} is not a multiple of pad_to_multiple_of {multiple}: the rows "
            "could not be both"
        )
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', not {padding_side!r}")
    tokens = _tokens(rollouts, scale_by_std=scale_by_std, eps=eps)
    lengths = tokens.lengths
    width = int(lengths.max(initial=0))
    if limit is not None and width > limit:
        over = np.flatnonzero(lengths > limit)
        i = int(over[0])
        more = f" (and {over.size - 1} more)" if over.size > 1 else ""
        raise ValueError(
            f"rollout {rollouts[i].rollout_id!r} has {int(lengths[i])} tokens "
            f"({int(tokens.prompt_lengths[i])} prompt, {int(tokens.response_lengths[i])} "
            f"response), more than max_length {limit}{more}. A sequence is never cut: its "
            "reward is for the whole response, and its ack needs a logprob for every token"
        )
    if multiple is not None:
        width = -(-width // multiple) * multiple
    columns = np.arange(width, dtype=np.int64)
    if padding_side == "right":
        cells = columns < lengths[:, None]
    else:
        cells = columns >= (width - lengths)[:, None]
    # Boolean indexing walks the cells in row-major order: the sequences' concatenated order.

    def rows(values: NDArray, fill: float) -> NDArray:
        out = np.full(cells.shape, fill, dtype=values.dtype)
        out[cells] = values
        return out

    return TrainArrays(
        input_ids=rows(tokens.input_ids, pad_id),
        attention_mask=cells.astype(np.int64),
        position_ids=rows(tokens.position_ids, 0),
        loss_mask=rows(tokens.loss_mask, 0),
        old_logprobs=None if tokens.old_logprobs is None else rows(tokens.old_logprobs, 0),
        token_versions=rows(tokens.token_versions, -1),
        token_advantages=rows(tokens.token_advantages, 0),
        rewards=tokens.rewards,
        advantages=tokens.advantages,
        prompt_lengths=tokens.prompt_lengths,
        response_lengths=tokens.response_lengths,
        padding_side=padding_side,
    )


def pack(
    rollouts: Sequence[LeasedRollout], *, scale_by_std: bool = True, eps: float = 1e-6
) -> PackedArrays[NDArray]:
    """The rollouts as :class:`PackedArrays`; see :meth:`Batch.packed`."""
    tokens = _tokens(rollouts, scale_by_std=scale_by_std, eps=eps)
    lengths = tokens.lengths
    cu_seqlens = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    return PackedArrays(
        input_ids=tokens.input_ids[None],
        position_ids=tokens.position_ids[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max(initial=0)),
        loss_mask=tokens.loss_mask[None],
        old_logprobs=None if tokens.old_logprobs is None else tokens.old_logprobs[None],
        token_versions=tokens.token_versions[None],
        token_advantages=tokens.token_advantages[None],
        rewards=tokens.rewards,
        advantages=tokens.advantages,
        prompt_lengths=tokens.prompt_lengths,
        response_lengths=tokens.response_lengths,
    )


def group_advantages(
    rewards: npt.ArrayLike,
    group_ids: Sequence[str | None],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> npt.NDArray[np.float64]:
    """GRPO advantages: each reward less its group's mean, divided by the group's std (with
    Bessel's correction) plus ``eps`` when ``scale_by_std``; 0 for a rollout whose group id is
    None or that is alone of its group (its reward less its own mean)."""
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number above 0, not {eps!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (len(group_ids),):
        raise ValueError(f"{r.size} rewards for {len(group_ids)} group ids")
    index: dict[str, int] = {}
    codes = np.array(
        [-1 if g is None else index.setdefault(g, len(index)) for g in group_ids], dtype=np.int64
    )
    grouped = codes >= 0
    code, reward = codes[grouped], r[grouped]
    count = np.bincount(code, minlength=len(index))
    mean = np.bincount(code, weights=reward, minlength=len(index)) / np.maximum(count, 1)
    advantage = reward - mean[code]
    if scale_by_std:
        squares = np.bincount(code, weights=advantage * advantage, minlength=len(index))
        std = np.sqrt(squares / np.maximum(count - 1, 1))
        advantage = advantage / (std[code] + eps)
    out = np.zeros(r.size, dtype=np.float64)
    out[grouped] = advantage
    return out


def _tokens(rollouts: Sequence[LeasedRollout], *, scale_by_std: bool, eps: float) -> _Tokens:
    empty = np.zeros(0, dtype=np.int32)
    pieces: list[NDArray] = []
    masks: list[NDArray] = []
    logprobs: list[NDArray] = []
    versions: list[NDArray] = []
    prompt_lengths = np.zeros(len(rollouts), dtype=np.int64)
    response_lengths = np.zeros(len(rollouts), dtype=np.int64)
    with_logprobs = any(r.logprobs is not None for r in rollouts)
    for i, r in enumerate(rollouts):
        prompt = empty if r.prompt_ids is None else np.asarray(r.prompt_ids).ravel()
        response = np.asarray(r.response_ids).ravel()
        mask = r.mask
        if mask.size != response.size:
            raise ValueError(
                f"rollout {r.rollout_id!r} has {mask.size} loss_mask values for "
                f"{response.size} response tokens"
            )
        if r.logprobs is not None and r.logprobs.size != response.size:
            raise ValueError(
                f"rollout {r.rollout_id!r} has {r.logprobs.size} logprobs for "
                f"{response.size} response tokens"
            )
        prompt_lengths[i], response_lengths[i] = prompt.size, response.size
        pieces += (prompt, response)
        masks.append(mask)
        versions.append(r.token_versions)
        if with_logprobs:
            lp = r.logprobs if r.logprobs is not None else np.full(response.size, np.nan)
            logprobs.append(lp)
    lengths = prompt_lengths + response_lengths
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(total, dtype=np.int64) - starts
    response = positions >= np.repeat(prompt_lengths, lengths)

    def spread(values: list[NDArray], dtype: type[np.generic], fill: float) -> NDArray:
        out = np.full(total, fill, dtype=dtype)
        out[response] = _concat(values, dtype)
        return out

    loss_mask = spread(masks, np.float32, 0)
    loss_mask[positions == 0] = 0  # no position before a sequence's first token predicts it
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
    advantages = group_advantages(
        rewards, [r.group_id for r in rollouts], scale_by_std=scale_by_std, eps=eps
    ).astype(np.float32)
    return _Tokens(
        input_ids=_concat(pieces, np.int64),
        position_ids=positions,
        loss_mask=loss_mask,
        old_logprobs=spread(logprobs, np.float32, 0) if with_logprobs else None,
        token_versions=spread(versions, np.int64, -1),
        token_advantages=np.where(loss_mask != 0, np.repeat(advantages, lengths), np.float32(0)),
        rewards=rewards.astype(np.float32),
        advantages=advantages,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
    )


def _concat(values: list[NDArray], dtype: type[np.generic]) -> NDArray:
    if not values:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(values, dtype=dtype, casting="same_kind")


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {value!r}") from None
    if n < low or (high is not None and n > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ValueError(f"{name} must be an int {bound}, not {n}")
    return n


def _ints(values: Any) -> list[int]:
    """A numpy array's or a tensor's values as ints."""
    return [int(v) for v in values.tolist()]


def _float32(values: Any) -> npt.NDArray[np.float32]:
    """An array, or a torch tensor (perhaps on a GPU or in bfloat16), as a float32 numpy array."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float32)


def _split(
    input_ids: Any, values: Any, spans: list[tuple[int, int, int]]
) -> list[npt.NDArray[np.float32]]:
    array = _float32(values)
    shape = tuple(input_ids.shape)
    if array.shape != shape:
        raise ValueError(f"values of shape {array.shape}: input_ids' shape {shape} is wanted")
    return [array[row, start : start + n].copy() for row, start, n in spans]


def _join(
    input_ids: Any, values: Sequence[Any], spans: list[tuple[int, int, int]], fill: float
) -> Any:
    if len(values) != len(spans):
        raise ValueError(f"values for {len(values)} rollouts: the batch has {len(spans)}")
    out = np.full(tuple(input_ids.shape), fill, dtype=np.float32)
    for i, ((row, start, n), v) in enumerate(zip(spans, values, strict=True)):
        array = _float32(v)
        if array.shape != (n,):
            raise ValueError(f"rollout {i}: values of shape {array.shape}, its response has {n}")
        out[row, start : start + n] = array
    if isinstance(input_ids, np.ndarray):
        return out
    return _torch().from_numpy(out).to(input_ids.device)


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            "to_torch() needs PyTorch, which is not installed (pip install torch); the arrays "
            "themselves are numpy and need nothing more"
        ) from err
    return torch


def _tensors(arrays: Any, device: Any) -> dict[str, Any]:
    torch = _torch()
    out: dict[str, Any] = {}
    for f in fields(arrays):
        value = getattr(arrays, f.name)
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor) and device is not None:
            value = value.to(device)
        out[f.name] = value
    return out
