"""The GPU check: every trainer on one CUDA GPU, then grpo.py at 0.5B scale with and without FSDP2.

    python -m benchmarks.speed.gpu_check       # one CUDA GPU, about 5 minutes; writes benchmarks/speed/gpu_check.md
    python -m benchmarks.speed.gpu_check --dry-run  # the same commands on CPU at toy sizes (checks this script)
    python -m benchmarks.speed.gpu_check --only scale --size 1.5b --quick  # the memory comparison on a 1.5B body
    python -m benchmarks.speed.gpu_check --only recipe  # part 3: the bf16 recipe moves the weights; update memory
    python -m benchmarks.speed.gpu_check --only ppo_ratio  # part 4: ppo_slm.py's ratios in bfloat16 and float32

Part 1 runs each trainer's short configuration with `--device cuda` on the embedded testbed (the cached testbed
models; nothing is downloaded) and reports whether it finished, its last logged reward and held-out accuracy, and
peak GPU memory; then the same under torchrun (one rank, NCCL) with `--fsdp`. Part 2 runs grpo.py on a Qwen2 with
Qwen2.5-0.5B's body (hidden 896, 24 layers, 14 heads, random weights, the testbed's byte tokenizer, an eos it never
samples so every completion runs to the cap): 16 prompts x 8 samples x 128 new tokens, micro-batch 32, step time =
median of the steps after the first. Configurations: the plain path in bfloat16 with our sampling loop (`hf`) and with
`model.generate` (`hf_generate`), and `--fsdp` under torchrun with one rank (NCCL) with float32 master weights and
`--dtype bfloat16`. One GPU cannot show sharding's saving (docs/fsdp.md works it out per rank count); this checks that
the FSDP2 path runs on CUDA/NCCL and what it costs on one device. Part 4 runs ppo_slm.py's short configuration with
`--ppo-dtype bfloat16` and `float32` and counts tokens whose importance ratio goes above 10 (the paper's failure mode
2, which needs CUDA passes that disagree: on the CPU both log-probs come from the same forward).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT


SHORT = {
    "grpo.py": ["--num-prompts", "8", "--group-size", "8", "--total-steps", "6", "--num-eval-problems", "32",
                "--eval-samples", "0", "--eval-every", "0"],
    "rloo_sec.py": ["--num-prompts", "8", "--group-size", "8", "--total-steps", "6", "--num-eval-problems", "32",
                    "--eval-samples", "0", "--eval-every", "0"],
    "oc_grpo.py": ["--num-prompts", "8", "--group-size", "8", "--total-steps", "6", "--num-eval-problems", "32",
                   "--eval-samples", "0", "--eval-every", "0"],
    "adakp.py": ["--num-prompts", "8", "--group-size", "8", "--total-steps", "6", "--num-eval-problems", "32",
                 "--eval-samples", "0", "--eval-every", "0", "--num-train-problems", "64"],
    "direct_opd.py": ["--num-prompts", "8", "--group-size", "4", "--total-steps", "6", "--num-eval-problems", "32",
                      "--eval-samples", "0", "--eval-every", "0"],
    "rlpf.py": ["--num-prompts", "2", "--group-size", "4", "--total-steps", "3", "--tasks", "sum_range",
                "has_duplicate", "--eval-samples", "2", "--timing-repeats", "1"],
    "ppo_slm.py": ["--num-train-examples", "64", "--num-eval-pairs", "16", "--num-eval-prompts", "16",
                   "--num-prompts", "8", "--minibatch-size", "4", "--sft-steps", "20", "--rm-steps", "20",
                   "--total-steps", "6"],
    "mada_rl.py": ["--num-generators", "2", "--num-critics", "2", "--num-prompts", "4", "--group-size", "4",
                   "--num-eval-problems", "24", "--num-train-problems", "80", "--generator-steps", "4",
                   "--critic-steps", "4"],
}
REPORTED = ["reward/mean", "eval/greedy_accuracy", "perf/step_time", "perf/gen_tokens_per_s", "perf/peak_mem_gb",
            "mada/eval/debate_accuracy", "rm/pair_accuracy"]


def last_values(run_dir: str) -> dict:
    """The last logged value of each reported metric in a run folder's metrics.jsonl (every run folder under it)."""
    found = {}
    for folder, _, files in os.walk(run_dir):
        if "metrics.jsonl" in files:
            for line in open(os.path.join(folder, "metrics.jsonl")):
                row = json.loads(line)
                found.update({k: row[k] for k in REPORTED if k in row})
    return found


def logged_rows(run_dir: str, key: str) -> list[dict]:
    """The rows of every metrics.jsonl under `run_dir` that log `key`."""
    rows = []
    for folder, _, files in os.walk(run_dir):
        if "metrics.jsonl" in files:
            rows += [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    return [r for r in rows if key in r]


def step_times(run_dir: str) -> list[dict]:
    return logged_rows(run_dir, "perf/step_time")


def run(cmd: list[str], timeout: int, env: dict | None = None) -> tuple[int, float, str]:
    start = time.time()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        rc, tail = r.returncode, (r.stdout + r.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = 124, f"timed out after {timeout} s\n" + str(e.stdout or "")[-1000:]
    return rc, time.time() - start, tail


def count_parameters(folder: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    return str(x)


def part1(device: str, out_dir: str, timeout: int, fsdp: bool = False) -> list[dict]:
    """Each trainer's short run; with `fsdp`, under torchrun (one rank: NCCL on a GPU) with --fsdp."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if fsdp
              else [sys.executable])
    results = []
    for script, flags in SHORT.items():
        run_dir = os.path.join(out_dir, script[:-3] + ("-fsdp" if fsdp else ""))
        rc, wall, tail = run([*launch, script, *flags, "--device", device, "--output-dir", run_dir,
                              *(["--fsdp"] if fsdp else [])], timeout)
        res = {"script": script + (" --fsdp" if fsdp else ""), "rc": rc, "wall_s": round(wall, 1),
               **last_values(run_dir)}
        if rc != 0:
            res["error"] = tail
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


SIZES = {"0.5b": (896, 24, 14), "1.5b": (1536, 28, 12)}
"""hidden, layers, heads of the Qwen2.5 bodies (our MLP is 4 x hidden and the vocabulary the testbed's 259 bytes, so
the parameter counts are smaller than Qwen's: the report prints ours)"""


def part2(device: str, out_dir: str, timeout: int, dry_run: bool, size: str = "0.5b", quick: bool = False) -> list[dict]:
    from benchmarks.speed.bench_models import forced_length, random_model

    model = forced_length(random_model(64, 2, 4) if dry_run else random_model(*SIZES[size]))
    prompts, group, tokens, steps = (2, 4, 8, 3) if dry_run else (16, 8, 64 if quick else 128, 4 if quick else 5)
    base = ["grpo.py", "--model-name", model, "--device", device, "--num-prompts", str(prompts), "--group-size",
            str(group), "--max-new-tokens", str(tokens), "--total-steps", str(steps), "--micro-batch-size", "32",
            "--learning-rate", "1e-6", "--eval-every", "0", "--num-eval-problems", "0", "--eval-samples", "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    # (name, command, bytes of training state per parameter: weights + gradients + two AdamW moments)
    configs = [("plain, bfloat16 (float32 masters), hf (own loop)", [sys.executable, *base, "--dtype", "bfloat16"], 16),
               ("plain, bfloat16 (float32 masters), hf_generate", [sys.executable, *base, "--dtype", "bfloat16",
                                                                   "--rollout-backend", "hf_generate"], 16),
               ("--fsdp, 1 rank, bfloat16 (float32 masters)", [*torchrun, *base, "--fsdp", "--dtype", "bfloat16"], 16),
               ("--fsdp, 1 rank, bfloat16 --no-master-weights", [*torchrun, *base, "--fsdp", "--dtype", "bfloat16",
                                                                 "--no-master-weights"], 8)]
    if quick:  # the memory comparison only: plain bf16 against FSDP2's bf16 compute over float32 masters
        configs = [configs[0], configs[2]]
    params = count_parameters(model)
    results = []
    for name, cmd, state_bytes in configs:
        run_dir = os.path.join(out_dir, "scale-" + str(len(results)))
        rc, wall, tail = run([*cmd, "--output-dir", run_dir], timeout)
        rows = step_times(run_dir)[1:]  # the first step pays for allocation and kernel selection
        res = {"config": name, "size": size, "tokens": tokens, "rc": rc, "wall_s": round(wall, 1),
               "steps_timed": len(rows), "params_m": params / 1e6,
               "state_gb_on_paper": round(state_bytes * params / 2**30, 2)}
        if rows:
            for key, label in (("perf/step_time", "step_s"), ("time/generate", "generate_s"),
                               ("time/update", "update_s"), ("perf/gen_tokens_per_s", "gen_tok_per_s")):
                if key in rows[0]:
                    res[label] = round(statistics.median(r[key] for r in rows), 3)
            res["peak_mem_gb"] = round(max(r["perf/peak_mem_gb"] for r in rows), 2)
            res["decode_ms_per_token"] = round(1000 * res.get("generate_s", 0) / tokens, 2)
        if rc != 0:
            res["error"] = tail
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


RECIPE_LR = 1e-6


def weights_moved(start_dir: str, end_dir: str, stored) -> float:
    """Share of weight entries that differ between two saved folders (the start rounded as the run stored it)."""
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(start_dir).state_dict()
    end = AutoModelForCausalLM.from_pretrained(end_dir).state_dict()
    moved = sum((end[k] != start[k].to(stored).float()).sum().item() for k in start)
    return moved / sum(v.numel() for v in start.values())


def part3_recipe(device: str, out_dir: str, timeout: int, dry_run: bool) -> list[dict]:
    """The real-model recipe (issue 27): (a) 2 training steps at lr 1e-6 on the 0.5B body move about as many weights
    under --dtype bfloat16 (float32 masters) as in float32, and almost none with --no-master-weights; (b) one
    micro-batch of the update (completion_logprobs, its loss and backward) at 1,024 new tokens on a Qwen2.5-0.5B
    shape with Qwen's vocabulary, bf16 autocast over float32 weights, with and without gradient checkpointing: peak
    CUDA memory above the held state against docs/fsdp.md's formula (common.memory_plan.micro_batch_bytes)."""
    import torch

    from benchmarks.speed.bench_models import random_model
    from common.memory_plan import Shape, micro_batch_bytes

    results = []
    model = random_model(64, 2, 4) if dry_run else random_model(*SIZES["0.5b"])
    # direct_opd.py, student = the random body, with the default testbed teacher pair (same byte tokenizer): its
    # dense teacher-shift advantage gives every weight a gradient, where a random model's verifier reward is all 0
    base = [sys.executable, "direct_opd.py", "--model-name", model, "--device", device, "--num-prompts", "4",
            "--group-size", "4", "--max-new-tokens", "16", "--total-steps", "2", "--learning-rate", str(RECIPE_LR),
            "--eval-every", "0", "--num-eval-problems", "4", "--eval-samples", "0", "--log-samples", "0"]
    for name, flags, stored in (("float32", [], torch.float32), ("bfloat16 (float32 masters)", ["--dtype", "bfloat16"],
                                                                 torch.float32),
                                ("bfloat16 --no-master-weights", ["--dtype", "bfloat16", "--no-master-weights"],
                                 torch.bfloat16)):
        run_dir = os.path.join(out_dir, f"recipe-{len(results)}")
        rc, wall, tail = run([*base, *flags, "--output-dir", run_dir, "--run-name", "r"], timeout)
        res = {"check": f"weights moved, 2 steps at lr {RECIPE_LR:g}: {name}", "rc": rc, "wall_s": round(wall, 1)}
        if rc == 0:
            res["value"] = round(weights_moved(model, os.path.join(run_dir, "r", "checkpoint"), stored), 4)
        else:
            res["error"] = tail
        print(json.dumps(res), flush=True)
        results.append(res)
    if device != "cuda":
        return results  # (b) reads CUDA's allocator; the CPU figure is benchmarks/speed/update_memory.md's
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.models import autocast_forward, enable_gradient_checkpointing, mask_padded_head
    from common.rollout import completion_logprobs

    vocab, hidden, inter, heads, kv, layers, rows, prompt, completion = 151936, 896, 4864, 14, 2, 24, 4, 64, 1024
    for ckpt in (False, True):
        torch.manual_seed(0)
        net = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                           num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=layers,
                                           tie_word_embeddings=True, max_position_embeddings=2048)).to(device).train()
        mask_padded_head(net, 151665)
        autocast_forward(net, torch.bfloat16)
        if ckpt:
            enable_gradient_checkpointing(net)
        ids = torch.randint(0, 151665, (rows, prompt + completion), device=device)

        def step():
            logp, _ = completion_logprobs(net, ids, torch.ones_like(ids), prompt, 1.0, with_entropy=True)
            (-logp.mean()).backward()

        step()  # warm-up: kernels, and the gradients, held between micro-batches anyway
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - held
        shape = Shape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=hidden // heads,
                      intermediate=inter, vocab=vocab, tied=True)
        formula = sum(micro_batch_bytes(shape, rows, prompt, completion, "autocast", ckpt))
        res = {"check": f"update peak above held state, {rows} rows x ({prompt} + {completion}) tokens, bf16 autocast"
                        f"{', gradient checkpointing' if ckpt else ''}", "rc": 0,
               "value": f"{peak / 2**30:.2f} GiB vs formula {formula / 2**30:.2f} GiB ({peak / formula:.3f})"}
        print(json.dumps(res), flush=True)
        results.append(res)
        del net
        torch.cuda.empty_cache()
    return results


def overflow_verdict(above: dict) -> str:
    """Part 4's rule on {dtype: tokens with a ratio above 10 or non-finite, over the run}.

    >>> overflow_verdict({"float32": 0, "bfloat16": 7}), overflow_verdict({"float32": 0, "bfloat16": 0})
    ('shown', 'not shown')
    >>> overflow_verdict({"float32": 2, "bfloat16": 7}), overflow_verdict({"bfloat16": 7})
    ('unclear: float32 overflows too', 'unclear: a run logged no step')
    """
    if len(above) < 2:
        return "unclear: a run logged no step"
    if above["float32"] > 0:
        return "unclear: float32 overflows too"
    return "shown" if above["bfloat16"] > 0 else "not shown"


def part4_ppo_ratio(device: str, out_dir: str, timeout: int) -> list[dict]:
    """ppo_slm.py's failure mode 2 (bfloat16 importance ratios overflow), which the CPU cannot show (its old and new
    log-probs come from the same forward in either dtype): ppo_slm.py's short run with --ppo-dtype float32 and
    bfloat16, each step's largest token ratio and tokens with a ratio above 10 or non-finite (safety/max_ratio,
    safety/ratio_above_10, over every minibatch and epoch). The rule: shown if bfloat16 has such tokens and float32
    none; not shown if neither has; else unclear."""
    results, above = [], {}
    for dtype in ("float32", "bfloat16"):
        run_dir = os.path.join(out_dir, f"ppo_slm-{dtype}")
        rc, wall, tail = run([sys.executable, "ppo_slm.py", *SHORT["ppo_slm.py"], "--ppo-dtype", dtype,
                              "--device", device, "--output-dir", run_dir], timeout)
        rows = logged_rows(run_dir, "safety/max_ratio")
        if rows:
            above[dtype] = sum(r["safety/ratio_above_10"] for r in rows)
        res = {"check": f"ppo_slm.py --ppo-dtype {dtype}: largest token ratio, tokens above 10 or non-finite "
                        f"({len(rows)} PPO steps)", "rc": rc,
               "value": (f"{max(r['safety/max_ratio'] for r in rows):.3g}, {above[dtype]:.0f}" if rows
                         else "no PPO step logged")}
        if rc != 0:
            res["error"] = tail
        print(json.dumps(res), flush=True)
        results.append(res)
    results.append({"check": "bfloat16 overflow (tokens above 10 in bfloat16, none in float32)", "rc": 0,
                    "value": overflow_verdict(above)})
    print(json.dumps(results[-1]), flush=True)
    return results


def write_report(path: str, header: str, smoke: list[dict], scale: list[dict], recipe: list[dict] = (),
                 ratio: list[dict] = ()) -> None:
    lines = ["# GPU check", "", header, "", "## Every trainer on the GPU (testbed, short runs)", "",
             "| script | exit | wall (s) | last reward/mean | final greedy accuracy | peak GPU memory (GB) |",
             "|---|---|---|---|---|---|"]
    for r in smoke:
        cells = [r["script"], r["rc"], r["wall_s"], r.get("reward/mean", ""), r.get("eval/greedy_accuracy", ""),
                 r.get("perf/peak_mem_gb", "")]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    lines += ["", f"## grpo.py at {scale[0]['size'] if scale else ''} scale (16 prompts x 8 samples x "
              f"{scale[0]['tokens'] if scale else ''} tokens; medians over steps 2..)", "",
              "| configuration | exit | step (s) | generate (s) | update (s) | decode ms/token | gen tokens/s | "
              "peak GPU memory (GiB) | training state on paper (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in scale:
        cells = [r["config"], r["rc"]] + [r.get(k, "") for k in ("step_s", "generate_s", "update_s",
                                                                   "decode_ms_per_token", "gen_tok_per_s",
                                                                   "peak_mem_gb", "state_gb_on_paper")]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    if scale:
        lines += ["", f"The model has {scale[0]['params_m']:.0f} M parameters (the byte vocabulary and a 4 x hidden MLP "
                  "make it smaller than the Qwen2.5 model of that body); 'on paper' = (8 or 16 bytes) x parameters, "
                  "without activations, logits or FSDP's transient gathered layers (docs/fsdp.md)."]
    if recipe:
        lines += ["", "## The real-model recipe (float32 masters under --dtype bfloat16; update memory at 1,024 tokens)",
                  "", "| check | exit | value |", "|---|---|---|"]
        lines += [f"| {r['check']} | {r['rc']} | {fmt(r.get('value', ''))} |" for r in recipe]
    if ratio:
        lines += ["", "## ppo_slm.py's importance ratios by dtype (its failure mode 2)", "",
                  "| check | exit | value |", "|---|---|---|"]
        lines += [f"| {r['check']} | {r['rc']} | {fmt(r.get('value', ''))} |" for r in ratio]
    errors = [r for r in smoke + scale + list(recipe) + list(ratio) if "error" in r]
    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            lines += [f"### {r.get('script', r.get('config', r.get('check')))}", "", "```", r["error"], "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check this script without a GPU")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "speed", "gpu_check.md"))
    p.add_argument("--only", choices=["all", "smoke", "smoke_fsdp", "scale", "recipe", "ppo_ratio"], default="all")
    p.add_argument("--timeout", type=int, default=150, help="seconds per command")
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b", help="model body of part 2")
    p.add_argument("--quick", action="store_true", help="part 2: two configurations, 64 tokens, 4 steps")
    a = p.parse_args()
    import torch

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; use --dry-run to check the script on CPU")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)"
    header = (f"`python -m benchmarks.speed.gpu_check`, {time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}, "
              f"{'dry run at toy sizes' if a.dry_run else 'one GPU'}.")
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        smoke = part1(device, tmp, a.timeout) if a.only in ("all", "smoke") else []
        smoke += part1(device, tmp, a.timeout, fsdp=True) if a.only in ("all", "smoke_fsdp") else []
        scale = part2(device, tmp, a.timeout, a.dry_run, a.size, a.quick) if a.only in ("all", "scale") else []
        recipe = part3_recipe(device, tmp, a.timeout, a.dry_run) if a.only in ("all", "recipe") else []
        ratio = part4_ppo_ratio(device, tmp, a.timeout) if a.only in ("all", "ppo_ratio") else []
    write_report(a.out, header, smoke, scale, recipe, ratio)
    print(open(a.out).read())


if __name__ == "__main__":
    main()
