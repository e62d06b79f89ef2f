"""Run under `torchrun --nproc-per-node 2`: mada_rl.py's LoRA update on one global batch, three ways, the results
written to a JSON file for tests/test_fsdp.py. Three adapters on one frozen base, the second one active:

- reference: one unsharded copy takes the whole batch (every rank computes it alone, no collective);
- FSDP2 (`shard_models`: base and adapters sharded per decoder layer) and plain data parallel (all_reduce_grads):
  each rank takes its half of the groups, the loss normalisers summed over ranks, as the trainer does.

Two optimizer steps (two PPO epochs, clipping active), then the gathered weights are compared with the reference's
(the inactive adapters and the base must not move), and each rank generates greedily from the sharded model with
two different adapters active.

Run by tests/fsdp_update_check.py (`... fsdp_update_check.py grpo,mada_rl MODEL_DIR OUT.json`), in the same launch
as the other trainers' checks.
"""

import copy
import os
import sys

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mada_rl  # noqa: E402
import mada_rl_agents  # noqa: E402
from common.data import encode_prompts, load_problems, render_prompt  # noqa: E402
from common.dist import all_reduce_grads, all_reduce_sum, full_weights, shard_models  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from common.rollout import HFEngine, batched_logprobs  # noqa: E402
from fsdp_update_check import update  # noqa: E402


def check(model_dir: str, rank: int, world: int) -> dict:
    """This rank's result."""
    args = tyro.cli(mada_rl.Args, args=["--model-name", model_dir, "--fsdp", "--num-prompts", "4", "--group-size", "4",
                                        "--micro-batch-size", "3", "--num-iterations", "2", "--max-new-tokens", "6",
                                        "--max-grad-norm", "0.05", "--learning-rate", "1e-4", "--lora-r", "4"])
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)  # the same adapters, batch and rewards on every rank
    policy = mada_rl.make_agents(load_model(model_dir), ["gen0", "gen1", "critic0"], args)
    with torch.no_grad():  # B != 0, so that lora_A gets gradients too
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    mada_rl_agents.use_adapter(policy, "gen1")
    problems = load_problems("testbed", "train", (3,), 0, 1)[:4]
    prompts = encode_prompts(tok, [render_prompt(p, tok) for p in problems])
    rollouts = HFEngine(policy, tok).generate(prompts, n=args.group_size, max_new_tokens=args.max_new_tokens)
    adv_PG = mada_rl.group_advantages(torch.randint(0, 3, (len(problems), args.group_size)).float(), 1e-6)[0]
    B = len(rollouts.texts)
    mine = torch.arange(B).view(world, -1)[rank]

    def run(model, rows, normalise, reduce=lambda m: None):
        mada_rl_agents.use_adapter(model, "gen1")
        batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                     prompt_len=rollouts.prompt_len, mask_BC=rollouts.completion_mask_BC, adv_B=adv_PG.flatten(),
                     old_logp_BC=batched_logprobs(model, rollouts, 1.0, args.micro_batch_size))
        opt = torch.optim.AdamW(mada_rl_agents.adapter_params(model, "gen1").values(), lr=args.learning_rate)
        return update(mada_rl, model, batch, rows, args, opt, normalise, reduce)

    plain = copy.deepcopy(policy)
    plain_norms = run(plain, torch.arange(B), lambda t: t)
    (model,) = shard_models(args, copy.deepcopy(policy))
    fsdp_norms = run(model, mine, all_reduce_sum)
    dp = copy.deepcopy(policy)
    run(dp, mine, all_reduce_sum, all_reduce_grads)

    want, start = plain.state_dict(), policy.state_dict()
    diffs = {name: (full - want[name]).abs().max().item() for name, full in full_weights(model)}
    moved = {name: (want[name] - start[name]).abs().max().item() for name in want}
    texts_equal = []
    for name in ("gen1", "gen0"):  # generation from the sharded model: each rank its own prompts, greedy
        mada_rl_agents.use_adapter(model, name)
        mada_rl_agents.use_adapter(plain, name)
        own = prompts[rank::world]
        texts_equal.append(HFEngine(model, tok).generate(own, max_new_tokens=8, greedy=True).texts
                           == HFEngine(plain, tok).generate(own, max_new_tokens=8, greedy=True).texts)
    result = {"max_weight_diff": max(diffs.values()),
              "moved_gen1": max(v for k, v in moved.items() if ".gen1." in k),
              "moved_other": max(v for k, v in moved.items() if ".gen1." not in k),
              "plain_grad_norms": plain_norms, "fsdp_grad_norms": fsdp_norms, "texts_equal": texts_equal,
              "local_numel": sum(p.to_local().numel() for p in model.parameters()),
              "total_numel": sum(p.numel() for p in plain.parameters()),
              "dp_weight_diff": max((p - q).abs().max().item() for p, q in zip(dp.parameters(), plain.parameters()))}
    return result
