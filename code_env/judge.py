"""rlpf.py's judging plumbing: its timing flags as sandbox limits (and their one-line errors), each task's noise-floor
calibration, judging a batch of programs task by task against the re-timed references, the code metrics, the
held-out evaluation of programs, and the --score-file side mode (one program judged, one JSON line). The reward
itself (what a verdict earns) is rlpf.py's."""

from __future__ import annotations

import json

import numpy as np

from code_env import sandbox
from code_env.tasks import calibrate, check_timing_inputs, extract_program, judge, render_code_prompt, select_tasks
from common import data, logger


def limits_of(args) -> sandbox.Limits:
    return sandbox.Limits(call_s=args.call_timeout, memory_mb=args.memory_mb)


def check_timing_args(args) -> None:
    """The judging flags: a one-line error for a value that cannot time or judge anything."""
    factors = ("confirm_band", "min_noise_floor", "noise_floor_margin", "rbr_tolerance")  # factors on a time: >= 1
    for name in ("timing_repeats", "calibration_scorings", "memory_mb", *factors):
        if not getattr(args, name) >= 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if not args.call_timeout > 0:
        raise SystemExit(f"error: --call-timeout {args.call_timeout} must be a positive number of seconds")


def calibration_of(task, args) -> dict:
    """The task's timing calibration (code_env/tasks.py `calibrate`; measured once per run, then cached)."""
    return calibrate(task, limits_of(args), args.timing_repeats, args.calibration_scorings, args.noise_floor_margin,
                     least=args.min_noise_floor)


def calibrate_timing(tasks: list, args) -> dict:
    """Calibrate every task at start and print one line each (after one naming the sandbox's isolation): the
    speed-ups the references' copies got against the references, and the noise floors that follow."""
    print(f"sandbox isolation: {sandbox.isolation()}")
    floors = {}
    for task in dict((t.name, t) for t in tasks).values():
        c = calibration_of(task, args)
        floors[task.name] = c["floors"]
        print(f"timing calibration {task.name}: copy of the slow baseline "
              f"{' '.join(f'{x:.3f}' for x in c['slow_self'])} -> noise floor {c['floors'][0]:.3f}; copy of the "
              f"fast reference {' '.join(f'{x:.3f}' for x in c['fast_self'])} -> {c['floors'][1]:.3f} "
              f"({c['seconds']:.1f} s)")
    return floors


def judge_programs(tasks: list, programs: list, args) -> tuple[list, dict]:
    """Judge each program on its task; each task's programs and its two references are timed together.
    Returns per-program (verdict, T_b, T_r), each verdict carrying its task's noise floors (verdict.floors), and
    the references' timing spread (noise) and noise floors."""
    out, spreads, floors = [None] * len(programs), [], []
    for name in dict.fromkeys(t.name for t in tasks):
        rows = [i for i, t in enumerate(tasks) if t.name == name]
        task_floors = calibration_of(tasks[rows[0]], args)["floors"]
        r = judge(tasks[rows[0]], [programs[i] for i in rows], limits_of(args), args.timing_repeats,
                  time_wrong_outputs=args.reward == "speed_ungated", confirm_floor=task_floors[0],
                  confirm_band=args.confirm_band)
        for i, v in zip(rows, r["verdicts"]):
            v.floors = task_floors
            out[i] = (v, r["slow"].runtime, r["fast"].runtime)
        spreads += [sandbox.noise(r["slow"].times), sandbox.noise(r["fast"].times)]
        floors.append(task_floors)
    return out, {"timing/reference_noise": float(np.median(spreads)),
                 "timing/noise_floor": float(np.median([f[0] for f in floors])),
                 "timing/noise_floor_fast": float(np.median([f[1] for f in floors]))}


def code_metrics(judged: list, prefix: str) -> dict:
    """Over judged programs: pass rate; among correct ones, the fraction at least 2x faster than the slow baseline
    (fast_frac) and the rest (slow_correct_frac, Slow/CRR), the mean speed-up T_b / T_c; CGRE; status histogram."""
    correct = [(v, tb, tr) for v, tb, tr in judged if v.status == "correct"]
    faster = [tb / v.runtime >= 2 for v, tb, tr in correct]  # clearly faster: a rewrite of the baseline ties with it
    m = {f"{prefix}pass_rate": len(correct) / max(len(judged), 1),
         f"{prefix}fast_frac": float(np.mean(faster)) if correct else 0.0,
         f"{prefix}slow_correct_frac": 1 - float(np.mean(faster)) if correct else 0.0,
         f"{prefix}mean_speedup": float(np.mean([tb / v.runtime for v, tb, tr in correct])) if correct else 0.0,
         f"{prefix}cgre": float(np.mean([min(max((tb - v.runtime) / (tb - tr), 0), 1) if v.status == "correct" else 0
                                         for v, tb, tr in judged]))}
    for s in sandbox.STATUSES:
        m[f"{prefix}status/{s}"] = sum(v.status == s for v, _, _ in judged) / max(len(judged), 1)
    return m


def evaluate_code(engine, tokenizer, tasks: list, args) -> dict:
    """One greedy and --eval-samples sampled programs per task, judged; eval/greedy_* and eval/* metrics."""
    prompt_ids = data.encode_prompts(tokenizer, [render_code_prompt(t, tokenizer) for t in tasks])
    greedy = engine.generate(prompt_ids, n=1, max_new_tokens=args.max_new_tokens, greedy=True)
    judged = judge_programs(tasks, [extract_program(x, t.entry) for x, t in zip(greedy.texts, tasks)], args)[0]
    out = code_metrics(judged, "eval/greedy_")
    if args.log_samples > 0:
        out["samples/eval"] = logger.sample_rows(tokenizer, greedy, tasks, args.log_samples, **verdict_fields(judged))
    if args.eval_samples > 0:
        sampled = engine.generate(prompt_ids, n=args.eval_samples, temperature=args.temperature,
                                  max_new_tokens=args.max_new_tokens)
        rep = [t for t in tasks for _ in range(args.eval_samples)]
        judged, noise = judge_programs(rep, [extract_program(x, t.entry) for x, t in zip(sampled.texts, rep)], args)
        out.update(code_metrics(judged, "eval/"))
        out["eval/reference_noise"] = noise["timing/reference_noise"]
    return out


def verdict_fields(judged: list) -> dict:
    """Per program, for samples.jsonl: the task, the sandbox's status and message, and the speed-up T_b / T_c."""
    return {"status": [v.status for v, _, _ in judged], "message": [v.message[:200] for v, _, _ in judged],
            "speedup": [tb / v.runtime if v.status == "correct" and v.runtime else None for v, tb, _ in judged]}


def score_file(args, reward, credited_speedup) -> dict:
    """--score-file: judge one program, print one JSON line, return it. Exits 0 whatever the program does. `reward`:
    rlpf.py's staged reward, `credited_speedup` its credit of a speed-up beyond the noise floor."""
    tasks = {t.name: t for t in select_tasks(args.dataset, args.tasks)}
    if args.task not in tasks:
        raise SystemExit(f"error: --task {args.task}: no such task (have {sorted(tasks)})")
    task = tasks[args.task]
    check_timing_inputs([task], args.timing_repeats)
    try:
        with open(args.score_file, errors="replace") as f:
            source = f.read(1 << 20)
    except OSError as e:
        raise SystemExit(f"error: --score-file {args.score_file}: {e.strerror}") from None
    floors = calibration_of(task, args)["floors"]
    r = judge(task, [extract_program(source, task.entry)], limits_of(args), args.timing_repeats,
              confirm_floor=floors[0], confirm_band=args.confirm_band)
    v, t_b, t_r = r["verdicts"][0], r["slow"].runtime, r["fast"].runtime
    line = {"task": task.name, "status": v.status, "message": v.message, "runtime": v.runtime,
            "slow_runtime": t_b, "fast_runtime": t_r, "speedup": t_b / v.runtime if v.runtime else None,
            "credited_speedup": credited_speedup(t_b / v.runtime, floors[0]) if v.runtime else None,
            "noise_floors": list(floors), "clock": v.clock or None, "second_speedup": v.second_speedup,
            "reward": reward(v.status, v.runtime, t_b, t_r, args.rbr_tolerance, floors),
            "isolation": sandbox.isolation()}
    print(json.dumps(line))
    return line
