"""The benchmarks, run as modules from the repository root: `python -m benchmarks.<folder>.<script>` (README.md here
lists the folders)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""the repository root: the trainers, docs/ and the run folders (runs/) are found from it"""
