"""Forward and backward of SmolLM2-135M-Instruct on this CPU in float32 and under bfloat16 autocast, side by side:
whether bfloat16 compute pays here (it does on CPUs with native bfloat16, AVX512-BF16 or AMX; without them torch
emulates it). Writes benchmarks/speed/cpu_precision.md.

    python -m benchmarks.speed.cpu_precision           # 4 rows x 96 tokens, 2 repeats, a few minutes
"""

import argparse
import os
import statistics
import time

from benchmarks import ROOT


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    have = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return ", ".join(have) or "none of avx2 / avx512f / avx512_bf16 / amx_bf16"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "speed", "cpu_precision.md"))
    cli = p.parse_args()
    import torch
    import tyro

    import grpo
    from common.models import load_policy
    from grounds.pretrained import ensure_pretrained_model

    torch.set_num_threads(2)
    path = ensure_pretrained_model("smollm2-135m-instruct")
    ids = torch.randint(3, 49152, (cli.rows, cli.tokens), generator=torch.Generator().manual_seed(0))
    times = {}
    for dtype in ("float32", "bfloat16"):
        model = load_policy(path, tyro.cli(grpo.Args, args=["--dtype", dtype]), "cpu")
        fwd, bwd = [], []
        for _ in range(cli.repeats):
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            loss.backward()
            bwd.append(time.perf_counter() - t1)
            fwd.append(t1 - t0)
            model.zero_grad(set_to_none=True)
        times[dtype] = (statistics.median(fwd), statistics.median(bwd))
        print(dtype, times[dtype], flush=True)
    f32, b16 = times["float32"], times["bfloat16"]
    lines = ["# bfloat16 compute on this CPU", "",
             f"`python -m benchmarks.speed.cpu_precision --rows {cli.rows} --tokens {cli.tokens} "
             f"--repeats {cli.repeats}`, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, 2 torch threads, CPU flags: {cpu_flags()}. "
             f"SmolLM2-135M-Instruct, {cli.rows} rows x {cli.tokens} tokens, a causal-LM loss; median of "
             f"{cli.repeats} (s).", "",
             "| --dtype | forward | backward | forward + backward | vs float32 |", "|---|---|---|---|---|",
             f"| float32 | {f32[0]:.2f} | {f32[1]:.2f} | {sum(f32):.2f} | 1.00x |",
             f"| bfloat16 (autocast over float32 masters) | {b16[0]:.2f} | {b16[1]:.2f} | {sum(b16):.2f} | "
             f"{sum(b16) / sum(f32):.2f}x |", "",
             (f"bfloat16 is {sum(b16) / sum(f32):.1f}x slower than float32 here, so the CPU defaults stay float32; "
              "--dtype bfloat16 is for GPUs and CPUs with native bfloat16 (AVX512-BF16, AMX)."
              if sum(b16) > 1.2 * sum(f32) else
              f"bfloat16 takes {sum(b16) / sum(f32):.2f}x float32's time here: worth --dtype bfloat16 on this CPU.")]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
