"""Claims on SmolLM2-135M-Instruct, their gate and their run records (claim_runs.py, runs/)."""
