"""FSDP2 (`--fsdp`) under torchrun, gloo on CPU, 2 processes: the sharded update equals the one-process update on
the same global batch, a sharded checkpoint resumes, the trainers run, and the plain path's bucketed all-reduce."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_released_at_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _failure(r) -> str:
    """What a failed torchrun says: the children's error lines first (torchrun's own summary is last)."""
    errors = [ln for ln in r.stderr.splitlines()  # our one-line errors, and what a child printed as it aborted
              if ("Error" in ln or ln.startswith("error:") or "terminate called" in ln or "what():" in ln)
              and "Warning" not in ln][:20]
    return "\n".join(errors) + "\n...\n" + r.stderr[-2000:]


def _torchrun(*cmd, env=None, timeout=300, nproc=2):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert_released_at_exit(r)
    return r


UPDATE_CHECKED = ["grpo", "rloo_sec", "oc_grpo", "adakp"]  # and mada_rl, below


@pytest.fixture(scope="module")
def update_results(tmp_path_factory, weak_model_dir) -> dict:
    """tests/fsdp_update_check.py for every trainer in UPDATE_CHECKED, in one torchrun launch: trainer -> its ranks'
    results."""
    out = tmp_path_factory.mktemp("fsdp_update") / "out.json"
    trainers = ",".join([*UPDATE_CHECKED, "mada_rl"])
    r = _torchrun("tests/fsdp_update_check.py", trainers, weak_model_dir, str(out))
    assert r.returncode == 0, _failure(r)
    return json.loads(out.read_text())


@pytest.mark.parametrize("trainer", UPDATE_CHECKED)
def test_two_rank_fsdp_update_equals_one_process_update(update_results, trainer):
    """Two optimizer steps (clipping active, AdamW, reference model sharded too) on one global batch of 4 groups of
    4: each rank's half through FSDP2 gives the weights of one unsharded model on the whole batch; each rank holds
    half of the parameters; greedy generation from the sharded model matches the unsharded one. The plain
    data-parallel path (bucketed all-reduce) gives the same weights too. oc_grpo: its context-shift weights from
    hint passes that differ in number between ranks (4 and 8 guided rows, padded) equal the unsharded ones, and a
    guidance cascade with problems on one rank only runs as many generations on the other. adakp: a greedy KP
    selection of 1 KP for one problem on rank 0 and 2 KPs for each of three on rank 1 (entropy-proxy forwards that
    differ in number, padded) picks what the unsharded model picks, with the same scores."""
    for res in update_results[trainer]:
        assert res["moved"] > 1e-4  # the update is large enough for the comparison to mean something
        # AdamW divides by sqrt(v): a weight whose gradient is near 0 turns the summation-order noise of the sharded
        # reduction into a visible step (1.08e-05 of a 2.0e-04 move seen once in CI), so the bound is 10 % of the move
        tol = 0.1 * res["moved"]
        assert res["max_weight_diff"] < tol, res
        assert res["fsdp_grad_norms"] == pytest.approx(res["plain_grad_norms"], rel=1e-5)
        assert min(res["plain_grad_norms"]) > 0.05  # --max-grad-norm 0.05: the clip was active on both steps
        assert abs(res["local_numel"] - res["total_numel"] / 2) < res["total_numel"] * 0.01
        assert res["texts_equal"]
        assert res["bucketed_dp_weight_diff"] < tol  # the plain path, its gradients all-reduced in 64 KB buckets
    if trainer == "oc_grpo":
        rank0, rank1 = update_results[trainer]
        assert (rank0["hint_rows"], rank1["hint_rows"]) == (4, 8)
        assert max(rank0["hint_weight_diff"], rank1["hint_weight_diff"]) < 1e-5
        assert min(rank0["hint_weight_min"], rank1["hint_weight_min"]) < 0.99  # the weights are not all 1
        assert rank0["cascade_generations"] == rank1["cascade_generations"] >= 1
    if trainer == "adakp":
        rank0, rank1 = update_results[trainer]
        assert rank0["kp_equal"] and rank1["kp_equal"] and max(rank0["kp_gain_diff"], rank1["kp_gain_diff"]) < 1e-5
        assert (rank0["kp_chosen"], rank1["kp_chosen"]) == (1, 6) and rank0["kp_rounds"] == rank1["kp_rounds"] == 2


TINY = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0", "--fsdp"]


BF16_KL = ["--dtype", "bfloat16", "--beta", "0.05"]  # bf16 compute on float32 masters; a sharded reference model


def _run(script, tmp_path, *extra, env=None):
    return _torchrun(script, *TINY, *BF16_KL, "--total-steps", "4", "--save-every", "2", "--output-dir",
                     str(tmp_path), *extra, env=env)


def _rows(run_dir) -> dict:
    from common.logger import read_metrics

    return {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r}


def _weights(folder) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()


def test_fsdp_sharded_checkpoint_resumes_to_the_same_metrics_and_exports(tmp_path, weak_model_dir):
    """grpo.py --fsdp on 2 ranks (bf16 compute, a sharded reference model for the KL term; also grpo's torchrun smoke
    run), killed right after the sharded checkpoint of step 2 and resumed from it: steps 3-4 log what an
    uninterrupted run logs, and the consolidated export (from_pretrained) has the same final weights. Each rank wrote
    its own shard files and its own random state; the export's config names the plain model class. The same
    checkpoint also loads on 1 rank (DCP reshards): with no step left to train, the weights it ends with are the
    step-2 export."""
    from common.checkpoint import KILL_AFTER_SAVE

    straight = _run("grpo.py", tmp_path, "--run-name", "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _run("grpo.py", tmp_path, "--run-name", "killed", env={KILL_AFTER_SAVE: "2"})
    assert killed.returncode != 0
    run_dir = tmp_path / "killed"
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["fsdp"] and state["world_size"] == 2
    assert sorted(os.listdir(run_dir / "checkpoint" / "sharded")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    own = [torch.load(run_dir / "checkpoint" / f"rank{r}_state.pt", weights_only=False) for r in (0, 1)]
    assert not torch.equal(own[0]["rng"]["torch"], own[1]["rng"]["torch"]) and own[0]["rng"]["python"] != own[1]["rng"][
        "python"]
    elastic = tmp_path / "elastic"
    shutil.copytree(run_dir, elastic)
    resumed = _run("grpo.py", tmp_path, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _rows(tmp_path / "straight"), _rows(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        for key in [k for k in ref[s] if k.startswith(("reward/", "rollout/", "optim/lr"))]:
            assert got[s][key] == ref[s][key], (s, key)
        assert got[s]["loss/policy"] == pytest.approx(ref[s]["loss/policy"], abs=1e-6), s
        assert got[s]["optim/grad_norm"] == pytest.approx(ref[s]["optim/grad_norm"], rel=1e-5), s
    want, have, start = (_weights(tmp_path / "straight" / "checkpoint"), _weights(run_dir / "checkpoint"),
                         _weights(weak_model_dir))
    assert json.loads((run_dir / "checkpoint" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert max((want[k] - have[k]).abs().max().item() for k in want) < 1e-6
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-5  # training moved the weights

    # the sharded checkpoint needs --fsdp to resume: a one-line error, nothing lost (one process, in this one)
    import grpo
    import tyro

    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="written with --fsdp; resume with it$"):
        grpo.main(tyro.cli(grpo.Args, args=[*TINY[:-1], *BF16_KL, "--total-steps", "6", "--resume", str(run_dir)]))
    assert (run_dir / "metrics.jsonl").read_text() == before
    reshard = subprocess.run([sys.executable, "-c", RESHARD_CHECK, str(elastic / "checkpoint"), weak_model_dir],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert reshard.returncode == 0, reshard.stderr[-3000:]
    res = json.loads(reshard.stdout.strip().splitlines()[-1])
    assert res["max_diff"] == 0.0 and res["params_with_moments"] == res["params"], res
    one = _torchrun("grpo.py", *TINY, *BF16_KL, "--total-steps", "3", "--resume", str(elastic), nproc=1)
    assert one.returncode == 0, _failure(one)
    assert "from step 2 on 1 process(es), saved by 2" in one.stdout
    assert sorted(_rows(elastic)) == [1, 2, 3]
    rewritten = torch.load(elastic / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert rewritten["step"] == 3 and rewritten["world_size"] == 1


RESHARD_CHECK = """
import json, sys, types
import torch
from transformers import AutoModelForCausalLM
from common.checkpoint import load_sharded
from common.dist import full_weights, shard_models
from common.models import load_model
ckpt, base = sys.argv[1:3]
model = load_model(base, "float32", "cpu")  # the untrained weights, sharded over a group of one
shard_models(types.SimpleNamespace(fsdp=True), model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
load_sharded(ckpt, model, optimizer)  # the shards of 2 ranks, resharded by DCP
export = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
diff = max((t - export[k]).abs().max().item() for k, t in full_weights(model) if k in export)
moments = sum(1 for s in optimizer.state.values() if s["exp_avg"].abs().sum() > 0)  # AdamW state from the shards
print(json.dumps({"max_diff": diff, "params_with_moments": moments, "params": len(list(model.parameters()))}))
"""


MADA_TINY = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "6",
             "--num-generators", "2", "--num-critics", "1", "--generator-steps", "1", "--critic-steps", "1",
             "--num-train-problems", "40", "--lora-r", "4"]
SMOKE = {  # trainer: its flags for 2 short steps (rlpf: the code model and its sandbox; direct_opd: teachers given)
    "rloo_sec": [*TINY, "--total-steps", "2", "--no-save-optimizer"],  # weights only: no shards
    "oc_grpo": [*TINY, "--total-steps", "2", "--levels", "4", "--group-size", "4", "--micro-batch-size", "1"],
    "adakp": [*TINY, "--total-steps", "2", "--proxy-batch-size", "2", "--correction", "per_token",
              "--micro-batch-size", "1"],
    "rlpf": ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "24", "--tasks", "sum_range",
             "--eval-samples", "0", "--eval-every", "0", "--timing-repeats", "1", "--fsdp", "--total-steps", "2"],
    "direct_opd": [*TINY, "--total-steps", "2", "--model-name", "WEAK", "--teacher-pre", "WEAK", "--teacher-post",
                   "WEAK"],
    "mada_rl": ["--model-name", "WEAK", *MADA_TINY, "--fsdp"],  # two generators and one critic, a step each
}  # grpo.py: test_fsdp_sharded_checkpoint_resumes_to_the_same_metrics_and_exports; ppo_slm.py: its own check below


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, weak_model_dir) -> dict:
    """Every trainer in SMOKE, by its own main() under torchrun on 2 ranks with --fsdp, all in one launch
    (tests/torchrun_mains.py: one start-up, not six): trainer -> its run folder. No retry: the SIGABRT some ranks met
    at exit ("terminate called without an active exception") was a process group freed during the interpreter's
    teardown, now freed before it (common.dist.release_process_group); `_torchrun` asserts that it was."""
    def launch(folder: str):
        out = tmp_path_factory.mktemp(folder)
        spec = [[name, [weak_model_dir if f == "WEAK" else f for f in flags] + ["--output-dir", str(out),
                                                                                 "--run-name", name], {}]
                for name, flags in SMOKE.items()]
        (out / "spec.json").write_text(json.dumps(spec))
        return _torchrun("tests/torchrun_mains.py", str(out / "spec.json"), timeout=900), out

    r, out = launch("smoke")
    assert r.returncode == 0, _failure(r)
    return {name: out / name for name in SMOKE}


@pytest.mark.parametrize("trainer", [t for t in SMOKE if t != "mada_rl"])
def test_fsdp_smoke_run_under_torchrun(smoke_runs, trainer):
    """2 ranks, --fsdp: 2 steps, metrics logged once, a sharded checkpoint with each rank's shard file and a
    consolidated model.safetensors. direct_opd.py with its reference and both teachers sharded; oc_grpo.py and
    adakp.py with work that differs between ranks (guidance cascade, hint and entropy-proxy passes), padded; rlpf.py
    with its code model and sandbox; rloo_sec.py with --no-save-optimizer: the consolidated weights alone, which
    load as a model and which --resume refuses."""
    rows = _rows(smoke_runs[trainer])
    assert sorted(rows) == [1, 2] and all(torch.isfinite(torch.tensor(x["reward/mean"])) for x in rows.values())
    ckpt = smoke_runs[trainer] / "checkpoint"
    assert os.path.exists(ckpt / "model.safetensors")
    if "--no-save-optimizer" not in SMOKE[trainer]:
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt / "sharded"))
        return
    from common.checkpoint import open_checkpoint
    from common.models import load_model

    assert not os.path.exists(ckpt / "sharded")
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["weights_only"]
    assert sum(p.numel() for p in load_model(str(ckpt)).parameters()) > 0
    with pytest.raises(SystemExit, match="^error: --resume .*weights only"):
        open_checkpoint(str(smoke_runs[trainer]), 0, 1)


def test_mada_rl_two_rank_lora_update_equals_one_process_update(update_results):
    """mada_rl.py's loss on one global batch of 4 groups of 4, the second of three LoRA adapters active, two optimizer
    steps (clipping active): each rank's half through FSDP2 (base and adapters sharded) and through plain data
    parallel gives the weights of one unsharded model on the whole batch; the base and the inactive adapters do not
    move; each rank holds half of the parameters; greedy generation from the sharded model matches with either
    adapter active (tests/fsdp_mada_check.py)."""
    for res in update_results["mada_rl"]:
        assert res["moved_gen1"] > 1e-4 and res["moved_other"] == 0.0
        tol = 0.1 * res["moved_gen1"]  # AdamW and summation order, as above
        assert res["max_weight_diff"] < tol and res["dp_weight_diff"] < tol, res
        assert res["fsdp_grad_norms"] == pytest.approx(res["plain_grad_norms"], rel=1e-5)
        assert min(res["plain_grad_norms"]) > 0.05  # --max-grad-norm 0.05: the clip was active on both steps
        assert abs(res["local_numel"] - res["total_numel"] / 2) < res["total_numel"] * 0.01
        assert res["texts_equal"] == [True, True]


def test_mada_rl_fsdp_smoke_run_saves_adapters_that_reproduce_its_debate(smoke_runs):
    """mada_rl.py, 2 ranks, --fsdp (frozen base and LoRA adapters sharded per decoder layer): two generators and one
    critic of one step each, adapters switched between them on every rank; rank 0 writes the adapters, gathered from
    the shards, and --eval-debate on one process reproduces the run's final held-out debate from them."""
    import tyro
    from safetensors.torch import load_file

    import mada_rl
    from common.logger import read_metrics

    run_dir = smoke_runs["mada_rl"]
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [x["mada/stage"] for x in rows if "reward/mean" in x] == [1, 1, 3]
    assert all(torch.isfinite(torch.tensor(x["reward/mean"])) for x in rows if "reward/mean" in x)
    for name in ("gen0", "gen1", "critic0"):  # full (gathered) tensors, moved by training from B = 0
        weights = load_file(run_dir / "adapters" / name / "adapter_model.safetensors")
        assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 4
        assert max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0, name
    again = mada_rl.main(tyro.cli(mada_rl.Args, args=["--eval-debate", str(run_dir), *MADA_TINY]))["after"]
    final = rows[-1]
    for k in ("mada/eval/single_accuracy", "mada/eval/majority_accuracy", "mada/eval/debate_accuracy"):
        assert again[k] == pytest.approx(final[k]), k


BF16_SHARDS = """
import json, sys, torch, tyro
import grpo
from common.dist import shard_models
from common.models import frozen_copy, load_policy
args = tyro.cli(grpo.Args, args=["--fsdp", "--dtype", "bfloat16"])
model = load_policy(sys.argv[1], args, "cpu")
ref = frozen_copy(model)
model, ref = shard_models(args, model, ref)
ref_dtypes = sorted({str(p.dtype) for p in ref.parameters()})  # (a forward leaves the root's bfloat16 copies in place)
logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
with torch.no_grad():
    same = torch.equal(ref(input_ids=torch.tensor([[5, 6, 7]])).logits, logits)
logits.float().sum().backward()
print(json.dumps({"param": sorted({str(p.dtype) for p in model.parameters()}),
                  "grad": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
                  "ref": ref_dtypes, "logits": str(logits.dtype),
                  "autocast_hooks": hasattr(model, "autocast_contexts"), "ref_equals_policy": same}))
"""


def test_fsdp_bfloat16_keeps_float32_sharded_masters_and_computes_in_bfloat16(weak_model_dir):
    """--fsdp --dtype bfloat16: the sharded parameters and their gradients stay float32 (FSDP2 gathers bfloat16
    copies for compute, no autocast hooks on top); the frozen reference keeps them float32 and computes exactly as
    the policy does (stored in bfloat16, its rotary frequencies put it 0.13 nats away; issue 36) (one process)."""
    r = subprocess.run([sys.executable, "-c", BF16_SHARDS, weak_model_dir], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"param": ["torch.float32"], "grad": ["torch.float32"], "ref": ["torch.float32"],
                   "logits": "torch.bfloat16", "autocast_hooks": False, "ref_equals_policy": True}, out


def test_ppo_slm_fsdp_update_and_rollback_equal_the_plain_path(tmp_path, weak_model_dir):
    """ppo_slm.py on 2 ranks (its smoke run under torchrun: SFT and RM on rank 0, then PPO with the policy, reference
    and reward model sharded), 3 PPO steps with --fsdp and without (same stages and seeds;
    tests/ppo_slm_fsdp_check.py): an inf written into rank 0's shard of one LoRA weight after step 2 is seen by both
    ranks and rolled back (weights and AdamW state), and the final LoRA adapters and value heads agree within 1e-5
    (the value head gathered whole); each rank held half of the
    policy's parameters (the frozen base too)."""
    from safetensors.torch import load_file

    out = tmp_path / "out.json"
    r = _torchrun("tests/ppo_slm_fsdp_check.py", weak_model_dir, str(tmp_path), str(out))
    assert r.returncode == 0, _failure(r)
    res = json.loads(out.read_text())
    for name in ("fsdp", "plain"):
        assert [row["safety/rollbacks"] for row in res[name]["rows"]] == [0, 1, 1] and res[name]["rollbacks"] == 1
    for a, b in zip(res["fsdp"]["rows"], res["plain"]["rows"]):
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
        assert a["loss/value"] == pytest.approx(b["loss/value"], rel=1e-5, abs=1e-7)
    held = res["fsdp"]["held"]
    assert abs(held["local"] - held["total"] / 2) < held["total"] * 0.01
    adapters = [load_file(os.path.join(res[n]["run_dir"], "ppo_adapter", "adapter_model.safetensors"))
                for n in ("fsdp", "plain")]
    assert max((adapters[0][k] - adapters[1][k]).abs().max().item() for k in adapters[1]) < 1e-5
    assert max(t.abs().max().item() for k, t in adapters[1].items() if "lora_B" in k) > 1e-4  # B = 0 has moved
    heads = [torch.load(os.path.join(res[n]["run_dir"], "ppo_adapter", "value_head.pt")) for n in ("fsdp", "plain")]
    assert all((heads[0][k] - heads[1][k]).abs().max().item() < 1e-5 for k in heads[1])
    hidden = json.loads((Path(weak_model_dir) / "config.json").read_text())["hidden_size"]
    assert heads[0]["weight"].shape == (1, hidden)  # gathered whole to rank 0 under --fsdp, not its shard


def test_each_rank_releases_its_process_group_when_it_exits(tmp_path):
    """init_distributed registers the release of the process group at exit, without a barrier: rank 1 exits while
    rank 0 still works, and both find the group destroyed in their last exit handler. Left to the interpreter's
    teardown, gloo's threads sometimes aborted a finished rank (SIGABRT, about 1 run in 15 under load)."""
    script = tmp_path / "exit_check.py"
    script.write_text(f"""
import atexit, json, os, sys, time
sys.path.insert(0, {ROOT!r})
import torch
import torch.distributed as dist
from common.dist import init_distributed
rank = int(os.environ["RANK"])
out = {str(tmp_path)!r} + f"/rank{{rank}}.json"
atexit.register(lambda: json.dump({{"initialized_at_exit": dist.is_initialized()}}, open(out, "w")))  # runs last
init_distributed("cpu")
x = torch.ones(4)
dist.all_reduce(x)
if rank == 0:
    time.sleep(1.0)  # rank 1 reaches its exit first
""")
    r = _torchrun(str(script))
    assert r.returncode == 0, _failure(r)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"initialized_at_exit": False}


KEPT_PAST_EXIT = """
import sys, types, torch
from common.dist import shard_models
from common.models import load_model
(MODEL,) = shard_models(types.SimpleNamespace(fsdp=True, dtype="float32"), load_model(sys.argv[1]))
MODEL(torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
"""


def test_a_sharded_model_alive_at_exit_still_frees_the_group(tiny_model_dir):
    """A --fsdp model still referenced when the interpreter exits (here a global; in CI once, a decoder layer's FSDP
    unit that outlived main()) holds the group through each unit's mesh info: the exit hook drops those handles too,
    so gloo's threads end before teardown (before, this printed the "[dist] ... still running" line)."""
    r = subprocess.run([sys.executable, "-c", KEPT_PAST_EXIT, tiny_model_dir], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    assert_released_at_exit(r)


def test_two_ranks_share_the_evaluation_and_sum_losses_and_statistics(tmp_path, weak_model_dir):
    """Under torchrun each rank evaluates half of the held-out problems (greedy and sampled) and both get the whole
    set's accuracy, equal to one process's greedy pass; loss/* metrics are the union batch's (each rank's share
    summed, not averaged), per-token statistics are divided by all ranks' tokens, and --adv-norm batch_std's std
    pools the ranks' rewards (tests/dist_metrics_check.py)."""
    out = tmp_path / "dist.json"
    r = _torchrun("tests/dist_metrics_check.py", weak_model_dir, str(out))
    assert r.returncode == 0, _failure(r)
    ranks = [json.loads((tmp_path / f"dist.json.rank{k}").read_text()) for k in (0, 1)]
    for got in ranks:
        assert got["asked"] == [7, 7]  # its share of 14, once greedy and once sampled: not all 14
        assert got["eval"]["eval/greedy_accuracy"] == pytest.approx(got["want_greedy"])
        for lv, acc in got["want_levels"].items():
            assert got["eval"][f"eval/greedy_accuracy/level_{lv}"] == pytest.approx(acc), lv
        assert 0 <= got["eval"]["eval/sampled_accuracy"] <= got["eval"]["eval/pass_at_k"] <= 1
        assert got["metrics"]["loss/policy"] == pytest.approx((1 + 2) / 2)  # shares 1 and 2 summed, over 2 steps
        assert got["metrics"]["policy/entropy"] == pytest.approx((10 + 20) / (1 + 2))
        assert got["std"] == pytest.approx(torch.tensor([1.0, 2, 3, 4, 5]).std(unbiased=False).item())
    assert ranks[0]["eval"] == ranks[1]["eval"]


SLOW_RANK = """
import sys, time, torch.distributed as dist
from common.dist import init_distributed
rank, world, _ = init_distributed("cpu", timeout_minutes=float(sys.argv[1]))
if rank == 0:
    time.sleep(float(sys.argv[2]))  # rank 0 works alone (ppo_slm.py's SFT and reward model), the other waits
dist.barrier()
print("both ranks passed the barrier")
"""


def test_the_process_group_timeout_is_the_flags(tmp_path):
    """init_distributed passes --dist-timeout-minutes to the process group: with 3 s, the rank that waits while the
    other works 5 s fails at the barrier, and with 1 minute it waits; the trainers' default waits hours (NCCL's own
    default is 10 minutes)."""
    import grpo
    import ppo_slm

    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK)
    r = _torchrun(str(script), "0.05", "5", env={"PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode != 0 and "both ranks passed" not in r.stdout
    assert "timed out" in r.stderr.lower() or "timeout" in r.stderr.lower(), r.stderr[-2000:]
    ok = _torchrun(str(script), "1", "4", env={"PYTHONPATH": ROOT}, timeout=120)
    assert ok.returncode == 0 and ok.stdout.count("both ranks passed") == 2, _failure(ok)
    assert grpo.Args().dist_timeout_minutes >= 60 and ppo_slm.Args().dist_timeout_minutes >= 60
