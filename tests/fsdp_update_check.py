"""Run under `torchrun --nproc-per-node 2`: the same global rollout batch updated two ways, and the results written
to a JSON file for tests/test_fsdp.py.

- reference: one unsharded copy of the model takes the whole batch (every rank computes it alone, no collective);
- FSDP2: `shard_models` wraps the policy (and the reference model), each rank takes its half of the groups, with
  the loss normalisers summed over ranks, as the trainer does.

Two optimizer steps (two PPO epochs over the batch, clipping active), then the sharded weights are gathered and
compared with the reference's (and those of the plain data-parallel path with small all-reduce buckets), and
each rank generates greedily from the sharded model (its own prompts, its own
lengths) and from the reference.

    torchrun --nproc-per-node 2 tests/fsdp_update_check.py grpo,rloo_sec MODEL_DIR OUT.json

Several trainers (comma-separated; mada_rl by tests/fsdp_mada_check.py) are checked one after another in one
launch (one process group, one start-up); OUT.json maps each trainer to the list of its ranks' results.
"""

import copy
import importlib
import json
import os
import sys

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.data import encode_prompts, load_problems, render_prompt  # noqa: E402
from common.dist import all_reduce_grads, all_reduce_sum, full_weights, init_distributed, shard_models  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from common.rollout import HFEngine, batched_logprobs, split_completions  # noqa: E402


def update(module, model, batch, rows, args, optimizer, normalise, reduce=lambda model: None) -> list[float]:
    """args.num_iterations optimizer steps on `rows` (one mini-batch), micro-batched; the trainer's loss."""
    grad_norms = []
    for _ in range(args.num_iterations):
        mask_BC = batch["mask_BC"][rows]
        # the trainer's mini-batch normalisers (its minibatch_counts): tokens, non-empty sequences, sequences
        counts = tuple(v.item() for v in normalise(torch.tensor(
            [mask_BC.sum().item(), float((mask_BC.sum(1) > 0).sum()), float(len(rows))])))
        optimizer.zero_grad(set_to_none=True)
        for micro in rows.split(args.micro_batch_size):
            loss, _ = module.micro_batch_loss(model, batch, micro, args, counts)
            loss.backward()
        reduce(model)
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item())
        optimizer.step()
    return grad_norms


def oc_grpo_weights(module, model, batch, rows, guided, args, pad_id):
    """oc_grpo.py: the context-shift weight of the `guided` rows on `model` (its hint passes), and the weighted
    advantage adv_BC its loss takes, put into the batch."""
    w_BC = torch.ones_like(batch["mask_BC"])
    w_BC[guided] = module.hint_weights(model, batch["old_logp_BC"], rows, guided, w_BC.shape[1], args, pad_id)[0]
    batch["adv_BC"] = batch["adv_B"].unsqueeze(1) * w_BC
    return w_BC


def select_kps(module, model, tok, problems, rank, sharded):
    """adakp.py: greedy KP selection with the entropy proxy on `model` (2 contexts a forward), rank 0 for problem 0
    with budget 1, rank 1 for problems 1-3 with budget 2, every KP added (delta -1): the ranks run different
    numbers of rounds and proxy forwards."""
    pids, budget = ([0], 1) if rank == 0 else ([1, 2, 3], 2)

    def entropy_fn(requests):
        probs = [problems[pids[j]] for j, _ in requests]
        texts = [render_prompt(p, tok, hints=[p.hints[k] for k in S]) for p, (_, S) in zip(probs, requests)]
        contexts = encode_prompts(tok, texts) if texts else []
        probes = [module.probe_tokens(p, tok, 96) for p in probs]
        return module.probe_entropy(model, contexts, probes, tok.pad_token_id, len(tok), 50, 2)[:2]

    return module.greedy_select(entropy_fn, [len(problems[i].hints) for i in pids], [budget] * len(pids), -1.0,
                                sharded)


def gathered(result: dict, world: int) -> list:
    """Every rank's `result`, in rank order."""
    results = [None] * world
    torch.distributed.all_gather_object(results, result)
    return results


def check(trainer: str, model_dir: str, rank: int, world: int) -> dict:
    """This rank's result for one trainer (mada_rl: tests/fsdp_mada_check.py, its LoRA agents)."""
    if trainer == "mada_rl":
        from fsdp_mada_check import check as check_mada

        return check_mada(model_dir, rank, world)
    module = importlib.import_module(trainer)
    args = tyro.cli(module.Args, args=["--model-name", model_dir, "--fsdp", "--num-prompts", "4", "--group-size", "4",
                                       "--micro-batch-size", "3", "--num-iterations", "2", "--max-new-tokens", "6",
                                       "--beta", "0.05", "--max-grad-norm", "0.05", "--learning-rate", "1e-4"])
    tok = load_tokenizer(model_dir)
    policy = load_model(model_dir)
    problems = load_problems("testbed", "train", (3,), 0, 1)[:4]
    prompts = encode_prompts(tok, [render_prompt(p, tok) for p in problems])
    torch.manual_seed(0)  # the same global batch on every rank
    rollouts = HFEngine(policy, tok).generate(prompts, n=args.group_size, max_new_tokens=args.max_new_tokens)
    rewards_PG = torch.randint(0, 2, (len(problems), args.group_size)).float()
    adv_PG = (module.rloo_advantages(rewards_PG) if trainer == "rloo_sec"
              else module.group_advantages(rewards_PG, "group_std", 1e-6))[0]
    B = len(rollouts.texts)
    extra = {}

    def make_batch(model, ref):
        return dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                    prompt_len=rollouts.prompt_len, mask_BC=rollouts.completion_mask_BC, adv_B=adv_PG.flatten(),
                    sampler_logp_BC=None, old_logp_BC=batched_logprobs(model, rollouts, 1.0, args.micro_batch_size),
                    ref_logp_BC=batched_logprobs(ref, rollouts, 1.0, args.micro_batch_size))

    # reference: the whole batch on one unsharded model
    plain, plain_ref = copy.deepcopy(policy), copy.deepcopy(policy).requires_grad_(False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=args.learning_rate)
    plain_batch = make_batch(plain, plain_ref)
    if trainer == "oc_grpo":  # groups 1-3 guided: 4 guided rows on rank 0, 8 on rank 1 (uneven hint passes)
        G = args.group_size
        hint_ids = encode_prompts(tok, [module.render_guided_prompt(p, tok, module.solution_prefix(p.solution, 0.6))
                                        for p in problems])
        guide_rows = [(hint_ids[b // G] if b >= G else prompts[b // G], c, 0.0)
                      for b, c in enumerate(split_completions(rollouts))]
        plain_w_BC = oc_grpo_weights(module, plain, plain_batch, guide_rows, list(range(G, B)), args, tok.pad_token_id)
    if trainer == "adakp":  # its loss takes a per-token advantage (w = 1 without --correction); its KP selection:
        plain_batch["adv_BC"] = plain_batch["adv_B"].unsqueeze(1)  # rank 0 one problem, rank 1 three
        plain_kp = select_kps(module, plain, tok, problems, rank, None)
    plain_norms = update(module, plain, plain_batch, torch.arange(B), args, plain_opt, lambda t: t)

    # FSDP2: this rank's half of the groups; old and reference log-probs from the sharded models
    model, ref = shard_models(args, copy.deepcopy(policy), copy.deepcopy(policy).requires_grad_(False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    batch = make_batch(model, ref)
    mine = torch.arange(B).view(world, -1)[rank]
    all_reduce_grads(model)  # a no-op under FSDP (its backward reduce-scatters)
    if trainer == "oc_grpo":
        guided = [b for b in mine.tolist() if b >= G]
        w_BC = oc_grpo_weights(module, model, batch, guide_rows, guided, args, tok.pad_token_id)
        # the cascade with work on rank 1 only: rank 0 must generate as many times (each generation gathers layers)
        engine, calls = HFEngine(model, tok), []
        generate = engine.generate
        engine.generate = lambda *a, **k: calls.append(len(a[0])) or generate(*a, **k)
        module.guidance_cascade(engine, tok, problems, list(range(len(problems))) if rank else [], 2, args, model)
        extra = {"hint_rows": len(guided), "hint_weight_diff": (w_BC[mine] - plain_w_BC[mine]).abs().max().item(),
                 "hint_weight_min": w_BC[mine].min().item(), "cascade_generations": len(calls)}
    if trainer == "adakp":
        batch["adv_BC"] = batch["adv_B"].unsqueeze(1)
        kp = select_kps(module, model, tok, problems, rank, model)
        extra = {"kp_equal": kp[0] == plain_kp[0], "kp_gain_diff": max(
            [abs(a - b) for g, h in zip(kp[1], plain_kp[1]) for a, b in zip(g, h)], default=0.0),
            "kp_rounds": kp[3], "kp_chosen": sum(map(len, kp[0]))}
    fsdp_norms = update(module, model, batch, mine, args, optimizer, all_reduce_sum)

    # plain data parallel: every rank whole, gradients all-reduced in buckets of at most 64 KB (many buckets)
    dp = copy.deepcopy(policy)
    dp_opt = torch.optim.AdamW(dp.parameters(), lr=args.learning_rate)
    update(module, dp, batch, mine, args, dp_opt, all_reduce_sum, lambda m: all_reduce_grads(m, 2**16))
    dp_diff = max((p - q).abs().max().item() for p, q in zip(dp.parameters(), plain.parameters()))

    diffs = {name: (full - plain.state_dict()[name]).abs().max().item() for name, full in full_weights(model)}
    moved = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), policy.parameters()))
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    # generation from the sharded model: each rank its own prompt, greedy, against the reference
    own = prompts[rank::world]
    got = HFEngine(model, tok).generate(own, max_new_tokens=8, greedy=True).texts
    want = HFEngine(plain, tok).generate(own, max_new_tokens=8, greedy=True).texts
    result = {"max_weight_diff": max(diffs.values()), "moved": moved, "plain_grad_norms": plain_norms,
              "fsdp_grad_norms": fsdp_norms, "local_numel": local_numel,
              "total_numel": sum(p.numel() for p in plain.parameters()), "texts_equal": got == want,
              "bucketed_dp_weight_diff": dp_diff, **extra}
    return result


def main():
    trainers, model_dir, out_path = sys.argv[1:4]
    rank, world, _ = init_distributed("cpu")
    results = {trainer: gathered(check(trainer, model_dir, rank, world), world) for trainer in trainers.split(",")}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
