"""MADA-RL on the testbed: single generator, generator majority vote, debate with counterfactual critics and
debate with no-counterfactual critics (the ablation), per seed; the critics' accuracy by acc_G bucket;
trainable parameters against full fine-tuning. Writes benchmarks/testbed/mada_rl_benchmark.md.

For each seed the generators are trained once (Stage 1), the critic data is built once from them
(Stage 2), and two sets of critics are trained on the same data and splits (Stage 3): with A_C = R_C - 2 acc_G
and with the GRPO group z-score of R_C. Both debates therefore share round 1 and differ only in the critics.

    python -m benchmarks.testbed.mada_rl_benchmark            # seeds 1 2, the mada_rl.py defaults
    python -m benchmarks.testbed.mada_rl_benchmark --seeds 1 2 --generator-steps 40 --critic-steps 40
    python -m benchmarks.testbed.mada_rl_benchmark --seeds 1 --only-run &
    python -m benchmarks.testbed.mada_rl_benchmark --seeds 2 --only-run
    python -m benchmarks.testbed.mada_rl_benchmark --seeds 1 2 --merge  # the report from the two runs above
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

import mada_rl
import mada_rl_agents
from common.data import load_problems
from common.logger import RunLogger
from common.models import load_model, load_tokenizer
from common.rollout import make_engine
from grounds import path_of

HERE = os.path.dirname(os.path.abspath(__file__))


def run_seed(args: mada_rl.Args, out_dir: str) -> dict:
    torch.manual_seed(args.seed)
    args.batch_size = args.num_prompts * args.group_size
    args.minibatch_size = args.batch_size // args.num_minibatches
    tokenizer = load_tokenizer(path_of(args.model_name))
    train = load_problems(args.dataset, "train", args.levels, args.num_train_problems, args.seed)
    heldout = load_problems(args.dataset, "test", args.levels, args.num_eval_problems, args.seed)
    gens, critics = mada_rl.agent_names(args.num_generators, args.num_critics)
    ablated = [f"nocf_{c}" for c in critics]
    splits = mada_rl.split_problems(train, args.num_generators + args.num_critics, args.seed)
    base = load_model(path_of(args.model_name), args.dtype, args.device)
    base_params = sum(p.numel() for p in base.parameters())
    model = mada_rl.make_agents(base, gens + critics + ablated, args)
    per_agent = sum(p.numel() for p in mada_rl_agents.adapter_params(model, gens[0]).values())
    engine = make_engine(args, model, tokenizer, args.seed)
    logger = RunLogger(args, os.path.join(out_dir, f"seed{args.seed}"))

    def metrics(critic_set):
        answers, cut = mada_rl.debate(model, engine, tokenizer, heldout, gens, critic_set, args.debate_rounds,
                                      args.max_new_tokens, args.max_prompt_tokens, args.critic_sees,
                                      args.proposal_tokens)
        return mada_rl_agents.debate_metrics(answers, heldout, len(gens), cut)

    t0 = time.time()
    res = {"base": metrics(critics)}
    step = 0
    for n, g in enumerate(gens):
        step = mada_rl.train_agent(model, engine, tokenizer, g, splits[n], args, logger, step, 1, n)
    res["generators"] = metrics(critics)  # trained generators, untrained critics (= the base model)
    acc_g = []
    for m, (c, c_ab) in enumerate(zip(critics, ablated)):
        records = mada_rl.critic_records(model, engine, tokenizer, splits[len(gens) + m], gens, args)
        acc_g += [r[2] for r in records]
        step = mada_rl.train_agent(model, engine, tokenizer, c, records, dataclasses.replace(args, counterfactual=True),
                                   logger, step, 3, m)
        step = mada_rl.train_agent(model, engine, tokenizer, c_ab, records,
                                   dataclasses.replace(args, counterfactual=False), logger, step, 3, m)
    res["counterfactual"] = metrics(critics)
    res["no_counterfactual"] = metrics(ablated)
    logger.close(plot=False)
    acc_g = np.round(np.array(acc_g) * len(gens)).astype(int)
    res["critic_data_buckets"] = [float((acc_g == k).mean()) for k in range(len(gens) + 1)]
    res["params"] = {"per_agent": per_agent, "base": base_params}
    res["time_s"] = time.time() - t0
    print(f"seed {args.seed}: " + ", ".join(f"{k} {v['mada/eval/debate_accuracy']:.3f}" for k, v in res.items()
                                          if isinstance(v, dict) and "mada/eval/debate_accuracy" in v), flush=True)
    return res


def paper_scale_params(r: int = 16) -> tuple[int, int]:
    """LoRA (rank r, all 7 projections) vs full parameters of a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2,
    built on the meta device (no weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        m = Qwen2ForCausalLM(cfg)
    full = sum(p.numel() for p in m.parameters())
    m = get_peft_model(m, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(mada_rl.Args().lora_target_modules)))
    return sum(p.numel() for n, p in m.named_parameters() if "lora_" in n), full


def fmt(xs) -> str:
    xs = np.array(xs, dtype=float)
    return f"{xs.mean():.3f} ± {xs.std():.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def write_md(results: dict, args: mada_rl.Args, cmd: str, path: str) -> None:
    seeds = sorted(results)
    N = args.num_generators
    acc = lambda var, k: [results[s][var][f"mada/eval/{k}"] for s in seeds]  # noqa: E731
    lines = [
        "# MADA-RL benchmark (testbed)", "",
        f"Command: `{cmd}`", "",
        f"Setup: `{args.model_name}`, level(s) {list(args.levels)}, {N} generators + {args.num_critics} critics "
        f"(LoRA r={args.lora_r}, alpha={args.lora_alpha}), {args.generator_steps} GRPO steps per generator and "
        f"{args.critic_steps} steps per critic of {args.num_prompts} prompts x {args.group_size} samples, "
        f"lr {args.learning_rate}, {args.num_train_problems} training problems split {N + args.num_critics} ways, "
        f"{args.debate_rounds}-round debate, {args.num_eval_problems} held-out problems, greedy answers. "
        f"Seeds {seeds}; figures are mean ± std over seeds (population std), per-seed values below.", "",
        "## Held-out accuracy", "",
        "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std |", "|---|" + "---|" * (len(seeds) + 1),
    ]
    rows = [("base model, single agent", "base", "single_accuracy"),
            ("single generator (mean of the N)", "generators", "single_accuracy"),
            ("generator majority vote", "generators", "majority_accuracy"),
            ("debate, untrained critics (base as critic)", "generators", "debate_accuracy"),
            ("debate, counterfactual critics (A_C = R_C - 2 acc_G)", "counterfactual", "debate_accuracy"),
            ("debate, no-counterfactual critics (GRPO on R_C)", "no_counterfactual", "debate_accuracy"),
            ("debate majority, counterfactual critics", "counterfactual", "debate_majority_accuracy"),
            ("debate majority, no-counterfactual critics", "no_counterfactual", "debate_majority_accuracy")]
    for label, var, key in rows:
        xs = acc(var, key)
        lines.append(f"| {label} | " + " | ".join(f"{x:.3f}" for x in xs) + f" | {fmt(xs)} |")
    d_maj = [a - b for a, b in zip(acc("counterfactual", "debate_accuracy"), acc("generators", "majority_accuracy"))]
    d_cf = [a - b for a, b in zip(acc("counterfactual", "debate_accuracy"), acc("no_counterfactual", "debate_accuracy"))]
    lines += ["", f"Debate (counterfactual) minus generator majority vote: {fmt(d_maj)} "
              f"(per seed {', '.join(f'{x:+.3f}' for x in d_maj)}).",
              f"Counterfactual minus no-counterfactual debate: {fmt(d_cf)} "
              f"(per seed {', '.join(f'{x:+.3f}' for x in d_cf)}).", "",
              "## Critics by generator agreement (held-out, round-1 acc_G bucket)", "",
              "Critic accuracy (mean over critics, final round) among held-out problems where k of the N generators "
              "were right; the fraction of problems in each bucket is the same for both critic sets (shared round 1). "
              "Improvement rate: among problems whose generator majority is wrong, the fraction of final critic "
              "answers that are right; break rate: among problems whose majority is right, the fraction wrong.", "",
              "| acc_G | share of problems | counterfactual critics | no-counterfactual critics |", "|---|---|---|---|"]
    for k in range(N + 1):
        key = f"acc_g_{k}of{N}"
        share = [results[s]["counterfactual"][f"mada/eval/frac/{key}"] for s in seeds]
        cells = []
        for var in ("counterfactual", "no_counterfactual"):
            xs = [results[s][var].get(f"mada/eval/debate_accuracy/{key}") for s in seeds]
            xs = [x for x in xs if x is not None]
            cells.append(fmt(xs) if xs else "n/a")
        lines.append(f"| {k}/{N} | {fmt(share)} | {cells[0]} | {cells[1]} |")
    for label, key in (("improvement rate", "improvement_rate"), ("break rate", "break_rate")):
        lines.append(f"| {label} | | {fmt(acc('counterfactual', key))} | {fmt(acc('no_counterfactual', key))} |")
    buckets = np.array([results[s]["critic_data_buckets"] for s in seeds]).mean(0)
    lines += ["", f"Critic training data (Stage 2, generators sampled at T={args.proposal_temperature}): share of "
              "problems with acc_G = " + ", ".join(f"{k}/{N}: {b:.2f}" for k, b in enumerate(buckets)) + ".", ""]
    p = results[seeds[0]]["params"]
    lora_p, full_p = paper_scale_params()
    lines += ["## Trainable parameters", "",
              "| model | LoRA per agent | LoRA, all agents | full fine-tuning (one model) |", "|---|---|---|---|",
              f"| testbed ({args.model_name}, r={args.lora_r}) | {p['per_agent']:,} | "
              f"{p['per_agent'] * (N + args.num_critics):,} | {p['base']:,} |",
              f"| Qwen2 1.5B shape (R1-Distill-Qwen-1.5B, r=16, built on the meta device) | {lora_p:,} | "
              f"{lora_p * 6:,} | {full_p:,} |", "",
              "Wall time per seed (both critic sets, on the shared 2-core CPU): " + ", ".join(f"{results[s]['time_s']:.0f} s" for s in seeds) + ".", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--generator-steps", type=int, default=mada_rl.Args.generator_steps)
    ap.add_argument("--critic-steps", type=int, default=mada_rl.Args.critic_steps)
    ap.add_argument("--num-eval-problems", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "mada_benchmark.md"))
    ap.add_argument("--run-dir", default="runs/mada_benchmark")
    ap.add_argument("--only-run", action="store_true", help="run the seeds and save <run-dir>/seed<N>.json only")
    ap.add_argument("--merge", action="store_true", help="write the report from saved <run-dir>/seed<N>.json")
    a = ap.parse_args()
    results = {}
    for seed in a.seeds:
        args = mada_rl.Args(seed=seed, generator_steps=a.generator_steps, critic_steps=a.critic_steps,
                            num_eval_problems=a.num_eval_problems, exp_name="mada_benchmark")
        path = os.path.join(a.run_dir, f"seed{seed}.json")
        if a.merge:  # seeds run as separate processes (--only-run): collect their results
            with open(path) as f:
                results[seed] = json.load(f)
            continue
        results[seed] = run_seed(args, a.run_dir)
        os.makedirs(a.run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(results[seed], f)
    if a.only_run:
        return
    write_md(results, args, "python -m benchmarks.testbed.mada_rl_benchmark " + " ".join(sys.argv[1:]), a.out)
    print(open(a.out).read())


if __name__ == "__main__":
    main()
