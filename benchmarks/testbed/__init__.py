"""Each trainer's claim and its ablations on the embedded testbed."""
