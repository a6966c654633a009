"""The building blocks of asynchronous RL on real gloo process groups: the trainer's weights broadcast to a
rollout pool (:mod:`backends.distributed.weight_broadcast`) and the versioned channel of rollout batches
with its staleness bound (:mod:`backends.distributed.sample_channel`).

Rank 0 plays the trainer (the broadcast's source, the batches' receiver), rank 1 (and 2) the rollout pool.
The schedules are those an asynchronous recipe runs: the rollout rank ``lag`` batches ahead of the trainer,
weights pushed after each update, every batch tagged with the version of the weights that sampled it.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from backends.distributed.sample_channel import (
    ChannelClosed,
    ChannelError,
    SampleReceiver,
    SampleSender,
    StalenessBound,
)
from backends.distributed.weight_broadcast import WeightBroadcastError, WeightStream, broadcast_weights
from tests import forkserver
from tests.distributed import free_port, run_distributed

pytestmark = [pytest.mark.offpolicy, pytest.mark.distributed]

#: (name, shape, dtype) of the weights the broadcast tests send; "lm_head.weight" is tied to the embedding
LAYOUT = [
    ("model.embed_tokens.weight", (16, 8), torch.float32),
    ("model.layers.0.mlp.up_proj.weight", (12, 8), torch.bfloat16),
    ("model.layers.0.input_layernorm.weight", (8,), torch.float32),
    ("model.layers.0.mlp.down_proj.weight", (8, 12), torch.bfloat16),
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), torch.float32),
    ("model.norm.weight", (8,), torch.bfloat16),
    ("num_batches_tracked", (), torch.int64),
    ("lm_head.weight", (16, 8), torch.float32),
]
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _tensor(index: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    if dtype == torch.int64:
        return torch.randint(0, 1 << 40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _expected() -> dict[str, torch.Tensor]:
    made = {name: _tensor(i, shape, dtype) for i, (name, shape, dtype) in enumerate(LAYOUT) if name not in TIED}
    return {name: made[TIED.get(name, name)] for name, _, _ in LAYOUT}


def _stream():
    """Like ``full_state_dict``: each tensor made when needed and dropped once yielded, except the tied one,
    kept (one object) until its second name has been yielded."""
    tied = {}
    for i, (name, shape, dtype) in enumerate(LAYOUT):
        if name in TIED:
            yield name, tied.pop(TIED[name])
            continue
        tensor = _tensor(i, shape, dtype)
        if name in TIED.values():
            tied[name] = tensor
        yield name, tensor


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())
    )


def _broadcast_once(rank: int, world: int, bucket_bytes: int):
    if rank == 0:
        stats = broadcast_weights(_stream(), group=None, src=0, bucket_bytes=bucket_bytes, version=7)
        return {"names": stats.names, "tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets}
    with broadcast_weights(None, group=None, src=0, bucket_bytes=bucket_bytes, version=-1) as stream:
        assert isinstance(stream, WeightStream)
        version = stream.version  # known before the first tensor
        got = [(name, tensor.clone()) for name, tensor in stream]
    return version, got


@pytest.mark.parametrize("bucket_bytes", [100, 700, 1 << 20])  # 100 < the largest tensor (512 bytes)
def test_received_weights_equal_sent_weights_bit_for_bit(bucket_bytes):
    stats, *receivers = run_distributed(_broadcast_once, 3, bucket_bytes, timeout=120)
    expected = _expected()
    distinct = [name for name, _, _ in LAYOUT if name not in TIED]
    assert stats["names"] == len(LAYOUT) and stats["tensors"] == len(distinct)
    # the tied weight's bytes travel once
    assert stats["bytes"] == sum(expected[n].numel() * expected[n].element_size() for n in distinct)
    if bucket_bytes < 512:
        assert stats["buckets"] > len(distinct) // 2
    for version, got in receivers:
        assert version == 7
        assert sorted(name for name, _ in got) == sorted(expected)
        for name, tensor in got:
            assert _bitwise_equal(tensor, expected[name]), name


def _producer_fails(rank: int, world: int):
    if rank == 0:

        def failing():
            for i, item in enumerate(_stream()):
                if i == 3:
                    raise RuntimeError("the gather of layer 0 failed")
                yield item

        try:
            broadcast_weights(failing(), group=None, src=0, bucket_bytes=64, version=3)
        except RuntimeError as e:
            return str(e)
        return "no error"
    stream = broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=-1)
    try:
        with stream:
            list(stream)
    except WeightBroadcastError as e:
        return str(e)
    return "no error"


def test_a_failing_producer_aborts_every_receiver_with_its_error():
    source, receiver = run_distributed(_producer_fails, 2, timeout=120)
    assert source == "the gather of layer 0 failed"
    assert "aborted by the source" in receiver and "the gather of layer 0 failed" in receiver and "rank 0" in receiver


def _consumer_stops_early(rank: int, world: int):
    if rank == 0:
        return broadcast_weights(_stream(), group=None, src=0, bucket_bytes=64, version=4).buckets
    with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=-1) as stream:
        for i, _ in enumerate(stream):
            if i == 1:
                break  # what sync_weights refusing a tensor looks like from here
    # the stream was drained: the group is usable, in step, for the next broadcast
    with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=-1) as again:
        names = [name for name, _ in again]
    return stream.finished, again.version, names


def _consumer_stops_early_then_again(rank: int, world: int):
    first = _consumer_stops_early(rank, world)
    if rank == 0:
        broadcast_weights(_stream(), group=None, src=0, bucket_bytes=64, version=5)
    return first


def test_a_consumer_that_stops_early_drains_the_broadcast():
    buckets, (finished, version, names) = run_distributed(_consumer_stops_early_then_again, 2, timeout=120)
    assert buckets > 2 and finished and version == 5
    assert sorted(names) == sorted(name for name, _, _ in LAYOUT)


# ---- version accounting: the rollout rank `lag` batches ahead, weights pushed after each update ----


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _rollout(model: nn.Module, *, steps: int, lag: int) -> int:
    """Batch ``s`` is sampled with weights version ``max(0, s - lag)``: before batch ``s > lag`` the pushed
    version ``s - lag`` is received."""
    init = model[0].weight.detach().clone()
    params = dict(model.named_parameters())
    sender, version = SampleSender(timeout_s=60), 0
    for s in range(steps):
        if s - lag >= 1:
            with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=-1) as stream, torch.no_grad():
                for name, tensor in stream:
                    params[name].copy_(tensor)
            version = stream.version
        offset = (model[0].weight.detach() - init).mean().item()  # what the weights that sample this batch are
        sender.send_samples(
            {"tokens": torch.full((2, 3), s), "weight_offset": offset, "note": "ok"}, dst=0, version=version, step=s
        )
    sender.close(0)
    return sender.sent


def _trainer(model: nn.Module, *, steps: int, lag: int, max_staleness: int) -> tuple[list, dict]:
    """Train on each batch as it comes (a fake update: +1.0 to every parameter), push the versions the
    rollout rank will ask for (1 .. steps - 1 - lag)."""
    receiver, bound, version, log = SampleReceiver(timeout_s=60), StalenessBound(max_staleness), 0, []
    for payload, sample_version, step in receiver.batches(src=1):
        accepted = bound.admit(version, sample_version)
        log.append((step, sample_version, version, accepted, payload["weight_offset"], int(payload["tokens"][0, 0])))
        if not accepted:
            continue
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        version += 1
        if version <= steps - 1 - lag:
            broadcast_weights(model.named_parameters(), group=None, src=0, bucket_bytes=64, version=version)
    return log, bound.metrics()


def _schedule(rank: int, world: int, steps: int, lag: int, max_staleness: int):
    model = _tiny_model()
    if rank == 1:
        return _rollout(model, steps=steps, lag=lag)
    return _trainer(model, steps=steps, lag=lag, max_staleness=max_staleness)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_each_batch_carries_the_version_of_the_schedule(lag):
    steps = 6
    (log, metrics), sent = run_distributed(_schedule, 2, steps, lag, lag, timeout=120)
    assert sent == steps and [entry[0] for entry in log] == list(range(steps))
    for step, sample_version, trainer_version, accepted, offset, token in log:
        assert sample_version == max(0, step - lag), (step, sample_version)
        assert trainer_version == step and accepted and token == step
        assert offset == pytest.approx(sample_version)  # the weights that sampled it were that version's
        assert trainer_version - sample_version <= lag
    assert metrics["staleness/run_max"] == lag and metrics["staleness/rejected"] == 0
    assert metrics["staleness/accepted"] == steps


def _never_updated_rollout(rank: int, world: int, max_staleness: int):
    """A rollout rank that never gets new weights: every batch is version 0, and the trainer outruns it."""
    if rank == 1:
        sender = SampleSender(timeout_s=60)
        for s in range(5):
            sender.send_samples({"tokens": torch.arange(3) + s}, dst=0, version=0, step=s)
        sender.close(0)
        return None
    receiver, bound, version, trained = SampleReceiver(timeout_s=60), StalenessBound(max_staleness), 0, []
    for _, sample_version, step in receiver.batches(src=1):
        if bound.admit(version, sample_version):
            trained.append(step)
            version += 1
    return trained, {**bound.metrics(), "last": bound.last}


def test_a_batch_older_than_the_bound_is_rejected_and_counted():
    (trained, metrics), _ = run_distributed(_never_updated_rollout, 2, 1, timeout=120)
    assert trained == [0, 1]  # staleness 0 and 1; then 2, 2, 2 are over the bound
    assert metrics["staleness/rejected"] == 3 and metrics["staleness/accepted"] == 2
    assert metrics["staleness/run_max"] == 1 and metrics["last"] == 2


def test_the_staleness_bound_refuses_a_batch_from_the_future():
    bound = StalenessBound(2)
    assert bound.admit(5, 3) and not bound.admit(6, 3)
    with pytest.raises(ValueError, match="version 7 reached the trainer at version 5"):
        bound.admit(5, 7)
    with pytest.raises(ValueError):
        StalenessBound(-1)


def test_a_payload_weights_only_cannot_load_is_refused_by_the_sender():
    sender = SampleSender()
    with pytest.raises(TypeError, match="'meta'.*Linear"):
        sender.send_samples({"tokens": torch.zeros(2), "meta": {"model": nn.Linear(1, 1)}}, dst=1, version=0, step=0)


# ---- shutdown ----


def _shutdown_in_flight(rank: int, world: int):
    if rank == 1:
        sender = SampleSender(timeout_s=30)
        for s in range(2):
            sender.send_samples({"tokens": torch.ones(4, 4) * s, "step": s}, dst=0, version=s, step=s)
        pending = sender.pending  # the trainer has read nothing yet
        sender.close(0)
        return pending, sender.pending
    time.sleep(0.5)  # the batches are in flight before the trainer decides to stop
    receiver = SampleReceiver(timeout_s=30)
    dropped = receiver.drain(src=1)
    try:
        receiver.recv_samples(src=1)
    except ChannelClosed:
        return dropped, "closed"
    return dropped, "open"


def test_shutdown_with_batches_in_flight_ends_through_the_sentinel():
    (dropped, state), (pending_before, pending_after) = run_distributed(_shutdown_in_flight, 2, timeout=60)
    assert dropped == 2 and state == "closed"
    assert pending_before > 0 and pending_after == 0


# ---- a crashed peer: an error naming it, in bounded time ----

PG_TIMEOUT_S = 20.0
WAIT_S = 15.0


def _crash_channel(rank: int):
    if rank == 1:
        sender = SampleSender(timeout_s=WAIT_S)
        sender.send_samples({"tokens": torch.zeros(3)}, dst=0, version=0, step=0)
        sender.flush()
        dist.barrier()  # the first batch was received: a flushed send is only handed to the transport
        os._exit(17)  # dies in the middle of the run, the second batch never sent
    receiver = SampleReceiver(timeout_s=WAIT_S)
    receiver.recv_samples(src=1)
    dist.barrier()
    start = time.monotonic()
    try:
        receiver.recv_samples(src=1)
    except ChannelError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def _crash_broadcast(rank: int):
    if rank == 0:

        def dying():
            for i, item in enumerate(_stream()):
                if i == 3:
                    os._exit(17)  # the trainer dies in the middle of the push
                yield item

        broadcast_weights(dying(), group=None, src=0, bucket_bytes=64, version=1)
    start = time.monotonic()
    try:
        with broadcast_weights(None, group=None, src=0, bucket_bytes=64, version=-1) as stream:
            list(stream)
    except WeightBroadcastError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


SCENARIOS = {"channel": (_crash_channel, 0, 1), "broadcast": (_crash_broadcast, 1, 0)}  # fn, survivor, dead rank


def _crash_worker(rank: int, port: int, scenario: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=PG_TIMEOUT_S)
    )
    try:
        queue.put((rank, "ok", SCENARIOS[scenario][0](rank)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


@pytest.mark.faults
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_crashed_peer_is_named_in_bounded_time(scenario):
    ctx = forkserver.context()  # processes of their own: the test kills one
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_crash_worker, args=(r, port, scenario, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, status, result = queue.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    _, survivor, dead = SCENARIOS[scenario]
    assert (rank, status) == (survivor, "ok"), result
    message, elapsed = result
    assert f"rank {dead}" in message, message
    assert elapsed < PG_TIMEOUT_S + 10
    assert procs[dead].exitcode == 17


def _silent_peer(rank: int, world: int):
    if rank == 1:
        time.sleep(4.0)  # alive but sends nothing: a frozen rollout rank
        return None
    start = time.monotonic()
    try:
        SampleReceiver(timeout_s=2.0).recv_samples(src=1)
    except ChannelError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_a_silent_peer_is_named_when_the_wait_times_out():
    # the receiver gives up with its receive still posted: the group cannot serve another test
    (message, elapsed), _ = run_distributed(_silent_peer, 2, timeout=60, fresh=True)
    assert "rank 1" in message and "2s" in message, message
    assert elapsed < 30.0  # bounded by the 2 s wait, with room for a loaded machine


# ---- into a rollout engine: the stream goes straight into the native engine's sync_weights ----


def _into_native_engine(rank: int, world: int):
    import attrs

    from backends.distributed.sharded_state import full_state_dict
    from backends.models import TinyModelConfig, build_tiny_model
    from backends.rollout import native

    tiny = TinyModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=32
    )
    if rank == 0:
        trained = build_tiny_model(attrs.evolve(tiny, seed=11))
        bad = [
            (n, t.clone().fill_(float("nan")) if n.endswith("norm.weight") else t) for n, t in full_state_dict(trained)
        ]
        broadcast_weights(iter(bad), group=None, src=0, bucket_bytes=4096, version=1)  # refused by the engine
        stats = broadcast_weights(full_state_dict(trained), group=None, src=0, bucket_bytes=4096, version=2)
        return stats, {n: t.clone() for n, t in trained.state_dict().items()}
    rollout = native.build_native_rollout(build_tiny_model(tiny))
    before = {n: t.clone() for n, t in rollout.model.state_dict().items()}
    refused = None
    try:
        with broadcast_weights(None, group=None, src=0, bucket_bytes=4096, version=-1) as stream:
            native.sync_weights(rollout, stream)
    except ValueError as e:
        refused = str(e)
    unchanged = all(torch.equal(t, before[n]) for n, t in rollout.model.state_dict().items())
    with broadcast_weights(None, group=None, src=0, bucket_bytes=4096, version=-1) as stream:
        synced = native.sync_weights(rollout, stream)
    return refused, unchanged, stream.version, {n: t.clone() for n, t in synced.model.state_dict().items()}


def test_the_stream_feeds_the_native_engines_sync_weights():
    (stats, sent), (refused, unchanged, version, got) = run_distributed(_into_native_engine, 2, timeout=120)
    assert refused is not None and "NaN" in refused and unchanged  # refused, drained, the engine kept its weights
    assert version == 2 and stats.tensors < stats.names  # the tied embedding travelled once
    assert sorted(got) == sorted(sent)
    for name, tensor in got.items():
        assert _bitwise_equal(tensor, sent[name]), name
