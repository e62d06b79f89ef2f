"""The commands the README and the docs pages give are read by their trainer's flag parser: each indented
`python <trainer>.py ...` or `torchrun ... <trainer>.py ...` line (continuation lines joined, a trailing comment
dropped), so a renamed or mistyped flag in the docs fails here rather than in a reader's shell."""

import glob
import importlib
import os
import re
import shlex

import pytest
import tyro

from conftest import ROOT

TRAINERS = ("grpo", "oc_grpo", "rloo_sec", "adakp", "mada_rl", "direct_opd", "rlpf", "ppo_slm")
COMMAND = re.compile(r"^ {4,}(?:\S+=\S+\s+)*(?:\S*python3?|torchrun(?:\s+--[\w-]+(?:[ =]\S+)?)*)\s+(\w+)\.py\b(.*)$")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(file, trainer, flags) of every trainer command in an indented block of README.md and docs/*.md."""
    found = []
    for path in ["README.md", *sorted(glob.glob(os.path.join("docs", "*.md"), root_dir=ROOT))]:
        text = open(os.path.join(ROOT, path)).read().replace("\\\n", " ")
        for line in text.splitlines():
            m = COMMAND.match(line)
            if m and m.group(1) in TRAINERS:
                flags = re.split(r"\s{2,}#|\s#\s", m.group(2))[0]
                found.append((path, m.group(1), shlex.split(flags)))
    return found


COMMANDS = documented_commands()


def test_the_docs_give_a_command_for_every_trainer_and_on_smollm2():
    assert {t for _, t, _ in COMMANDS} == set(TRAINERS)
    on_smollm2 = {t for _, t, flags in COMMANDS if "smollm2-135m-instruct" in flags}
    assert on_smollm2 == set(TRAINERS), set(TRAINERS) - on_smollm2  # a copy-paste SmolLM2 command on every page


@pytest.mark.parametrize("path,trainer,flags", COMMANDS, ids=[f"{p}:{t}:{i}" for i, (p, t, _) in enumerate(COMMANDS)])
def test_a_documented_command_parses(path, trainer, flags):
    assert "..." not in flags, f"{path}: an elided command cannot be pasted: python {trainer}.py {shlex.join(flags)}"
    if "--help" in flags:
        return
    tyro.cli(importlib.import_module(trainer).Args, args=flags)  # a flag the trainer lacks: SystemExit here
