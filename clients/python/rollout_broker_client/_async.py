"""The asyncio client: :class:`AsyncBrokerClient`, its :class:`AsyncRolloutWriter` and
:class:`AsyncLease`. Same surface as the blocking client, every call awaited."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import httpx
import numpy.typing as npt

from rollout_broker_client._errors import BrokerError, BrokerUnreachable, OverCapacity, Unavailable
from rollout_broker_client._models import (
    Accounting,
    AckResult,
    Batch,
    IngestResult,
    PolicyResult,
    Rejection,
    Run,
    RunConfig,
    VersionAccounting,
)
from rollout_broker_client._wire import Api, Call, Format, Retry, RolloutLike, check, unreachable

__all__ = ["DEFAULT_URL", "AsyncBrokerClient", "AsyncLease", "AsyncRolloutWriter"]

log = logging.getLogger("rollout_broker.client")
T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"


class AsyncBrokerClient:
    """An asyncio client of one broker.

    ``AsyncBrokerClient("http://broker:8000")`` talks over the network. It also takes any
    ``httpx.AsyncClient`` as ``http`` (its base URL is used when ``base_url`` is not given), so it
    can reach an app in this process through ``httpx.ASGITransport``, which runs no lifespan::

        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://broker") as http:
                broker = AsyncBrokerClient(http=http)

    ``format="msgpack"`` (the default) sends rollouts and acks as msgpack with token ids and
    logprobs as little-endian int32/float32 bytes, and asks for batches the same way;
    ``format="json"`` uses plain JSON lists throughout.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: float = 10.0,
        retry: Retry | None = None,
        format: Format = "msgpack",
        trainer_id: str | None = None,
    ) -> None:
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient()
        inherited = str(self._http.base_url) if http is not None else ""
        self.base_url = (base_url or inherited or DEFAULT_URL).rstrip("/")
        self.timeout = timeout
        self.retry = retry or Retry()
        self.api = Api(format, trainer_id)

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool (not one passed in as ``http``)."""
        if self._owns_http:
            await self._http.aclose()

    async def send(self, call: Call[T]) -> T:
        """Send one request, retrying as :class:`Retry` allows; returns the parsed answer."""
        attempt = 0
        while True:
            try:
                resp = await self._http.request(
                    call.method,
                    self.base_url + call.path,
                    params=call.params,
                    content=call.content,
                    headers=call.headers,
                    timeout=self.timeout + call.extra_timeout,
                )
            except httpx.TransportError as exc:
                if not self.retry.after_error(call, exc, attempt):
                    raise unreachable(call, self.base_url, exc) from exc
            else:
                if not self.retry.after_status(call, resp.status_code, attempt):
                    return call.read(resp, check(resp))
            await asyncio.sleep(self.retry.delay(attempt))
            attempt += 1

    # -- health ---------------------------------------------------------------------------
    async def healthz(self) -> bool:
        """True when the API process answers."""
        try:
            await self.send(self.api.healthz())
        except BrokerError:
            return False
        return True

    async def ready(self) -> bool:
        """True when the broker's Redis and Postgres are reachable (``GET /readyz``)."""
        try:
            await self.send(self.api.readyz())
        except (Unavailable, BrokerUnreachable):
            return False
        return True

    # -- runs -----------------------------------------------------------------------------
    async def create_run(
        self, run_id: str | None = None, config: RunConfig | Mapping[str, Any] | None = None
    ) -> Run:
        """Create a run (or get it back, if it exists with the same config)."""
        return await self.send(self.api.create_run(run_id, config))

    async def list_runs(self) -> list[Run]:
        return await self.send(self.api.list_runs())

    async def get_run(self, run_id: str) -> Run:
        return await self.send(self.api.get_run(run_id))

    async def patch_config(self, run_id: str, **changes: Unpack[RunConfig]) -> Run:
        """Change some of a run's rules; they apply at once."""
        return await self.send(self.api.patch_config(run_id, changes))

    async def close_run(self, run_id: str) -> Run:
        return await self.send(self.api.close_run(run_id))

    async def set_policy(self, run_id: str, version: int) -> PolicyResult:
        """Announce policy ``version``; rollouts now too stale retire (``evicted``)."""
        return await self.send(self.api.set_policy(run_id, version))

    # -- generators -----------------------------------------------------------------------
    async def post_rollouts(self, run_id: str, rollouts: Sequence[RolloutLike]) -> IngestResult:
        """One ingest request. Raises :class:`OverCapacity` when the run is full; the
        :meth:`writer` waits instead."""
        return await self.send(self.api.post_rollouts(run_id, rollouts))

    def writer(
        self,
        run_id: str,
        *,
        batch_size: int = 256,
        linger_s: float | None = None,
        max_backpressure_s: float | None = 600.0,
    ) -> AsyncRolloutWriter:
        """A writer that batches rollouts into requests; see :class:`AsyncRolloutWriter`."""
        return AsyncRolloutWriter(
            self,
            run_id,
            batch_size=batch_size,
            linger_s=linger_s,
            max_backpressure_s=max_backpressure_s,
        )

    # -- trainers -------------------------------------------------------------------------
    async def lease_batch(
        self,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> Batch | None:
        """Lease a batch of ``size`` rollouts, waiting up to ``wait_s``; None if none qualified.
        You must :meth:`ack` or :meth:`nack` it; :meth:`lease` does that for you."""
        return await self.send(
            self.api.lease(
                run_id,
                size,
                policy_version=policy_version,
                wait_s=wait_s,
                partial=partial,
                trainer_id=trainer_id,
            )
        )

    def lease(
        self,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> AsyncLease:
        """A lease as an async context manager; see :class:`AsyncLease`."""
        return AsyncLease(
            self,
            run_id,
            size,
            policy_version=policy_version,
            wait_s=wait_s,
            partial=partial,
            trainer_id=trainer_id,
        )

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        logprobs: Mapping[str, npt.ArrayLike] | None = None,
        kl: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> AckResult:
        """Acknowledge a batch: every rollout gains a use. ``logprobs`` are the current
        policy's on the same tokens, by rollout_id; a repeated ack returns the same answer."""
        return await self.send(self.api.ack(run_id, batch_id, logprobs=logprobs, kl=kl, step=step))

    async def nack(self, run_id: str, batch_id: str) -> int:
        """Give a batch back unused; returns how many rollouts went back."""
        return await self.send(self.api.nack(run_id, batch_id))

    # -- operators ------------------------------------------------------------------------
    async def accounting(self, run_id: str) -> Accounting:
        return await self.send(self.api.accounting(run_id))

    async def wait_for_accounting(
        self, run_id: str, *, timeout_s: float = 30.0, poll_s: float = 0.1
    ) -> Accounting:
        """The accounting once it has caught up with every change made so far
        (``pending_events == 0``). Raises TimeoutError if it has not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            acc = await self.accounting(run_id)
            if not acc.pending_events:
                return acc
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"accounting of {run_id!r} still {acc.pending_events} events behind "
                    f"after {timeout_s} s"
                )
            await asyncio.sleep(poll_s)

    async def accounting_versions(self, run_id: str) -> list[VersionAccounting]:
        return await self.send(self.api.accounting_versions(run_id))

    async def batches(self, run_id: str) -> list[dict[str, Any]]:
        """The batch ledger of a run, every page."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = await self.send(self.api.batches_page(run_id, cursor))
            out.extend(page.get("batches", []))
            cursor = page.get("next_cursor")
            if not cursor:
                return out


class AsyncRolloutWriter:
    """Batches a generator's rollouts into ingest requests.

    ``add(*rollouts)`` buffers (the rollouts of one call always travel in one request, so pass a
    whole group at once); a request goes out when ``batch_size`` rollouts are buffered, when the
    oldest has waited ``linger_s`` (checked on ``add``), on :meth:`flush` and when its
    ``async with`` block ends normally. Resending is safe, since ``rollout_id`` makes ingest
    idempotent, so lost answers are retried. A ``429`` is backpressure: the writer waits the
    ``Retry-After`` seconds and sends again, for up to ``max_backpressure_s`` in all (None:
    without limit), then raises :class:`OverCapacity`. Per-rollout rejections (``stale``, ...)
    are not errors: they are collected in :attr:`rejected`.

    If a request fails as a whole (``422``, ``404``...) its rollouts are dropped and the error
    raised; if the broker cannot be reached, or stays full, they stay buffered for the next
    flush.
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        *,
        batch_size: int = 256,
        linger_s: float | None = None,
        max_backpressure_s: float | None = 600.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.client = client
        self.run_id = run_id
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.max_backpressure_s = max_backpressure_s
        self._buffer: list[RolloutLike] = []
        self._since = 0.0
        self.accepted = 0
        self.duplicates = 0
        self.rejected: list[Rejection] = []
        self.requests = 0
        self.backpressure_waits = 0
        self.backpressure_s = 0.0

    async def __aenter__(self) -> AsyncRolloutWriter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.flush()

    @property
    def pending(self) -> int:
        """Rollouts buffered, not yet sent."""
        return len(self._buffer)

    async def add(self, *rollouts: RolloutLike) -> IngestResult | None:
        """Buffer rollouts; returns the ingest answer if this call sent a request."""
        if not self._buffer:
            self._since = time.monotonic()
        self._buffer.extend(rollouts)
        due = self.linger_s is not None and time.monotonic() - self._since >= self.linger_s
        if len(self._buffer) >= self.batch_size or due:
            return await self.flush()
        return None

    async def flush(self) -> IngestResult | None:
        """Send everything buffered; None if nothing was."""
        if not self._buffer:
            return None
        call = self.client.api.post_rollouts(self.run_id, self._buffer)
        waited = 0.0
        while True:
            try:
                result = await self.client.send(call)
            except OverCapacity as exc:
                pause = exc.retry_after_s
                if self.max_backpressure_s is not None and waited + pause > self.max_backpressure_s:
                    raise
                self.backpressure_waits += 1
                self.backpressure_s += pause
                waited += pause
                await asyncio.sleep(pause)
                continue
            except BrokerUnreachable:
                raise
            except BrokerError:
                self._buffer = []
                raise
            break
        self._buffer = []
        self.requests += 1
        self.accepted += result.accepted
        self.duplicates += result.duplicates
        self.rejected.extend(result.rejected)
        return result

    async def close(self) -> None:
        await self.flush()


class AsyncLease:
    """``async with client.lease(run_id, size) as batch:`` leases a batch (``batch`` is None when
    nothing qualified within ``wait_s``; leaving the block then does nothing).

    Leave the block normally and the batch is acked with what :meth:`Batch.ack_with` set (the
    current policy's logprobs, or KL values, and the step); the answer is in
    ``batch.ack_result``, and an ack that fails (say :class:`LeaseExpired`) raises. Leave it with
    an exception and the batch is nacked, its rollouts going back unused, and the exception goes
    on (a failing nack is logged: the lease then simply expires).
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self._call = client.api.lease(
            run_id,
            size,
            policy_version=policy_version,
            wait_s=wait_s,
            partial=partial,
            trainer_id=trainer_id,
        )
        self.batch: Batch | None = None

    async def __aenter__(self) -> Batch | None:
        self.batch = await self.client.send(self._call)
        return self.batch

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        batch = self.batch
        if batch is None:
            return
        if exc_type is None:
            args = batch.pending_ack()
            batch.ack_result = await self.client.ack(self.run_id, batch.batch_id, **args)
            return
        try:
            await self.client.nack(self.run_id, batch.batch_id)
        except BrokerError as err:
            log.warning("nack of batch %s failed (%s); its lease will expire", batch.batch_id, err)
