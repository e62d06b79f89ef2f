"""Shared trainer plumbing: resume (single process and torchrun, each rank its own RNG and data stream), the
learning-rate warmup counted in optimizer steps, and one-line errors for bad --resume folders and contradicting
flags, with nothing already written in the run folder lost."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import tyro
from conftest import assert_released_at_exit

import direct_opd
import grpo
import oc_grpo
import rloo_sec
from common.checkpoint import KILL_AFTER_SAVE
from common.manifest import write_manifest
from common.data import load_problems
from common.logger import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0"]


def _rows(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r}


ADAKP = ["--num-train-problems", "4", "--reselect-every", "1", "--probe", "rollout"]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory, weak_model_dir):
    """rloo_sec.py and adakp.py on 2 processes (gloo, the plain data-parallel path), each run straight to step 4,
    killed right after the checkpoint of step 2, and resumed from it: three launches of tests/torchrun_mains.py
    (each ends at its kill), not six. Returns the folder with the runs `<trainer>_straight`, `<trainer>_killed`, and
    `grpo_fsdp` (2 steps under --fsdp: a sharded checkpoint)."""
    out = tmp_path_factory.mktemp("torchrun_resume")
    kill = {KILL_AFTER_SAVE: "2"}

    def run(trainer, name, *extra):
        flags = ["--model-name", weak_model_dir, *TINY, "--total-steps", "4", "--save-every", "2", "--output-dir",
                 str(out), "--run-name", f"{trainer}_{name}", *(ADAKP if trainer == "adakp" else []), *extra]
        return [trainer, flags, kill if name == "killed" and not extra else {}]

    def launch(*runs):
        (out / "spec.json").write_text(json.dumps(runs))
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "tests/torchrun_mains.py", str(out / "spec.json")], cwd=ROOT, capture_output=True,
                           text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert_released_at_exit(r)
        return r

    fsdp = ["grpo", ["--model-name", weak_model_dir, *TINY, "--total-steps", "2", "--fsdp", "--output-dir", str(out),
                     "--run-name", "grpo_fsdp"], {}]
    first = launch(run("rloo_sec", "straight"), run("adakp", "straight"), fsdp, run("adakp", "killed"))
    assert first.returncode != 0 and "run finished: adakp" in first.stdout, first.stderr[-3000:]  # killed last
    assert launch(run("rloo_sec", "killed")).returncode != 0
    resumed = launch(*[run(t, "killed", "--resume", str(out / f"{t}_killed")) for t in ("rloo_sec", "adakp")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out


def _next_draws(own: dict) -> list:
    """The problems rloo_sec draws at the next step from a rank's saved sampler (the curriculum with its saved
    random stream)."""
    args = tyro.cli(rloo_sec.Args, args=[])
    problems = load_problems("testbed", "train", args.levels, 0, 1)
    cur = rloo_sec.make_curriculum(problems, args, 0)
    cur.load_state_dict(own["sampler"])
    probs = rloo_sec.arm_probs(cur.q, [len(a) for a in cur.arms], args.sec_tau)
    return [p.uid for p in rloo_sec.sample_batch(cur, problems, 2, probs)[1]]


def test_torchrun_resume_continues_each_ranks_own_stream(torchrun_runs):
    """rloo_sec.py on 2 processes (gloo), the plain data-parallel path (grpo.py: with --fsdp, in test_fsdp.py): both
    ranks train and rank 0 logs each step once; killed right after the checkpoint of step 2 and resumed, the run logs
    the same steps 3-4 as an uninterrupted one; each rank saved and restored its own state (its curriculum's
    generator), and the ranks draw different problems."""
    straight, run_dir = torchrun_runs / "rloo_sec_straight", torchrun_runs / "rloo_sec_killed"
    steps = [x["step"] for x in read_metrics(straight / "metrics.jsonl") if "reward/mean" in x]
    assert steps == [1, 2, 3, 4]  # logged once, by rank 0
    trained = _rows(straight).values()
    assert all(0.0 <= x["reward/mean"] <= 1.0 for x in trained) and any(x["optim/grad_norm"] > 0 for x in trained)
    ref, got = _rows(straight), _rows(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        keys = [k for k in ref[s] if k.startswith(("reward/", "rollout/", "optim/lr", "sec/q/", "sec/level_frac/"))]
        for key in keys:
            assert got[s][key] == ref[s][key], (s, key)
        assert got[s]["loss/policy"] == pytest.approx(ref[s]["loss/policy"], abs=1e-6), s
        assert got[s]["optim/grad_norm"] == pytest.approx(ref[s]["optim/grad_norm"], rel=1e-5), s
    # each rank's own state, and the problems each rank draws next from it
    own = [torch.load(run_dir / "checkpoint" / f"rank{r}_state.pt", weights_only=False) for r in (0, 1)]
    assert not torch.equal(own[0]["rng"]["torch"], own[1]["rng"]["torch"])
    assert own[0]["rng"]["python"] != own[1]["rng"]["python"]
    assert _next_draws(own[0]) != _next_draws(own[1])


def test_adakp_torchrun_resume_restores_each_ranks_knowledge_point_state(torchrun_runs):
    """adakp.py on 2 processes: each rank keeps the KP selections, budgets and probe cache of the problems it drew,
    saved in its own rank file; killed after step 2 and resumed, steps 3-4 log what an uninterrupted run logs."""
    run_dir = torchrun_runs / "adakp_killed"
    own = [torch.load(run_dir / "checkpoint" / f"rank{r}_state.pt", weights_only=False) for r in (0, 1)]
    assert "kp" in own[0] and "kp" in own[1] and "probe_cache" in own[1]
    assert "kp" not in torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)
    ref, got = _rows(torchrun_runs / "adakp_straight"), _rows(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        for key in [k for k in ref[s] if k.startswith(("reward/", "kp/", "rollout/completion_len"))]:
            assert got[s][key] == ref[s][key], (s, key)


def test_a_sharded_checkpoint_has_the_checksum_of_every_shard_and_resume_names_a_corrupted_one(torchrun_runs,
                                                                                               tmp_path):
    """An --fsdp checkpoint's manifest lists every rank's shard file with the rest; 4 KiB changed inside rank 1's
    shard stops --resume with one line naming that file (tests/test_checkpoint_faults.py: the plain checkpoint)."""
    from common.checkpoint import open_checkpoint

    run_dir = str(tmp_path / "run")
    shutil.copytree(torchrun_runs / "grpo_fsdp", run_dir)
    ckpt = os.path.join(run_dir, "checkpoint")
    listed = set(json.loads(open(os.path.join(ckpt, "manifest.json")).read())["files"])
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "model.safetensors",
            "trainer_state.pt", "rank0_state.pt", "rank1_state.pt"} <= listed
    assert open_checkpoint(run_dir, 1, 2)["state"]["fsdp"]
    shard = os.path.join(ckpt, "sharded", "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 4096)
    with pytest.raises(SystemExit) as e:
        open_checkpoint(run_dir, 1, 2)
    assert str(e.value.code) == (f"error: --resume {run_dir}: {shard} is corrupt (its sha256 differs from the one "
                                 "saved with it)")


@pytest.mark.parametrize("trainer", ["grpo", "rloo_sec"])  # rloo_sec: a curriculum sampler with its own generator
def test_a_different_world_size_resumes_with_new_streams(tmp_path, tiny_model_dir, capsys, trainer):
    """A checkpoint written by 2 processes resumes on 1 (FSDP2 shards in test_fsdp.py): weights, optimizer and
    schedule are restored, rank r continues from saved rank r % 2's sampler state (grpo's prompt order, rloo_sec's
    curriculum), with new random streams, as the resume line says."""
    import importlib

    module = importlib.import_module(trainer)
    flags = [*TINY, "--model-name", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "run"]
    run_dir = module.main(tyro.cli(module.Args, args=[*flags, "--total-steps", "2"]))["run_dir"]
    state_path = os.path.join(run_dir, "checkpoint", "trainer_state.pt")
    torch.save({**torch.load(state_path, weights_only=False), "world_size": 2}, state_path)
    write_manifest(os.path.dirname(state_path), 2)  # as 2 processes would have saved it (its checksums match)
    saved = torch.load(os.path.join(run_dir, "checkpoint", "rank0_state.pt"), weights_only=False)
    capsys.readouterr()
    module.main(tyro.cli(module.Args, args=[*flags, "--resume", run_dir, "--total-steps", "3"]))
    assert "from step 2 on 1 process(es), saved by 2: weights, optimizer and schedule restored" in capsys.readouterr().out
    assert sorted(_rows(run_dir)) == [1, 2, 3]
    own = torch.load(os.path.join(run_dir, "checkpoint", "rank0_state.pt"), weights_only=False)
    if trainer == "grpo":  # saved rank 0's place in the data, one step on
        assert own["sampler"] == {"epoch": saved["sampler"]["epoch"], "pos": saved["sampler"]["pos"] + 2}
    else:  # the curriculum's state (its own kind of sampler) carried over and one more feedback step counted
        assert own["sampler"]["steps"] == saved["sampler"]["steps"] + 1


@pytest.mark.parametrize("trainer", ["grpo", "rloo_sec", "oc_grpo", "direct_opd"])
def test_warmup_counts_optimizer_steps(tmp_path, tiny_model_dir, trainer):
    """Two mini-batches per step and --warmup-steps 4: optimizer steps use 1/4, 2/4 | 3/4, 4/4 | 1, 1 of the peak;
    optim/lr is the rate of the step's last update. (The random tiny model earns no reward: with --beta 0 every
    update could be skipped (--skip-zero-advantage-steps); the KL term keeps a gradient.)"""
    module = {"grpo": grpo, "rloo_sec": rloo_sec, "oc_grpo": oc_grpo, "direct_opd": direct_opd}[trainer]
    extra = (["--teacher-pre", tiny_model_dir, "--teacher-post", tiny_model_dir] if trainer == "direct_opd"
             else ["--beta", "0.01"])
    args = tyro.cli(module.Args, args=["--output-dir", str(tmp_path), *TINY, "--model-name", tiny_model_dir, *extra,
                                       "--num-minibatches", "2", "--warmup-steps", "4", "--learning-rate", "1e-3",
                                       "--total-steps", "3", "--run-name", "warm", "--levels", "1"])
    out = module.main(args)
    rows = _rows(out["run_dir"])
    assert [rows[s]["optim/lr"] for s in (1, 2, 3)] == pytest.approx([0.5e-3, 1e-3, 1e-3], rel=1e-12)
    assert all(rows[s].get("update/skipped", 0) == 0 for s in (1, 2, 3))


# ----------------------------------------------------------------------------------------
# bad input: --resume folders and contradicting flags
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("finished")
    out = grpo.main(tyro.cli(grpo.Args, args=["--output-dir", str(tmp), *TINY, "--model-name", tiny_model_dir,
                                              "--total-steps", "2", "--save-every", "1", "--run-name", "done"]))
    return out["run_dir"]


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """A model with the same tokenizer and other shapes than tiny_model_dir's: its weights do not fit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grounds.testbed_models import build_tokenizer

    path, tok = str(tmp_path_factory.mktemp("wider")), build_tokenizer()
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _break(run_dir, how: str) -> None:
    ckpt = os.path.join(run_dir, "checkpoint")
    if how == "no_checkpoint":
        shutil.rmtree(ckpt)
    elif how == "empty_state":
        open(os.path.join(ckpt, "trainer_state.pt"), "wb").close()
    elif how == "truncated_state":
        path = os.path.join(ckpt, "trainer_state.pt")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif how == "no_weights":
        os.remove(os.path.join(ckpt, "model.safetensors"))
    elif how == "truncated_weights":
        path = os.path.join(ckpt, "model.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) - 1000])
    elif how == "no_rank_state":
        os.remove(os.path.join(ckpt, "rank0_state.pt"))
    elif how == "bad_metrics_line":
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write("{not json\n{\"step\": 9}\n")


@pytest.mark.parametrize("how, message", [
    ("missing_folder", r"no such folder"),
    ("no_checkpoint", r"no checkpoint in that folder"),
    ("empty_state", r"trainer_state.pt is truncated or corrupt"),
    ("truncated_state", r"trainer_state.pt is truncated or corrupt"),
    ("no_weights", r"model.safetensors is missing"),
    ("truncated_weights", r"model.safetensors is truncated or corrupt"),
    ("no_rank_state", r"rank0_state.pt is missing"),
    ("other_model", r"does not fit this run"),
    ("bad_metrics_line", r"metrics.jsonl line \d+ is not a metrics row"),
])
def test_bad_resume_folder_is_one_line_error_and_loses_nothing(tmp_path, finished_run, tiny_model_dir, wider_model_dir,
                                                               how, message):
    run_dir = str(tmp_path / "run")
    if how == "missing_folder":
        run_dir = str(tmp_path / "nowhere")
    else:
        shutil.copytree(finished_run, run_dir)
        _break(run_dir, how)
    before = {f: open(os.path.join(run_dir, f), "rb").read() for f in ("metrics.jsonl", "args.json")
              if os.path.exists(os.path.join(run_dir, f))}
    model = ["--model-name", wider_model_dir if how == "other_model" else tiny_model_dir]
    with pytest.raises(SystemExit) as e:
        grpo.main(tyro.cli(grpo.Args, args=[*TINY, *model, "--total-steps", "4", "--resume", run_dir]))
    text = str(e.value.code)
    assert text.startswith(f"error: --resume {run_dir}: ") and "\n" not in text, text
    assert re.search(message, text), text
    after = {f: open(os.path.join(run_dir, f), "rb").read() for f in before}
    assert after == before


def test_resume_keeps_args_json_and_skips_a_row_cut_short_by_a_crash(tmp_path, finished_run, tiny_model_dir, capsys):
    run_dir = str(tmp_path / "run")
    shutil.copytree(finished_run, run_dir)
    args_before = open(os.path.join(run_dir, "args.json")).read()
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "reward/me')  # a kill in the middle of a write
    grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", tiny_model_dir, "--total-steps", "3",
                                        "--resume", run_dir]))
    assert sorted(_rows(run_dir)) == [1, 2, 3]
    assert open(os.path.join(run_dir, "args.json")).read() == args_before
    assert "total_steps 2 -> 3" in capsys.readouterr().out


CONTRADICTIONS = [  # (trainer, flags, message); the model does not exist: the flags must be checked first
    ("grpo", ["--tis", "token"], r"--tis token corrects a separate sampler's mismatch"),
    ("grpo", ["--num-minibatches", "3"], r"--num-minibatches 3 does not divide the batch of 4"),
    ("grpo", ["--group-size", "1"], r"--group-size 1 must be at least 2"),
    ("grpo", ["--eval-samples", "2", "--eval-pass-k", "4"], r"--eval-pass-k 4 is larger than --eval-samples 2"),
    ("grpo", ["--micro-batch-size", "0"], r"--micro-batch-size 0 must be at least 1"),
    ("grpo", ["--share-prompt", "--gradient-checkpointing"], r"--share-prompt cannot share under --gradient-che"),
    ("rloo_sec", ["--group-size", "1"], r"--group-size 1 must be at least 2"),
    ("rloo_sec", ["--eval-samples", "2", "--eval-pass-k", "3"], r"--eval-pass-k 3 is larger than --eval-samples 2"),
    ("oc_grpo", ["--num-minibatches", "3"], r"--num-minibatches 3 does not divide"),
    ("direct_opd", ["--reward", "direct_plus_grpo", "--group-size", "1"], r"--group-size 1 must be at least 2"),
    ("direct_opd", ["--num-minibatches", "3"], r"--num-minibatches 3 does not divide"),
    ("grpo", ["--temperature", "0"], r"--temperature 0.0 must be above 0"),
    ("rloo_sec", ["--top-p", "0"], r"--top-p 0.0 must be in \(0, 1\]"),
    ("oc_grpo", ["--max-new-tokens", "0"], r"--max-new-tokens 0 must be at least 1"),
    ("direct_opd", ["--temperature", "-1"], r"--temperature -1.0 must be above 0"),
]


@pytest.mark.parametrize("trainer, flags, message", CONTRADICTIONS)
def test_contradicting_flags_fail_before_any_work(tmp_path, trainer, flags, message):
    module = {"grpo": grpo, "rloo_sec": rloo_sec, "oc_grpo": oc_grpo, "direct_opd": direct_opd}[trainer]
    missing = str(tmp_path / "no-model")
    args = tyro.cli(module.Args, args=["--output-dir", str(tmp_path), *TINY, "--model-name", missing, *flags])
    with pytest.raises(SystemExit, match="^error: " + message) as e:
        module.main(args)
    assert "\n" not in str(e.value.code)
    assert os.listdir(tmp_path) == []  # no run folder was created


def test_a_weights_only_checkpoint_loads_as_a_model_and_is_refused_by_resume(tmp_path, tiny_model_dir):
    """--no-save-optimizer: the checkpoint keeps the weights (they load with from_pretrained) but not AdamW's
    moments; --resume refuses it in one line, losing nothing."""
    from transformers import AutoModelForCausalLM

    out = grpo.main(tyro.cli(grpo.Args, args=["--output-dir", str(tmp_path), *TINY, "--model-name", tiny_model_dir,
                                              "--total-steps", "1", "--run-name", "light", "--no-save-optimizer",
                                              "--beta", "0.01"]))  # an update, so AdamW has moments to leave out
    light = os.path.join(out["run_dir"], "checkpoint")
    size = lambda f: os.path.getsize(os.path.join(light, f))  # noqa: E731
    assert size("trainer_state.pt") < 0.05 * size("model.safetensors")  # AdamW's moments are twice the weights
    state = torch.load(os.path.join(light, "trainer_state.pt"), weights_only=False)
    assert state["optimizer"] is None and state["weights_only"]
    AutoModelForCausalLM.from_pretrained(light)
    before = open(os.path.join(out["run_dir"], "metrics.jsonl")).read()
    with pytest.raises(SystemExit, match=r"holds weights only \(--no-save-optimizer\)") as e:
        grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", tiny_model_dir, "--total-steps", "2",
                                            "--resume", out["run_dir"]]))
    assert "\n" not in str(e.value)
    assert open(os.path.join(out["run_dir"], "metrics.jsonl")).read() == before


def test_resume_from_the_command_line_takes_the_runs_flags_and_refuses_a_new_evaluation_set(tmp_path):
    """`--resume runs/x --total-steps 80` (issue 58): every flag not given comes from runs/x/args.json, so the resumed
    steps are evaluated on the first steps' problems (before: the defaults, 200 problems after 40, one curve mixing
    two sets); a given flag that changes the evaluation set is a one-line error unless --new-eval-set."""
    import dataclasses
    import json

    import grpo
    from common.args import cli

    run_dir = tmp_path / "x"
    run_dir.mkdir()
    first = cli(grpo.Args, ["--num-eval-problems", "40", "--eval-every", "20", "--levels", "2", "3",
                            "--learning-rate", "1e-4", "--total-steps", "60"])
    (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(first)))
    resumed = cli(grpo.Args, ["--resume", str(run_dir), "--total-steps", "80"])
    assert (resumed.num_eval_problems, resumed.eval_every, resumed.levels, resumed.learning_rate) == (40, 20, (2, 3),
                                                                                                     1e-4)
    assert resumed.total_steps == 80 and resumed.resume == str(run_dir)
    assert cli(grpo.Args, ["--total-steps", "80"]).num_eval_problems == 200  # a new run: the defaults
    with pytest.raises(SystemExit, match=r"^error: --resume .*: --num-eval-problems 200 \(the run had 40\) would "
                                         r"change the held-out evaluation set mid-run; drop the flag, or add "
                                         r"--new-eval-set$"):
        cli(grpo.Args, ["--resume", str(run_dir), "--num-eval-problems", "200"])
    assert cli(grpo.Args, ["--resume", str(run_dir), "--num-eval-problems", "200",
                           "--new-eval-set"]).num_eval_problems == 200
    assert cli(grpo.Args, ["--resume", str(run_dir), "--eval-every", "10"]).eval_every == 10  # the same set, more often
