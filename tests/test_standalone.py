"""A fork of one trainer works with only what its docs page says a fork copies (docs/<trainer>.md, "**Fork**": the
trainer and common/, plus code_env/, ppo_slm_stages.py or mada_rl_agents.py where it needs them; never grounds/,
which a trainer imports only for an embedded model name). Copied alone into an empty folder, each trainer answers
--help without loading torch (the flags parse first: --help and a flag error answer in a fraction of a second), and
runs one step on a local model folder."""

import json
import os
import subprocess
import sys

import pytest
from conftest import alone_env

TRAINERS = ["grpo.py", "rloo_sec.py", "oc_grpo.py", "direct_opd.py", "ppo_slm.py", "adakp.py", "mada_rl.py", "rlpf.py"]
GROUP = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "2",
         "--eval-every", "0", "--log-samples", "0", "--total-steps", "1"]
ONE_STEP = {  # the least each trainer needs for one step on the tiny local model (MODEL: its folder)
    "grpo.py": [*GROUP, "--eval-samples", "0"],
    "rloo_sec.py": [*GROUP, "--eval-samples", "0"],
    "oc_grpo.py": [*GROUP, "--eval-samples", "0", "--prefix-fractions", "1.0"],
    "adakp.py": [*GROUP, "--eval-samples", "0"],
    "direct_opd.py": [*GROUP, "--eval-samples", "0", "--teacher-pre", "MODEL", "--teacher-post", "MODEL"],
    "mada_rl.py": ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "2",
                   "--log-samples", "0", "--num-generators", "1", "--num-critics", "1", "--generator-steps", "1",
                   "--critic-steps", "1", "--num-train-problems", "8", "--lora-r", "2"],
    "rlpf.py": ["--num-prompts", "1", "--group-size", "2", "--max-new-tokens", "8", "--eval-samples", "0",
                "--eval-every", "0", "--log-samples", "0", "--total-steps", "1", "--tasks", "sum_range",
                "--timing-repeats", "1", "--calibration-scorings", "1"],
    "ppo_slm.py": ["--num-train-examples", "16", "--num-eval-pairs", "4", "--num-eval-prompts", "4", "--num-prompts",
                   "4", "--minibatch-size", "4", "--max-new-tokens", "4", "--sft-steps", "1", "--sft-batch-size", "4",
                   "--rm-steps", "1", "--rm-batch-size", "4", "--total-steps", "1", "--log-samples", "0"],
}


@pytest.mark.parametrize("script", TRAINERS)
def test_a_fork_with_what_its_docs_say_answers_help_and_runs_a_step_on_a_local_model(copy_alone, tiny_model_dir,
                                                                                     tmp_path, script):
    folder = copy_alone(script)
    assert not os.path.exists(os.path.join(folder, "grounds"))
    r = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=folder, env=alone_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--seed" in r.stdout and "--total-steps" in r.stdout
    loaded = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dataclasses" in loaded and not {"torch", "numpy", "transformers"} & loaded
    flags = [tiny_model_dir if f == "MODEL" else f for f in ONE_STEP[script]]
    r = subprocess.run([sys.executable, script, "--model-name", tiny_model_dir, *flags, "--output-dir", str(tmp_path),
                        "--run-name", "fork"], cwd=folder, env=alone_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "fork" / "metrics.jsonl") as f:
        steps = [row["step"] for row in map(json.loads, f) if "reward/mean" in row]
    assert steps and steps[0] == 1, steps
