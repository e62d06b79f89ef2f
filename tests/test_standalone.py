"""Every trainer runs with only what it imports of this project beside it (common/, and grounds/, code_env/ or
ppo_slm_stages.py where it uses them): copied alone into an empty folder, its --help works (a real short
run of grpo.py and direct_opd.py from such a folder is in test_grpo.py and test_direct_opd.py)."""

import subprocess
import sys

import pytest
from conftest import alone_env

TRAINERS = ["grpo.py", "rloo_sec.py", "oc_grpo.py", "direct_opd.py", "ppo_slm.py", "adakp.py", "mada_rl.py", "rlpf.py"]


@pytest.mark.parametrize("script", TRAINERS)
def test_trainer_copied_alone_with_what_it_imports_shows_its_help(copy_alone, script):
    folder = copy_alone(script)
    r = subprocess.run([sys.executable, script, "--help"], cwd=folder, env=alone_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--seed" in r.stdout and "--total-steps" in r.stdout
