"""Run under `torchrun --nproc-per-node 2`: what the trainers compute across ranks, written to a JSON file for
tests/test_fsdp.py.

- evaluate: each rank generates for its share of the held-out problems only, and every rank returns the figures of
  all of them (compared with one greedy pass over every problem, which each rank also makes on its own);
- update_metrics: loss/* shares summed over ranks, per-token sums divided by all ranks' tokens;
- global_std: the std of the union of the ranks' values (grpo.py's --adv-norm batch_std).

    torchrun --nproc-per-node 2 tests/dist_metrics_check.py MODEL_DIR OUT.json
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.data import encode_prompts, load_problems, render_prompt  # noqa: E402
from common.dist import global_std, init_distributed  # noqa: E402
from common.evaluate import evaluate  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from common.rollout import HFEngine  # noqa: E402
from common.logger import update_metrics  # noqa: E402
from common.verifiers import score  # noqa: E402


def main(model_dir: str, out_path: str) -> None:
    rank, world, _ = init_distributed("cpu")
    tok, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    problems = load_problems("testbed", "test", (1, 3), 7, 0)  # 14 problems: shares of 7 and 7, two levels
    engine, asked = HFEngine(model, tok), []
    generate = engine.generate

    def counted(prompt_ids, n=1, **kw):
        asked.append(len(prompt_ids))
        return generate(prompt_ids, n=n, **kw)

    engine.generate = counted
    got = evaluate(engine, tok, problems, max_new_tokens=6, num_samples=2, pass_k=2)
    ids = encode_prompts(tok, [render_prompt(p, tok) for p in problems])
    greedy = generate(ids, n=1, max_new_tokens=6, greedy=True)  # one process's evaluation, every problem
    correct = score(greedy.texts, problems, greedy.truncated_B)
    by_level = {lv: [c for p, c in zip(problems, correct) if p.level == lv] for lv in (1, 3)}
    metrics = update_metrics({"loss/policy": float(rank + 1), "policy/entropy": 10.0 * (rank + 1)}, [0.5], 1e-3,
                             n_updates=2, n_tok=rank + 1)
    x = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, 4.0, 5.0])
    out = {"asked": asked, "eval": {k: v for k, v in got.items() if not k.startswith("samples/")},
           "want_greedy": sum(correct) / len(correct),
           "want_levels": {str(lv): sum(v) / len(v) for lv, v in by_level.items()}, "n": len(problems),
           "metrics": metrics, "std": global_std(x).item(), "world": world}
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
