"""rlpf.py: the reward's promises (gate, floor, ladder), the scoring command, and a short training run."""

import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch
import tyro

import rlpf
from common.logger import read_metrics
from conftest import assert_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = ("no_program", "compile_error", "runtime_error", "timeout", "memory_limit", "wrong_output")
T_B, T_R = 0.020, 0.0002  # slow baseline and fast reference runtimes (seconds)
RUNTIMES = [None, 1e-9, T_R / 10, T_R, 1.02 * T_R, 0.001, 0.01, T_B * 0.999, T_B, 2 * T_B, 100.0]


def test_no_speed_credit_without_correctness():
    for status in FAILURES:
        staged = {rlpf.staged_reward(status, t, T_B, T_R) for t in RUNTIMES}
        assert staged == {rlpf.LADDER[status]}, status  # however fast the wrong program ran
        assert {rlpf.dmc_reward(status, t, T_B, T_R) for t in RUNTIMES} == {-1.0}
        assert {rlpf.correctness_reward(status, t, T_B, T_R) for t in RUNTIMES} == {0.0}


def test_every_correct_program_outranks_every_failure():
    worst_correct = min(rlpf.staged_reward("correct", t, T_B, T_R) for t in RUNTIMES if t is not None)
    best_failure = max(rlpf.staged_reward(s, t, T_B, T_R) for s in FAILURES for t in RUNTIMES)
    assert worst_correct > best_failure
    assert worst_correct == pytest.approx(0.15)  # the floor: a correct but slower-than-baseline program
    assert min(rlpf.dmc_reward("correct", t, T_B, T_R) for t in RUNTIMES[1:]) >= \
        max(rlpf.dmc_reward(s, t, T_B, T_R) for s in FAILURES for t in RUNTIMES)


def test_failure_ladder_order():
    r = {s: rlpf.staged_reward(s, None, T_B, T_R) for s in FAILURES}
    assert r["no_program"] < r["compile_error"] < r["runtime_error"] < r["wrong_output"]
    assert r["runtime_error"] == r["timeout"] == r["memory_limit"]  # all "compiles but fails to run"
    assert (r["no_program"], r["compile_error"], r["runtime_error"], r["wrong_output"]) == (-0.05, 0.0, 0.05, 0.10)


def test_staged_reward_grows_with_speed_among_correct_programs():
    rewards = [rlpf.staged_reward("correct", t, T_B, T_R) for t in sorted(RUNTIMES[1:], reverse=True)]
    assert rewards == sorted(rewards) and rewards[-1] == pytest.approx(1.26) and rewards[0] == pytest.approx(0.15)
    half = rlpf.staged_reward("correct", (T_B + T_R) / 2, T_B, T_R)
    assert half == pytest.approx(0.5 + 0.16)  # CGRE closes half the gap, plus FBR; no RBR
    assert rlpf.staged_reward("correct", 1.02 * T_R, T_B, T_R) > rlpf.staged_reward("correct", 1.03 * T_R, T_B, T_R)


def test_dmc_collapsed_reward_and_the_ungated_ablation():
    fast, slow = T_R, T_B
    assert rlpf.dmc_reward("correct", fast, T_B, T_R) == 1.0 and rlpf.dmc_reward("correct", slow, T_B, T_R) == -1.0
    # ungated: a fast wrong program is paid like a fast correct one (the hole the gate closes)
    ungated = rlpf.speed_ungated_reward
    assert ungated("wrong_output", fast, T_B, T_R) == ungated("correct", fast, T_B, T_R)
    assert rlpf.speed_ungated_reward("runtime_error", None, T_B, T_R) == 0.0
    assert rlpf.program_reward("staged", "correct", fast, T_B, T_R) == rlpf.staged_reward("correct", fast, T_B, T_R)


def test_credited_speedup_and_noise_floors_with_hand_values():
    from code_env.tasks import noise_floor, paired_speedup

    # paired: the median over rounds of the per-round ratio (a round disturbed for one program does not count)
    assert paired_speedup([50, 52, 90, 51, 50], [25, 26, 20, 25.5, 26]) == pytest.approx(2.0)
    assert paired_speedup([10, 10], [10, 40]) == pytest.approx(0.5)  # even count: geometric middle, 1 x 1/4
    # the floor: exp(margin * largest |log s|) over the copies' self-speed-ups
    assert noise_floor([1.0, 1.03, 0.98], 2.0) == pytest.approx(1.03**2)
    assert noise_floor([0.9, 1.05], 1.5) == pytest.approx((1 / 0.9) ** 1.5)
    with pytest.raises(ValueError):
        noise_floor([1.0], 0.5)
    # never below the least floor (rlpf.py --min-noise-floor): a tight calibration does not let an outlier through
    assert noise_floor([1.0, 1.03, 0.98], 2.0, least=1.2) == 1.2
    assert noise_floor([0.7, 1.05], 1.0, least=1.2) == pytest.approx(1 / 0.7)  # a wider calibration wins
    assert rlpf.staged_reward("correct", T_B / 1.10, T_B, T_R, floors=(noise_floor([1.01], 3.0), 1.0)) > 0.15
    assert rlpf.staged_reward("correct", T_B / 1.10, T_B, T_R, floors=(noise_floor([1.01], 3.0, 1.2), 1.0)) == 0.15
    with pytest.raises(ValueError):
        noise_floor([1.0], 3.0, least=0.9)
    # credited: 1 inside [1/f, f], shrunk by f outside
    assert [rlpf.credited_speedup(s, 1.25) for s in (1.0, 1.2, 1 / 1.2, 1.25, 2.5, 0.4)] == \
        pytest.approx([1.0, 1.0, 1.0, 1.0, 2.0, 0.5])
    # the reward: within the slow floor no FBR and no CGRE; beyond it, CGRE of the credited speed-up
    assert rlpf.staged_reward("correct", T_B / 1.2, T_B, T_R, floors=(1.25, 1.0)) == pytest.approx(0.15)
    cgre = (T_B - T_B / 2.0) / (T_B - T_R)  # raw 2.5x with floor 1.25 -> credited 2x
    assert rlpf.staged_reward("correct", T_B / 2.5, T_B, T_R, floors=(1.25, 1.0)) == pytest.approx(cgre + 0.16)
    # RBR: within the tolerance of T_r, whatever the floors (noise only withholds credit, never grants it)
    assert rlpf.speed_terms(1.02 * T_R, T_B, T_R, 1.02, (1.25, 1.5))[2] == 1.0
    assert rlpf.speed_terms(1.03 * T_R, T_B, T_R, 1.02, (1.25, 1.5))[2] == 0.0
    assert rlpf.dmc_reward("correct", T_B / 1.25, T_B, T_B / 1.44, floors=(1.0, 1.0)) == 1.0  # >= sqrt(1.44)
    assert rlpf.dmc_reward("correct", T_B / 1.25, T_B, T_B / 1.44, floors=(1.1, 1.0)) == -1.0  # 1.14 credited
    # floors (1, 1): the papers' formula exactly
    for t in RUNTIMES[1:]:
        paper = max(0.15, min(max((T_B - t) / (T_B - T_R), 0), 1) + 0.16 * (t < T_B) + 0.10 * (t <= 1.02 * T_R))
        assert rlpf.staged_reward("correct", t, T_B, T_R) == pytest.approx(paper)


def test_a_program_measurably_slower_than_the_expert_gets_no_expert_match_bonus():
    """Issue 37: with the fast reference's noise floor 2.59, a correct program 2.5x slower than the expert was paid
    the expert-match bonus (1.240 against 1.145 under the paper's terms)."""
    floors = (1.2, 2.59)
    slower = rlpf.staged_reward("correct", 2.5 * T_R, T_B, T_R, floors=floors)
    assert rlpf.speed_terms(2.5 * T_R, T_B, T_R, 1.02, floors)[2] == 0.0
    assert slower == pytest.approx(rlpf.staged_reward("correct", 2.5 * T_R, T_B, T_R, floors=(1.2, 1.0)))
    assert slower < rlpf.staged_reward("correct", T_R, T_B, T_R, floors=floors) - 0.09  # the expert's own speed


def test_a_speed_up_near_the_floor_is_judged_again_and_the_one_closer_to_1_kept():
    """code_tasks.judge with confirm_floor: a program whose speed-up lands in (f, 3f) gets a second judging in fresh
    sandboxes (second_speedup) and keeps the smaller of the two speed-ups (both above 1: the one closer to 1); far
    from the band, or without a floor, there is no second judging. The fast reference (hundreds of times faster)
    is put in the band by its floor."""
    from code_env.tasks import TASKS, in_confirm_band, judge

    task = TASKS["sum_range"]
    plain = judge(task, [task.fast], repeats=3)
    first = plain["slow"].runtime / plain["verdicts"][0].runtime
    assert plain["verdicts"][0].second_speedup is None and first > 20
    floor = first / 3  # the next judging's speed-up lands within 3x of this one: inside (floor, 10 floor)
    r = judge(task, [task.fast], repeats=3, confirm_floor=floor, confirm_band=10)
    v = r["verdicts"][0]
    kept = r["slow"].runtime / v.runtime
    assert v.second_speedup is not None and kept <= v.second_speedup * (1 + 1e-9)
    far = judge(task, [task.fast], repeats=3, confirm_floor=1.2)  # hundreds of times faster: beyond 3 x 1.2
    assert far["verdicts"][0].second_speedup is None


def test_timing_flags_with_nonsense_values_stop_with_one_line():
    for flags in (["--timing-repeats", "0"], ["--calibration-scorings", "0"], ["--noise-floor-margin", "0.5"],
                  ["--min-noise-floor", "0.9"], ["--confirm-band", "0.5"],
                  ["--call-timeout", "0"], ["--memory-mb", "0"], ["--rbr-tolerance", "0.9"]):
        for extra in ([], ["--score-file", "nonexistent.py"]):
            with pytest.raises(SystemExit) as e:
                rlpf.main(tyro.cli(rlpf.Args, args=flags + extra))
            assert str(e.value).startswith(f"error: {flags[0]} ") and "\n" not in str(e.value), (flags, e.value)


def score(tmp_path, source: str, task: str = "sum_range") -> dict:
    path = tmp_path / "candidate.py"
    path.write_text(source)
    out = StringIO()
    with redirect_stdout(out):
        rlpf.main(tyro.cli(rlpf.Args, args=["--score-file", str(path), "--task", task]))
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_score_file_judges_slow_fast_and_broken_programs(tmp_path):
    from code_env.tasks import TASKS

    fast = score(tmp_path, TASKS["sum_range"].fast)
    slow = score(tmp_path, TASKS["sum_range"].slow)
    assert fast["status"] == slow["status"] == "correct"
    assert fast["speedup"] > slow["speedup"] and fast["reward"] > slow["reward"] >= 0.15
    assert score(tmp_path, "def solve(n):\n    return 0\n")["status"] == "wrong_output"
    assert score(tmp_path, "Sorry, I cannot help with that.")["status"] == "no_program"
    with pytest.raises(SystemExit, match="no such task"):
        score(tmp_path, TASKS["sum_range"].fast, task="nope")


def test_an_equal_speed_candidate_earns_no_speed_credit(tmp_path):
    """The slow baseline's own program, as a candidate, against the baseline re-timed in the same rounds (and the
    noise floor calibrated in this process, never below --min-noise-floor 1.2): no FBR, no CGRE in any of 5
    scorings, whatever this machine's speed. Old timing gave about half of such scorings FBR (the 0.16 step); the
    calibration alone let 1 to 3 in 100 through (benchmarks/premises/rlpf_timing.md)."""
    from code_env.tasks import TASKS

    slow = TASKS["sum_range"].slow
    scored = [score(tmp_path, slow) for _ in range(5)]
    assert all(x["status"] == "correct" for x in scored)
    credited = [x for x in scored if x["reward"] > rlpf.CORRECT_FLOOR]
    assert not credited, [(x["speedup"], x["reward"]) for x in scored]


SLOW_LOOP = "    t = 0\n    for i in range(n):\n        t += i\n"
GAMES = {  # slow programs that try to be paid for speed they do not have (issue 36 and what its fixes might miss)
    "helper process whose CPU reaches no parent": "import os, signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "def solve(n):\n    r, w = os.pipe()\n    if os.fork() == 0:\n" + SLOW_LOOP.replace("    ", "        ")
        + "        os.write(w, str(t).encode())\n        os._exit(0)\n"
        "    os.close(w)\n    return int(os.read(r, 99))\n",
    "answers cached in world-writable folders": "import json, os\ndef solve(n):\n"
        "    for d in ('/run/lock', '/var/lock', '/tmp', '/dev/shm', '/var/tmp', '.'):\n"
        "        try:\n            return json.load(open(os.path.join(d, 'tp-game-%d' % n)))\n"
        "        except (OSError, ValueError):\n            pass\n" + SLOW_LOOP
        + "    for d in ('/run/lock', '/var/lock'):\n        try:\n"
        "            json.dump(t, open(os.path.join(d, 'tp-game-%d' % n), 'w'))\n        except OSError:\n"
        "            pass\n    return t\n",
    "memo": "CACHE = {}\ndef solve(n):\n    if n in CACHE:\n        return CACHE[n]\n" + SLOW_LOOP
        + "    CACHE[n] = t\n    return t\n",
    "extends an earlier answer": "SEEN = [(0, 0)]\ndef solve(n):\n"
        "    m, t = max(x for x in SEEN if x[0] <= n)\n    for i in range(m, n):\n        t += i\n"
        "    SEEN.append((n, t))\n    return t\n",
    "table built at import": "import itertools\nT = [0] + list(itertools.accumulate(range(1_700_000)))\n"
        "def solve(n):\n    if n < len(T):\n        return T[n]\n" + SLOW_LOOP + "    return t\n",
    "table built in the warm-up call": "import itertools\nT = []\ndef solve(n):\n    if n > 10_000 and not T:\n"
        "        T.extend([0] + list(itertools.accumulate(range(1_700_000))))\n    if n < len(T):\n"
        "        return T[n]\n" + SLOW_LOOP + "    return t\n",
    "table built after the first timed round": "import itertools\nT, CALLS = [], [0]\ndef solve(n):\n"
        "    CALLS[0] += 1\n    if CALLS[0] == 10 and not T:  # 7 tests, the warm-up, round 1, then build\n"
        "        T.extend([0] + list(itertools.accumulate(range(1_700_000))))\n    if n < len(T):\n"
        "        return T[n]\n" + SLOW_LOOP + "    return t\n",
    "the inputs of an earlier judging learnt by heart": "KNOWN = %r\ndef solve(n):\n    if n in KNOWN:\n"
        "        return KNOWN[n]\n" + SLOW_LOOP + "    return t\n",
}


def test_slow_programs_that_game_the_timing_are_never_paid_for_speed(tmp_path):
    """Each game judged through --score-file on sum_range: never credited a speed-up beyond the noise floor (reward
    at most the correct floor 0.15), nothing left behind on the host; the honest slow and fast programs keep their
    status and credit. Before issue 36's fixes the helper process got 48.7x (reward 1.138), a /run/lock cache 180x
    on its second judging (1.155), the memo 1.25x (0.196)."""
    from code_env.tasks import TASKS

    task = TASKS["sum_range"]
    known = {a[0]: sum(range(a[0])) for a in task.timing}  # a judging's inputs: every judging draws new ones
    games = {name: src % known if "%r" in src else src for name, src in GAMES.items()}
    for name, src in games.items():
        for judging in range(2 if "cached" in name else 1):  # a cache must also miss on the next judging
            x = score(tmp_path, src)
            assert x["reward"] <= rlpf.CORRECT_FLOOR and (x["credited_speedup"] or 0) <= 1.0, (name, judging, x)
    left = [f for d in ("/run/lock", "/var/lock", "/tmp", "/dev/shm", "/var/tmp", ROOT) if os.path.isdir(d)
            for f in os.listdir(d) if f.startswith("tp-game-")]  # only the games' own files: others use /tmp too
    assert left == []
    slow, fast = score(tmp_path, task.slow), score(tmp_path, task.fast)
    assert slow["status"] == fast["status"] == "correct" and slow["reward"] == rlpf.CORRECT_FLOOR
    assert fast["credited_speedup"] > 20 and fast["reward"] > 1.0, fast


def test_score_file_command_exits_zero_whatever_the_candidate_does(tmp_path):
    path = tmp_path / "evil.py"
    path.write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos._exit(3)\n")
    r = subprocess.run([sys.executable, "rlpf.py", "--score-file", str(path), "--task", "sum_range"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["status"] in ("no_program", "runtime_error") and line["reward"] <= 0.05


def test_help_documents_every_flag():
    r = subprocess.run([sys.executable, "rlpf.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for name in ("--reward", "--score-file", "--task", "--call-timeout", "--timing-repeats", "--rbr-tolerance"):
        assert name in r.stdout


def test_short_run_trains_and_logs_code_metrics(tmp_path):
    # groups of 8: the warm-started model mixes slow, fast and broken programs, so some group's rewards differ (equal
    # programs get equal rewards now that timing noise earns no credit; a group of 4 was often uniform)
    args = tyro.cli(rlpf.Args, args=["--num-prompts", "2", "--group-size", "8", "--total-steps", "2",
                                     "--tasks", "sum_range", "has_duplicate",
                                     "--eval-samples", "2", "--max-new-tokens", "64", "--output-dir", str(tmp_path),
                                     "--run-name", "smoke", "--timing-repeats", "1"])
    from common.models import load_model
    from grounds.code_model import ensure_code_model

    before = {k: v.clone() for k, v in load_model(ensure_code_model(progress=False)).state_dict().items()}
    out = rlpf.main(args)
    rows = read_metrics(tmp_path / "smoke" / "metrics.jsonl")
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["reward/mean"]) and -0.05 <= r["reward/mean"] <= 1.26
        assert abs(sum(r[f"train/status/{s}"] for s in ("correct",) + FAILURES) - 1) < 1e-9
    assert any(r["adv/frac_zero_std"] < 1 for r in train)  # a group with distinct rewards: the update has a signal
    assert "eval/pass_rate" in out["after"] and "eval/greedy_pass_rate" in out["after"]
    after = load_model(str(tmp_path / "smoke" / "checkpoint")).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    samples = assert_samples(tmp_path / "smoke", ("reward", "status", "speedup", "task"), ("status", "speedup"),
                             steps=[2])
    assert all(r["status"] in ("correct",) + FAILURES for r in samples)
