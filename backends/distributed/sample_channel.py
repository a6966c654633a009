"""A versioned channel for rollout batches, from rollout ranks to trainer ranks, and the staleness bound.

Asynchronous RL lets the rollout pool run ahead of the trainer: while the trainer updates on batch ``s``
the rollout ranks already generate batch ``s + 1`` (or up to ``s + k``) with the weights they have. Each
batch therefore carries the ``version`` of the weights that sampled it (the number of updates behind
them) and the ``step`` it is meant for; the trainer, at its own version, computes the batch's staleness
(``trainer version - sample version``) and :class:`StalenessBound` decides whether it may train on it.

**Messages.** Point-to-point, on a tag of their own (so they do not mix with other point-to-point traffic of the group):
a header of five int64 (magic, kind, byte count, version, step), then the payload as ``torch.save`` bytes in a uint8
tensor. The payload is a dict of tensors and plain values (numbers, strings, None, lists / tuples / dicts of those),
checked on the sender so a bad value fails where it was made (tensors travel on the CPU: under ``cpu:gloo,cuda:nccl``
the channel is gloo's); the receiver loads it with ``torch.load(weights_only=True)``, which cannot run code.
:class:`SampleSender` sends with ``isend`` and keeps each pending work and its buffers alive until
:meth:`SampleSender.flush` (or a later send) sees it done, so the rollout rank goes on generating.

**Shutdown.** :meth:`SampleSender.close` sends a sentinel message (kind 0) and flushes. The receiver's
:meth:`SampleReceiver.batches` loop ends at the sentinel; :meth:`SampleReceiver.drain` reads and drops
the batches still in flight up to the sentinel, so a sender whose batches were never wanted (the run
ended, a checkpoint boundary) can flush and exit. A sender's flush waits for its receiver, so each
side of a channel must close or drain it before tearing the process group down.

**Dead peers.** Every wait has a timeout (``timeout_s``): gloo's point-to-point works take one
(``work.wait(timeout)``), and the process group's own timeout bounds the backends whose works do not.
A peer that exits closes its connections, which fails the pending receive at once; a frozen peer is
found by the timeout. Either way :class:`ChannelError` names the peer rank and what was awaited.
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any, Iterator, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ChannelClosed", "ChannelError", "SampleReceiver", "SampleSender", "StalenessBound", "CHANNEL_TAG"]

#: the point-to-point tag of the channel's messages (other point-to-point traffic of the group uses 0)
CHANNEL_TAG = 0x5A3C
#: the first word of every header: a message of another protocol (or a garbled one) is refused by name
MAGIC = 0x524C4643  # "RLFC"
_BATCH, _CLOSE = 1, 0
_PLAIN = (bool, int, float, str, type(None))


class ChannelError(RuntimeError):
    """A channel's peer did not deliver (it exited, froze past the timeout) or sent something malformed."""


class ChannelClosed(Exception):
    """The sender closed the channel (the sentinel arrived): no more batches from that rank."""


def _check_value(value: Any, where: str) -> None:
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"sample payload {where}: a {value.layout} tensor; send dense tensors")
        return
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"sample payload {where}: key {key!r} is a {type(key).__name__}; use str or int keys")
            _check_value(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"sample payload {where}: a {type(value).__name__} cannot be loaded with weights_only=True; send tensors, "
        "numbers, strings, None and lists / tuples / dicts of those"
    )


def _seconds(timeout_s: float, who: str) -> timedelta:
    if not timeout_s > 0:
        raise ValueError(f"{who}: timeout_s must be positive, got {timeout_s}")
    return timedelta(seconds=timeout_s)


def _wait(work: Any, timeout: timedelta, *, peer: int, what: str) -> None:
    """``work.wait`` bounded by ``timeout``; a dead or silent peer becomes a :class:`ChannelError` naming it."""
    try:
        done = work.wait(timeout)
    except Exception as e:  # noqa: BLE001 - a closed connection or a timeout surfaces as a backend error
        raise ChannelError(
            f"sample channel on rank {dist.get_rank()}: {what} rank {peer} failed (waiting at most "
            f"{timeout.total_seconds():g}s; rank {peer} exited, froze or never took part): {e}"
        ) from e
    if done is False:
        raise ChannelError(
            f"sample channel on rank {dist.get_rank()}: {what} rank {peer} did not complete within "
            f"{timeout.total_seconds():g}s (rank {peer} exited, froze or never took part)"
        )


class SampleSender:
    """The rollout side: :meth:`send_samples` to a trainer rank without blocking; :meth:`flush`; :meth:`close`."""

    def __init__(self, *, group: Any = None, tag: int = CHANNEL_TAG, timeout_s: float = 1800.0) -> None:
        self.group, self.tag = group, tag
        self.timeout = _seconds(timeout_s, "SampleSender")
        self._pending: list[tuple[Any, int, tuple[Tensor, ...], str]] = []  # (work, dst, buffers kept alive, what)
        self.sent = 0

    @property
    def pending(self) -> int:
        """Messages whose send has not been seen complete yet."""
        self._reap()
        return len(self._pending)

    def send_samples(self, payload: Mapping[str, Any], *, dst: int, version: int, step: int) -> None:
        """Queue ``payload`` for global rank ``dst``, tagged with the weights' ``version`` and the ``step``; returns
        at once (the bytes go when ``dst`` receives). A value ``torch.load(weights_only=True)`` cannot load
        (a module, a dataclass) raises here, naming its key."""
        if not isinstance(payload, Mapping):
            raise TypeError(f"send_samples: the payload must be a dict, got {type(payload).__name__}")
        for key, value in payload.items():
            if not isinstance(key, str):
                raise TypeError(f"send_samples: payload key {key!r} is a {type(key).__name__}; use str keys")
            _check_value(value, repr(key))
        blob = io.BytesIO()
        torch.save({k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in payload.items()}, blob)
        data = torch.frombuffer(bytearray(blob.getbuffer()), dtype=torch.uint8)
        self._post(_BATCH, data, dst=dst, version=version, step=step)
        self.sent += 1

    def close(self, dsts: int | list[int]) -> None:
        """Send the sentinel to each rank of ``dsts`` and :meth:`flush`: their receive loops end there."""
        for dst in [dsts] if isinstance(dsts, int) else list(dsts):
            self._post(_CLOSE, torch.empty(0, dtype=torch.uint8), dst=dst, version=-1, step=-1)
        self.flush()

    def flush(self) -> None:
        """Wait until every queued message has been received (each wait bounded by the timeout)."""
        while self._pending:
            work, dst, _, what = self._pending.pop(0)
            _wait(work, self.timeout, peer=dst, what=f"sending {what} to")

    def _post(self, kind: int, data: Tensor, *, dst: int, version: int, step: int) -> None:
        self._reap()
        header = torch.tensor([MAGIC, kind, data.numel(), int(version), int(step)], dtype=torch.int64)
        what = f"the batch of step {step}" if kind == _BATCH else "the sentinel"
        works = [dist.isend(header, dst=dst, group=self.group, tag=self.tag)]
        if data.numel():
            works.append(dist.isend(data, dst=dst, group=self.group, tag=self.tag))
        for work in works:
            self._pending.append((work, dst, (header, data), what))

    def _reap(self) -> None:
        """Forget the sends already complete (their buffers can go)."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]


class SampleReceiver:
    """The trainer side: :meth:`recv_samples` from a rollout rank, :meth:`batches` until the sentinel, :meth:`drain`."""

    def __init__(self, *, group: Any = None, tag: int = CHANNEL_TAG, timeout_s: float = 1800.0) -> None:
        self.group, self.tag = group, tag
        self.timeout = _seconds(timeout_s, "SampleReceiver")
        self.closed: set[int] = set()  # source ranks whose sentinel has arrived
        self.received = 0

    def recv_samples(self, *, src: int, timeout_s: float | None = None) -> tuple[dict[str, Any], int, int]:
        """The next batch from global rank ``src``: ``(payload, version, step)``. Raises :class:`ChannelClosed` at
        the sentinel and :class:`ChannelError` when ``src`` is gone or silent past the timeout."""
        if src in self.closed:
            raise ChannelClosed(f"rank {src} closed its sample channel to rank {dist.get_rank()}")
        timeout = self.timeout if timeout_s is None else _seconds(timeout_s, "recv_samples")
        header = torch.empty(5, dtype=torch.int64)
        _wait(
            dist.irecv(header, src=src, group=self.group, tag=self.tag),
            timeout,
            peer=src,
            what="waiting for a batch header from",
        )
        magic, kind, nbytes, version, step = (int(x) for x in header.tolist())
        if magic != MAGIC or kind not in (_BATCH, _CLOSE) or nbytes < 0:
            raise ChannelError(f"sample channel: malformed header {header.tolist()} from rank {src} (tag {self.tag})")
        if kind == _CLOSE:
            self.closed.add(src)
            raise ChannelClosed(f"rank {src} closed its sample channel to rank {dist.get_rank()}")
        data = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            _wait(
                dist.irecv(data, src=src, group=self.group, tag=self.tag),
                timeout,
                peer=src,
                what=f"waiting for the {nbytes} bytes of the batch of step {step} from",
            )
        try:
            payload = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a malformed message
            raise ChannelError(f"sample channel: the batch of step {step} from rank {src} does not load: {e}") from e
        self.received += 1
        return payload, version, step

    def batches(self, *, src: int) -> Iterator[tuple[dict[str, Any], int, int]]:
        """``(payload, version, step)`` from ``src`` until its sentinel."""
        while True:
            try:
                yield self.recv_samples(src=src)
            except ChannelClosed:
                return

    def drain(self, *, src: int) -> int:
        """Read and drop the batches of ``src`` up to its sentinel (a shutdown with batches in flight);
        returns how many were dropped."""
        return sum(1 for _ in self.batches(src=src))


@attrs.define
class StalenessBound:
    """Whether the trainer may train on a batch: its staleness (trainer version - sample version) must be at
    most ``max_staleness``. A staler batch is rejected, never trained on, and counted; a batch from a
    version the trainer has not reached yet is a bookkeeping error and raises."""

    max_staleness: int = attrs.field(validator=attrs.validators.ge(0))
    accepted: int = 0
    rejected: int = 0
    staleness_sum: int = 0  #: over the accepted batches
    staleness_max: int = 0  #: over the accepted batches
    last: int = 0  #: the last batch's staleness, accepted or not

    def admit(self, trainer_version: int, sample_version: int) -> bool:
        """Count the batch and say whether it may be trained on."""
        staleness = int(trainer_version) - int(sample_version)
        if staleness < 0:
            raise ValueError(
                f"a batch sampled by weights version {sample_version} reached the trainer at version "
                f"{trainer_version}: versions must only grow (a version counter is reset or shared wrongly)"
            )
        self.last = staleness
        if staleness > self.max_staleness:
            self.rejected += 1
            return False
        self.accepted += 1
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        return True

    def metrics(self) -> dict[str, float]:
        """The counts and the staleness over the run's accepted batches, for the metrics log: ``staleness/accepted``,
        ``rejected``, ``bound``, ``run_mean``, ``run_max``. They join the step's own ``staleness/*`` (its tokens':
        ``min``, ``mean``, ``max``, ``frac_*``; ``backends.loop.split.stamp_policy_version``) in one set."""
        return {
            "staleness/accepted": float(self.accepted),
            "staleness/rejected": float(self.rejected),
            "staleness/bound": float(self.max_staleness),
            "staleness/run_mean": self.staleness_sum / self.accepted if self.accepted else 0.0,
            "staleness/run_max": float(self.staleness_max),
        }
