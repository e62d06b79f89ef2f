"""Every trainer runs with only what it imports of this project beside it (common/, and grounds/, code_env/ or
ppo_slm_stages.py where it uses them): copied alone into an empty folder, it imports and its --help works, without
loading torch (the flags parse first: --help and a flag error answer in a fraction of a second). A real short run of
grpo.py and direct_opd.py from such a folder is in test_grpo.py and test_direct_opd.py."""

import subprocess
import sys

import pytest
from conftest import alone_env

TRAINERS = ["grpo.py", "rloo_sec.py", "oc_grpo.py", "direct_opd.py", "ppo_slm.py", "adakp.py", "mada_rl.py", "rlpf.py"]


@pytest.mark.parametrize("script", TRAINERS)
def test_trainer_copied_alone_with_what_it_imports_shows_its_help(copy_alone, script):
    folder = copy_alone(script)
    r = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=folder, env=alone_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--seed" in r.stdout and "--total-steps" in r.stdout
    loaded = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dataclasses" in loaded and not {"torch", "numpy", "transformers"} & loaded
    r = subprocess.run([sys.executable, "-c", f"import {script[:-3]}"], cwd=folder, env=alone_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]  # everything it imports below its Args is there too
