"""Write tests/golden/advantages.safetensors: inputs and verl 0.9.1's advantage estimators' outputs.

Run with the verl venv (tests never import verl):

    /work/peer-verl/bin/python tests/golden/make_advantages_golden.py

Keys are ``<case>/<tensor>``. Inputs use small shapes, right padding plus holes inside some responses
(multi-turn observation tokens), a fully masked row, non-contiguous group ids (negative ones for verl's
dict-based estimators; its vectorised ones index by id, so they get non-negative ids), a group of one,
and ties. Outcome scores are placed on each response's last valid token, so ``token_level_rewards.sum(-1)``
is the per-sequence score rlfunc takes.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from safetensors.torch import save_file
from verl.trainer.ppo import core_algos as ca

OUT = pathlib.Path(__file__).with_name("advantages.safetensors")
B, T = 16, 24


def make_mask(gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T  # one full row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[1] = False  # one empty row
    mask[2] = torch.arange(T) < 15
    mask[2, 3:7] = False  # holes: observation tokens inside a response
    mask[3, 0] = False
    mask[4] = torch.arange(T) < 20
    mask[4, 5:6] = False
    mask[4, 10:12] = False
    return mask


def outcome_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    last = mask & (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True))
    rewards = torch.zeros(B, T)
    rewards[last] = scores[mask.any(dim=1)]
    return rewards


def main() -> None:
    gen = torch.Generator().manual_seed(1234)
    out: dict[str, torch.Tensor] = {}
    mask = make_mask(gen)
    maskf = mask.float()

    # --- token level -------------------------------------------------------------------------------
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    out["token/rewards"] = rewards
    out["token/values"] = values
    out["token/mask"] = mask
    for k, (gamma, lam) in enumerate([(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.7, 0.6)]):
        adv, ret = ca.compute_gae_advantage_return(rewards, values, maskf, gamma, lam)
        out[f"gae{k}/gamma_lam"] = torch.tensor([gamma, lam])
        out[f"gae{k}/advantages_whitened"] = adv
        out[f"gae{k}/returns"] = ret
    for k, gamma in enumerate([1.0, 0.9]):
        cfg = OmegaConf.create({"gamma": gamma})
        adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards * maskf, maskf, config=cfg)
        out[f"rpp{k}/gamma"] = torch.tensor([gamma])
        out[f"rpp{k}/advantages_whitened"] = adv
        out[f"rpp{k}/returns"] = ret

    # --- outcome ------------------------------------------------------------------------------------
    # Row 1 is empty; its score still counts in its group (verl sums token rewards: 0 there).
    ids_loop = np.array([7, 7, 7, -3, -3, -3, -3, 1000, 1000, 5, 42, 42, 7, -3, 1000, 1000], dtype=np.int64)
    ids_vec = np.array([7, 7, 7, 3, 3, 3, 3, 1000, 1000, 5, 42, 42, 7, 3, 1000, 1000], dtype=np.int64)
    scores = torch.randn(B, generator=gen)
    scores[10] = scores[11]  # a group with zero std
    scores[7] = 0.0  # zeros for GPG's alpha
    rewards_o = outcome_rewards(scores, mask)
    scores_eff = rewards_o.sum(dim=-1)
    out["outcome/scores"] = scores_eff
    out["outcome/ids_loop"] = torch.from_numpy(ids_loop)
    out["outcome/ids_vec"] = torch.from_numpy(ids_vec)
    cfg = OmegaConf.create({"gamma": 1.0, "norm_adv_by_std_in_grpo": True})

    def put(name: str, result: tuple[torch.Tensor, torch.Tensor]) -> None:
        out[f"{name}/advantages"], out[f"{name}/returns"] = result[0].clone(), result[1].clone()

    put("grpo", ca.compute_grpo_outcome_advantage(rewards_o, maskf, ids_loop))
    put("drgrpo", ca.compute_grpo_outcome_advantage(rewards_o, maskf, ids_loop, norm_adv_by_std_in_grpo=False))
    put("grpo_vectorized", ca.compute_grpo_vectorized_outcome_advantage(rewards_o, maskf, ids_vec))
    put("rloo", ca.compute_rloo_outcome_advantage(rewards_o, maskf, ids_loop))
    put("rloo_vectorized", ca.compute_rloo_vectorized_outcome_advantage(rewards_o, maskf, ids_vec))
    put("opo", ca.compute_opo_outcome_advantage(rewards_o, maskf, ids_loop))
    put("gpg", ca.compute_gpg_outcome_advantage(rewards_o, maskf, ids_loop))
    put("rppb_whitened", ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards_o, maskf, ids_loop))
    baselines = torch.randn(B, generator=gen)
    out["remax/baselines"] = baselines
    put("remax", ca.compute_remax_outcome_advantage(rewards_o, baselines, maskf, config=cfg))

    # Pass@k: every group has >= 2 responses; binary-ish scores with ties at the top.
    ids_passk = np.array([7, 7, 7, -3, -3, -3, -3, 1000, 1000, 5, 42, 42, 7, -3, 5, 1000], dtype=np.int64)
    scores_passk = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.75, 0.3, 0.2])
    rewards_p = outcome_rewards(scores_passk, mask)
    out["passk/scores"] = rewards_p.sum(dim=-1)
    out["passk/ids"] = torch.from_numpy(ids_passk)
    put("passk", ca.compute_grpo_passk_outcome_advantage(rewards_p, maskf, ids_passk, config=cfg))
    cfg_nostd = OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    put("passk_nostd", ca.compute_grpo_passk_outcome_advantage(rewards_p, maskf, ids_passk, config=cfg_nostd))

    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, str(OUT), metadata={"verl_version": verl.__version__, "torch_version": torch.__version__})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} tensors, verl {verl.__version__})")


if __name__ == "__main__":
    main()
