"""Generate tests/golden/importance.safetensors from verl 0.9.1 (run with the verl venv):

    /work/peer-verl/bin/python tests/golden/make_importance_golden.py

Contents (fp32, tiny): ``is/trainer_logprobs``, ``is/rollout_logprobs`` (b t), ``is/mask`` (b t, bool) and,
for each case ``<level>/<threshold>`` of verl's ``rollout_corr_helper.compute_rollout_correction_weights``
(``log_ratio = trainer - rollout``, no batch normalisation), the weights ``is/<level>/<threshold>``. The
inputs include log-ratios beyond verl's safety bound of 20 and NaN-free padding with large values.
"""

from __future__ import annotations

import pathlib

import torch
import verl
from safetensors.torch import save_file
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

OUT = pathlib.Path(__file__).with_name("importance.safetensors")
CASES = [
    ("token", "2.0"),
    ("token", "1.2"),
    ("sequence", "2.0"),
    ("sequence", "5.0"),
    ("token", "0.8_1.25"),
    ("sequence", "0.5_2.0"),
]


def main() -> None:
    g = torch.Generator().manual_seed(4321)
    b, t = 6, 9
    rollout = -torch.rand(b, t, generator=g) * 3.0
    trainer = rollout + torch.randn(b, t, generator=g) * 0.3
    trainer[0, 0], rollout[0, 0] = -1.0, -30.0  # log ratio 29: beyond the safety bound
    trainer[0, 1], rollout[0, 1] = -30.0, -1.0
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0, :3] = True
    mask[5] = False  # an empty row
    trainer = torch.where(mask, trainer, torch.full_like(trainer, -50.0))  # padding junk must not matter
    out = {"is/trainer_logprobs": trainer, "is/rollout_logprobs": rollout, "is/mask": mask}
    for level, threshold in CASES:
        weights, _ = compute_rollout_correction_weights(
            trainer - rollout, mask.float(), rollout_is=level, rollout_is_threshold=threshold
        )
        out[f"is/{level}/{threshold}"] = weights
    out = {k: v.detach().clone().contiguous() for k, v in out.items()}
    save_file(
        out, str(OUT), metadata={"generator": f"tests/golden/make_importance_golden.py with verl {verl.__version__}"}
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} tensors)")


if __name__ == "__main__":
    main()
