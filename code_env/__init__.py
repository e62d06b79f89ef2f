"""rlpf.py's environment: the code-optimisation tasks (tasks.py) and the sandbox that runs model-written programs
(sandbox.py)."""
