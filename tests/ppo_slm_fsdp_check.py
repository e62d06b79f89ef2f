"""Run under `torchrun --nproc-per-node 2` by tests/test_fsdp.py: ppo_slm.py's PPO twice in the same two
processes, with --fsdp and on the plain data-parallel path, on the same SFT adapter and reward model (trained by a
first run of no PPO step, passed by path to both) and the same seeds. In both runs an inf is written into one
trainable LoRA weight on rank 0 only (under --fsdp: into rank 0's shard) right after the update of step 2, so the
rollback, which must see it from every rank, restores the weights and the AdamW state (DTensor shards under
--fsdp). Rank 0 writes the runs' folders, their per-step metrics and, under --fsdp, how many of the policy's
parameters it held, to OUT.json.

    torchrun --nproc-per-node 2 tests/ppo_slm_fsdp_check.py MODEL_DIR OUTPUT_DIR OUT.json
"""

import json
import os
import sys

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppo_slm  # noqa: E402
from common.logger import read_metrics  # noqa: E402

TINY = ["--num-train-examples", "64", "--num-eval-pairs", "16", "--num-eval-prompts", "16", "--num-prompts", "8",
        "--minibatch-size", "4", "--max-new-tokens", "4", "--sft-steps", "3", "--sft-batch-size", "8",
        "--rm-steps", "3", "--rm-batch-size", "8", "--total-steps", "3", "--learning-rate", "1e-3"]


def main():
    model_dir, output_dir, out_path = sys.argv[1:4]
    calls, held = {"finite": 0}, {}
    all_finite, shard_models, local_part = ppo_slm.all_finite, ppo_slm.dist.shard_models, ppo_slm.local_part

    def finite_after_fault(params):  # called once per step, right after the update
        calls["finite"] += 1
        if calls["finite"] == 2 and int(os.environ["RANK"]) == 0:
            with torch.no_grad():
                local_part(next(p for n, p in params.items() if "lora_A" in n)).view(-1)[0] = float("inf")
        return all_finite(params)

    def shard_and_count(args, policy, *models):
        out = shard_models(args, policy, *models)
        held.update(local=sum(local_part(p).numel() for p in out[0].parameters()),
                    total=sum(p.numel() for p in out[0].parameters()))
        return out

    ppo_slm.all_finite, ppo_slm.dist.shard_models = finite_after_fault, shard_and_count
    run = lambda name, *flags: ppo_slm.main(tyro.cli(ppo_slm.Args, args=[  # noqa: E731
        "--model-name", model_dir, "--output-dir", output_dir, "--run-name", name, *TINY, *flags]))
    first = run("stages", "--total-steps", "0")  # SFT and RM (rank 0), then passed by path, so that both runs
    stages = ["--sft-adapter", first["sft_adapter"], "--reward-model", first["reward_model"]]  # draw the same numbers
    result = {}
    for name, flags in (("fsdp", ["--fsdp"]), ("plain", [])):
        calls["finite"] = 0
        out = run(name, *stages, *flags)
        rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
        result[name] = {k: out[k] for k in ("run_dir", "rollbacks")}
        result[name]["rows"] = rows
        if name == "fsdp":
            result[name]["held"] = dict(held)
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
