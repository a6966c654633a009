"""Pushing the trainer's weights to a pool of rollout ranks: one source rank broadcasts, the others receive.

Asynchronous RL keeps the rollout pool generating while the trainer pool updates; after an update the
trainer's first rank (the source) sends the new weights to every rollout rank of a process group that
holds both (the "pool group"). :func:`broadcast_weights` is called by every rank of that group, in step:

- on the source it takes ``(hf_name, full_tensor)`` pairs (``full_state_dict`` of the training engine:
  gathered full tensors, one at a time) and returns a :class:`BroadcastStats`;
- on the other ranks it returns a :class:`WeightStream`, an iterable of ``(hf_name, tensor)`` to hand
  straight to a rollout engine's ``sync_weights``, with the weights' ``version`` known up front.

**Wire format.** A start header (version, protocol) is broadcast first, then the tensors travel in flat
buckets of one dtype and at most ``bucket_bytes`` (a larger tensor travels alone, as its own bucket). Each
bucket is a small header (``broadcast_object_list``: names, shapes, the names of tied aliases, the names the
receivers may forget) followed by one broadcast of the bucket's bytes as a ``uint8`` buffer, so any dtype
gloo cannot reduce (bf16, bool) still travels. Only the headers are pickled; tensor data never is.

**Devices.** Every rank of a broadcast must hand the collective a tensor on the same kind of device: under
``cpu:gloo,cuda:nccl`` the device picks the backend, and a CPU buffer on one rank (gloo) with a CUDA buffer on
another (NCCL) wait for each other forever. The bucket header names the device the bytes travel on; a receiver
allocates its buffer there and moves the tensors to the device it asked for afterwards. The source sends a
CPU bucket (an offloaded trainer's gathered tensors) from its CUDA device when its group has NCCL for CUDA
tensors, so the weights cross the network over NCCL, not gloo.

**Memory.** The source holds the tensors of the bucket it is filling plus their packed copy. A receiver
holds one received bucket beyond the tensors its consumer still references: the tensors it yields are
views into the bucket's buffer, so a consumer that copies and drops them (``sync_weights``) frees the
bucket before the next one arrives.

**Tied weights** (the same data under two names, as ``full_state_dict`` yields
``model.embed_tokens.weight`` and ``lm_head.weight``) are sent once: the second name travels as an alias
in a header and the receiver yields the tensor it already has under the new name. To resolve an alias
that arrives buckets later, a receiver keeps each received tensor until the source says it may forget
it: the source watches each sent tensor through a weak reference and, once the producer has dropped it
(so no alias of it can come), lists its name as released in the next header. A producer that keeps
every tensor alive (a list, a dict's items) therefore makes the receivers keep every tensor too; pass a
stream that drops each tensor once yielded (``full_state_dict`` does) for the bounded memory above.

**Failures.** Every rank of the group must take part in every broadcast, so a rank that stops early
would leave the others waiting:

- the source's producer raising (a failed gather) makes the source broadcast an abort header before it
  re-raises; the receivers raise :class:`WeightBroadcastError` with the source's error in the message;
- a receiver's consumer stopping early (``sync_weights`` refusing a tensor): leaving the ``with`` block
  of the :class:`WeightStream` (or calling :meth:`WeightStream.close`) receives and discards the rest, so
  the source finishes; a stream abandoned without ``close`` leaves the source waiting;
- a rank that dies or freezes: gloo fails the pending broadcast when the peer's connection closes, and
  otherwise the process group's timeout (``deadlines.process_group``) ends the wait; either way the
  survivors raise :class:`WeightBroadcastError` naming the source rank and the bucket. The group is then
  unusable and the job ends (torchrun restarts it from the last checkpoint).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BroadcastStats", "WeightBroadcastError", "WeightStream", "broadcast_weights", "PROTOCOL"]

#: the wire format's version, checked by the receivers (a trainer and a rollout pool of different builds)
PROTOCOL = 1


class WeightBroadcastError(RuntimeError):
    """A weight broadcast that could not finish: the source's producer failed, or a rank of the group is gone."""


@attrs.frozen
class BroadcastStats:
    """What the source sent: the weights' version, names (aliases included), distinct tensors, bytes, buckets."""

    version: int
    names: int
    tensors: int
    bytes: int
    buckets: int


def broadcast_weights(
    named_tensors: Iterable[tuple[str, Tensor]] | None,
    *,
    group: Any,
    src: int,
    bucket_bytes: int,
    version: int,
    device: str | torch.device | None = None,
) -> BroadcastStats | WeightStream:
    """Broadcast ``named_tensors`` from global rank ``src`` to the other ranks of ``group`` (see the module doc).

    A collective of ``group`` (None: the default group). On ``src``: pass the ``(name, tensor)`` pairs and
    the ``version`` of the weights; returns :class:`BroadcastStats` once everything is sent. Elsewhere:
    pass None (``version`` is ignored; the source's arrives); returns a :class:`WeightStream` to iterate
    (use it as a context manager). ``device``: where a receiver puts the tensors it yields; default where they
    travelled (the CPU, or this rank's current CUDA device). The bytes themselves always travel on the device
    the source's header names (see the module doc).
    """
    if not bucket_bytes > 0:
        raise ValueError(f"broadcast_weights: bucket_bytes must be positive, got {bucket_bytes}")
    me = dist.get_rank()
    if me == src:
        if named_tensors is None:
            raise ValueError(f"broadcast_weights: rank {me} is the source (src={src}) but named_tensors is None")
        return _Sender(group, src, int(bucket_bytes), int(version)).run(named_tensors)
    if named_tensors is not None:
        raise ValueError(f"broadcast_weights: rank {me} receives from rank {src}; pass named_tensors=None there")
    header = _bcast_header(None, group, src, "the start header")
    if header.get("kind") != "start" or header.get("protocol") != PROTOCOL:
        raise WeightBroadcastError(
            f"weight broadcast from rank {src}: expected a start header of wire protocol {PROTOCOL}, got "
            f"kind {header.get('kind')!r} of protocol {header.get('protocol')!r} (a trainer and rollout ranks of "
            "different builds, or the group's broadcasts out of step)"
        )
    return WeightStream(group=group, src=src, version=header["version"], device=device)


def _bcast_header(header: dict | None, group: Any, src: int, what: str) -> dict:
    box = [header]
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except Exception as e:  # noqa: BLE001 - a dead or frozen peer surfaces as any backend error
        raise WeightBroadcastError(_lost(src, what, e)) from e
    return box[0]


def _bcast_bytes(buffer: Tensor, group: Any, src: int, what: str) -> None:
    try:
        dist.broadcast(buffer, src=src, group=group)
    except Exception as e:  # noqa: BLE001
        raise WeightBroadcastError(_lost(src, what, e)) from e


def _lost(src: int, what: str, error: BaseException) -> str:
    return (
        f"weight broadcast from source rank {src} failed on rank {dist.get_rank()} while moving {what}: a rank of the "
        f"group is gone or stuck "
        f"(a dead peer closes its connections; the process-group timeout bounds the rest): {error}"
    )


@attrs.define
class _Bucket:
    """The bucket the source is filling: one dtype and device, the tensors' views and their header entries."""

    dtype: torch.dtype | None = None
    device: torch.device | None = None
    parts: list[Tensor] = attrs.Factory(list)
    entries: list[tuple[str, tuple[int, ...]]] = attrs.Factory(list)
    aliases: list[tuple[str, str]] = attrs.Factory(list)
    nbytes: int = 0


def _identity(tensor: Tensor) -> tuple:
    """The same data: one storage, viewed the same way. ``full_state_dict`` yields a tied weight as one tensor
    object; a module's ``state_dict`` yields two tensor objects over one storage; both match."""
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


class _Sender:
    """The source's side: buckets, tie detection and the release of names no alias can refer to any more."""

    def __init__(self, group: Any, src: int, bucket_bytes: int, version: int) -> None:
        self.group, self.src, self.bucket_bytes, self.version = group, src, bucket_bytes, version
        self.sent: dict[tuple, tuple[str, weakref.ref]] = {}  # _identity(tensor) -> (its first name, a weak reference)
        self.released: list[str] = []  # names of dead tensors whose entry of ``sent`` was reused
        self.names = self.tensors = self.bytes = self.buckets = 0

    def run(self, named_tensors: Iterable[tuple[str, Tensor]]) -> BroadcastStats:
        _bcast_header(
            {"kind": "start", "protocol": PROTOCOL, "version": self.version}, self.group, self.src, "the start header"
        )
        bucket = _Bucket()
        try:
            for name, tensor in named_tensors:
                bucket = self._add(bucket, name, tensor)
        except WeightBroadcastError:
            raise  # our own broadcast failed: the group is broken, another header would wait as well
        except BaseException as e:
            self._send_header({"kind": "abort", "error": f"{type(e).__name__}: {e}"}, "the abort header")
            raise
        self._flush(bucket, done=True)
        return BroadcastStats(
            version=self.version, names=self.names, tensors=self.tensors, bytes=self.bytes, buckets=self.buckets
        )

    def _add(self, bucket: _Bucket, name: str, tensor: Tensor) -> _Bucket:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"broadcast_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        self.names += 1
        key = _identity(tensor)
        seen = self.sent.get(key)
        if seen is not None and seen[1]() is not None:
            # a tied weight: the earlier tensor is alive, so its storage (and this key) is still that data
            bucket.aliases.append((name, seen[0]))
            return bucket
        if seen is not None:
            self.released.append(seen[0])  # the key's earlier tensor died (its memory reused); its name can go
        self.sent[key] = (name, weakref.ref(tensor))
        nbytes = tensor.numel() * tensor.element_size()
        if bucket.parts and (
            tensor.dtype != bucket.dtype or tensor.device != bucket.device or bucket.nbytes + nbytes > self.bucket_bytes
        ):
            self._flush(bucket, done=False)
            bucket = _Bucket()
        bucket.dtype, bucket.device = tensor.dtype, tensor.device
        bucket.parts.append(tensor.detach().reshape(-1))
        bucket.entries.append((name, tuple(tensor.shape)))
        bucket.nbytes += nbytes
        self.tensors += 1
        if bucket.nbytes >= self.bucket_bytes:  # full, or one tensor larger than a bucket: it travels alone
            self._flush(bucket, done=False)
            bucket = _Bucket()
        return bucket

    def _flush(self, bucket: _Bucket, *, done: bool) -> None:
        if not bucket.parts and not bucket.aliases and not done:
            return
        flat = None
        if bucket.parts:
            flat = bucket.parts[0] if len(bucket.parts) == 1 else torch.cat(bucket.parts)
            bucket.parts.clear()
            flat = flat.contiguous().view(torch.uint8).to(_wire_device(flat.device, self.group))
        dead = [key for key, (_, ref) in self.sent.items() if ref() is None]
        released = self.released + [self.sent.pop(key)[0] for key in dead]
        self.released = []
        header = {
            "kind": "bucket",
            "done": done,
            "entries": bucket.entries,
            "aliases": bucket.aliases,
            "released": released,
            "dtype": str(bucket.dtype).removeprefix("torch.") if flat is not None else None,
            "device": flat.device.type if flat is not None else None,
        }
        self._send_header(header, f"the header of bucket {self.buckets}")
        if flat is not None:
            _bcast_bytes(flat, self.group, self.src, f"bucket {self.buckets}")
            self.bytes += bucket.nbytes
        self.buckets += 1

    def _send_header(self, header: dict, what: str) -> None:
        _bcast_header(header, self.group, self.src, what)


def _wire_device(device: torch.device, group: Any) -> torch.device:
    """Where a bucket made on ``device`` travels: a CPU bucket goes out from the current CUDA device when the group
    has NCCL for CUDA tensors (an offloaded trainer on GPUs), else where it is."""
    if device.type == "cpu" and torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return device


class WeightStream:
    """A receiver's side of one weight broadcast: iterate once for ``(hf_name, tensor)``; ``version`` is known
    before the first tensor. Use it as a context manager so a consumer that stops early still drains the
    broadcast (see the module doc): ``with broadcast_weights(None, ...) as s: sync_weights(rollout, s)``."""

    def __init__(self, *, group: Any, src: int, version: int, device: str | torch.device | None) -> None:
        self.group, self.src, self.version = group, src, int(version)
        self._device = torch.device(device) if device is not None else None
        self._stream: Iterator[tuple[str, Tensor]] | None = None
        self._finished = False
        self._draining = False
        self.buckets = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        if self._stream is not None:
            raise RuntimeError(f"the weight stream of version {self.version} from rank {self.src} can be iterated once")
        self._stream = self._receive()
        return self._stream

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def finished(self) -> bool:
        """Whether the whole broadcast has been received (or was aborted)."""
        return self._finished

    def close(self) -> None:
        """Receive and discard whatever the source still sends, so the source and the other receivers finish."""
        if self._finished:
            return
        self._draining = True
        stream = self._stream if self._stream is not None else self._receive()
        self._stream = stream
        for _ in stream:
            pass

    @staticmethod
    def _wire(device_type: str) -> torch.device:
        """This rank's device of the type the source's header names: the bytes must travel on it here too."""
        if device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(device_type)

    def _receive(self) -> Iterator[tuple[str, Tensor]]:
        kept: dict[str, Tensor] = {}  # received tensors the source may still send aliases of
        try:
            while True:
                header = _bcast_header(None, self.group, self.src, f"the header of bucket {self.buckets}")
                if header["kind"] == "abort":
                    raise WeightBroadcastError(
                        f"weight broadcast of version {self.version} from rank {self.src} was aborted by the source "
                        f"after {self.buckets} buckets: {header['error']}"
                    )
                targets = {of for _, of in header["aliases"]}
                for name in header["released"]:
                    if name not in targets:
                        kept.pop(name, None)
                received = self._unpack(header)
                if not self._draining:
                    kept.update(received)
                    yield from received
                    for name, of in header["aliases"]:
                        if of not in kept:
                            raise WeightBroadcastError(
                                f"weight broadcast from rank {self.src}: alias {name!r} of {of!r}, "
                                f"which this rank does not hold"
                            )
                        yield name, kept[of]
                for name in header["released"]:
                    kept.pop(name, None)
                self.buckets += 1
                if header["done"]:
                    return
        finally:
            self._finished = True

    def _unpack(self, header: dict) -> list[tuple[str, Tensor]]:
        if header["dtype"] is None:
            return []
        dtype = getattr(torch, header["dtype"])
        shapes = [torch.Size(shape) for _, shape in header["entries"]]
        numels = [shape.numel() for shape in shapes]
        itemsize = torch.empty((), dtype=dtype).element_size()
        buffer = torch.empty(sum(numels) * itemsize, dtype=torch.uint8, device=self._wire(header["device"]))
        _bcast_bytes(buffer, self.group, self.src, f"bucket {self.buckets}")
        if self._device is not None and buffer.device != self._device:
            buffer = buffer.to(self._device)
        flat = buffer.view(dtype)
        out, offset = [], 0
        for (name, _), shape, numel in zip(header["entries"], shapes, numels):
            out.append((name, flat[offset : offset + numel].view(shape)))
            offset += numel
        return out
