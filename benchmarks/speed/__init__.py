"""Speed and memory of the trainers, against TRL and the raw limits."""
