"""What bf16 changes in one GRPO step of the demo's model (issue 37, finding 13): measured on one batch, no training.

The demo (``preset=demo/arithmetic``: Qwen2, hidden 128, 2 layers) learned 3.8% -> 31.8% held-out in fp32 and
4.8% -> 10.2% in bf16 on one GPU in 600 steps. A GRPO step has three places where precision enters; this prints
each one for the four (trainer, rollout) precision pairs, on the same prompts and seed:

1. the samples: reward mean and the share of informative groups (groups whose samples got different rewards:
   GRPO's only signal), from the native engine in fp32 and in bf16;
2. the rollout / trainer log-prob gap per response token (what ``algo.rollout_is=token`` corrects): mean and max of
   ``|trainer - rollout|``, and the token-level IS weight's spread ``std(exp(trainer - rollout))``;
3. the update's direction: the policy gradient of the GRPO loss computed with bf16 weights against the fp32 one
   (cosine, relative error), next to the cosine between the fp32 gradients of two independent batches (the
   sampling noise every step has anyway). bf16 here is what FSDP2's mixed precision does: the forward and backward
   run on a bf16 copy of the fp32 weights, log-probs are taken in fp32 from bf16 logits. A third trainer, a bf16
   body under an fp32 LM head, shows how much of the gap the output layer's rounding makes.

    python benchmarks/bench_precision_gap.py --model runs/<demo run>/sft_model --data runs/data/arithmetic/train.jsonl
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import rlfunc as rf  # noqa: E402
from backends.data import DataConfig, load_examples  # noqa: E402
from backends.models import load_causal_lm  # noqa: E402
from backends.rewards import RewardConfig, RewardScorer  # noqa: E402
from backends.rollout.common import SamplingConfig, answer_texts  # noqa: E402
from backends.rollout.native import build_native_rollout, generate  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample(path, tok, examples, dtype, seed, n, max_new_tokens, scorer):
    rollout = build_native_rollout(path, tok, dtype=dtype)
    sampling = SamplingConfig(n=n, max_new_tokens=max_new_tokens)
    batch = generate(rollout, [list(e.prompt_ids) for e in examples], sampling, seed=seed)
    rows = [examples[g] for g in batch.group_ids.tolist()]
    scores = scorer.score(answer_texts(tok, batch), rows).scores
    adv, _ = rf.ADVANTAGE_ESTIMATORS["grpo"](scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
    return batch.replace(scores=scores, advantages=adv)


def response_logits(model, batch, head=None) -> torch.Tensor:
    """The logits that predict each response token; ``head``: an fp32 output layer applied to the model's last hidden
    states instead of its own (a bf16 body with an fp32 LM head)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    p = batch.prompt_ids.shape[1]
    if head is None:
        return model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits[:, p - 1 : -1]
    hidden = model.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).last_hidden_state
    return head(hidden[:, p - 1 : -1].float())


def trainer_logprobs(model, batch, head=None) -> torch.Tensor:
    """Log-probs of the response tokens (fp32, from the model's logits in its dtype), as the trainer takes them."""
    return rf.logprobs_from_logits(response_logits(model, batch, head), batch.response_ids)


def policy_gradient(model, batch, *, is_cap: float | None = None) -> torch.Tensor:
    """The flattened gradient (fp32) of GRPO's token-mean policy-gradient loss at ratio 1; ``is_cap``: with the
    truncated token-level importance weights ``min(exp(trainer - rollout), cap)`` of ``algo.rollout_is=token``."""
    model.zero_grad(set_to_none=True)
    logp = trainer_logprobs(model, batch)
    mask = batch.response_mask
    weights = 1.0 if is_cap is None else torch.exp(logp.detach() - batch.rollout_logprobs).clamp(max=is_cap)
    loss = -(weights * batch.advantages * logp * mask).sum() / mask.sum()
    loss.backward()
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF dir: the demo's SFT model (runs/<run>/sft_model)")
    ap.add_argument("--data", default="runs/data/arithmetic/train.jsonl")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model32, tok = load_causal_lm(args.model, dtype=torch.float32)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)  # FSDP2 mixed precision: a bf16 copy runs the compute
    examples, _ = load_examples([args.data], DataConfig(max_prompt_length=16), tok)
    scorer = RewardScorer(RewardConfig(fn=("arithmetic",), workers=0))
    trainers = {"fp32": (model32, None), "bf16": (model16, None), "bf16 + fp32 LM head": (model16, model32.lm_head)}
    batches = {}
    for rollout in DTYPES:
        batch = sample(
            args.model, tok, examples[: args.prompts], DTYPES[rollout], args.seed, args.n, args.max_new_tokens, scorer
        )
        batches[rollout] = batch
        informative = rf.informative_groups(batch.scores, group_ids=batch.group_ids).float().mean()
        print(
            f"rollout {rollout}: reward mean {float(batch.scores.mean()):.4f}, "
            f"informative groups {float(informative):.3f}, response tokens {int(batch.response_mask.sum())}"
        )
        with torch.no_grad():
            logits = response_logits(model32, batch)[batch.response_mask]
        print(
            f"  fp32 logits at the response tokens: max |logit| {float(logits.abs().max()):.1f}, mean top-1 minus "
            f"top-2 {float((logits.topk(2).values[:, 0] - logits.topk(2).values[:, 1]).mean()):.2f}"
        )
        for trainer, (model, head) in trainers.items():
            with torch.no_grad():
                logp = trainer_logprobs(model, batch, head)
            mask = batch.response_mask
            gap = (logp - batch.rollout_logprobs).abs()[mask]
            weights = torch.exp(logp - batch.rollout_logprobs)[mask]
            print(
                f"  trainer {trainer} / rollout {rollout}: log-prob gap per token mean {float(gap.mean()):.5f} "
                f"max {float(gap.max()):.4f}; IS weight std {float(weights.std()):.5f}"
            )
    batch = batches["fp32"]
    g32, g16 = policy_gradient(model32, batch), policy_gradient(model16, batch)
    other = sample(
        args.model,
        tok,
        examples[args.prompts : 2 * args.prompts],
        torch.float32,
        args.seed + 1,
        args.n,
        args.max_new_tokens,
        scorer,
    )
    g_other = policy_gradient(model32, other)
    print(
        f"gradient, same fp32 batch: cos(bf16, fp32) {cosine(g16, g32):.4f}, |bf16 - fp32| / |fp32| "
        f"{float((g16 - g32).norm() / g32.norm()):.4f}, |bf16| / |fp32| {float(g16.norm() / g32.norm()):.4f}"
    )
    print(
        f"gradient, two independent fp32 batches ({args.prompts} prompts x {args.n} each): "
        f"cos {cosine(g_other, g32):.4f}"
    )
    g16_is = policy_gradient(model16, batch, is_cap=2.0)
    print(
        f"gradient, bf16 trainer on the fp32 rollout's batch with algo.rollout_is=token (cap 2) vs without: "
        f"cos {cosine(g16_is, g16):.4f}; with it vs the fp32 gradient: cos {cosine(g16_is, g32):.4f}"
    )


if __name__ == "__main__":
    main()
