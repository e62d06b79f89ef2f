"""FSDP2 (`--fsdp`) under torchrun, gloo on CPU, 2 processes: the sharded update equals the one-process update on
the same global batch, a sharded checkpoint resumes, the trainers run, and the plain path's bucketed all-reduce."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(*cmd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *cmd], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("trainer", ["grpo", "rloo_sec"])
def test_two_rank_fsdp_update_equals_one_process_update(tmp_path, weak_model_dir, trainer):
    """Two optimizer steps (clipping active, AdamW, reference model sharded too) on one global batch of 4 groups of
    4: each rank's half through FSDP2 gives the weights of one unsharded model on the whole batch; each rank holds
    half of the parameters; greedy generation from the sharded model matches the unsharded one."""
    out = tmp_path / "out.json"
    r = _torchrun("tests/fsdp_update_check.py", trainer, weak_model_dir, str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    for res in json.loads(out.read_text()):
        assert res["moved"] > 1e-4  # the update is large enough for the comparison to mean something
        assert res["max_weight_diff"] < 1e-5, res
        assert res["fsdp_grad_norms"] == pytest.approx(res["plain_grad_norms"], rel=1e-5)
        assert min(res["plain_grad_norms"]) > 0.05  # --max-grad-norm 0.05: the clip was active on both steps
        assert abs(res["local_numel"] - res["total_numel"] / 2) < res["total_numel"] * 0.01
        assert res["texts_equal"]
