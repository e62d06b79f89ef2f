"""Run under `torchrun --nproc-per-node 2`: trainers' own `main()`, one after another in one launch (one process
group and one start-up for all of them, instead of one each), as SPEC.json lists them: [module, [flags...], {env}]
per run, the environment variables set for that run only (e.g. common.checkpoint.KILL_AFTER_SAVE, which ends the
launch where it fires: such a run goes last). tests/test_fsdp.py and tests/test_resume.py read what each run wrote
to its run folder.

    torchrun --nproc-per-node 2 tests/torchrun_mains.py SPEC.json
"""

import importlib
import json
import os
import sys

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for name, flags, env in spec:
        module = importlib.import_module(name)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        module.main(tyro.cli(module.Args, args=flags))  # what `torchrun <name>.py <flags>` runs
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        print(f"run finished: {name} {' '.join(flags)}", flush=True)


if __name__ == "__main__":
    main()
