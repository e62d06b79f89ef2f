"""Run under `torchrun --nproc-per-node 2`: one SGD step of the trainers' log-prob loss on a tiny Qwen2, sharded with
FSDP2 (`shard_models`) with and without `enable_gradient_checkpointing` (called before sharding, as the trainers
would), against the plain unsharded model with all-reduced gradients; writes, from rank 0, the largest weight
difference from the plain step and the number of entries saved for backward, for tests/test_logprobs.py.

    torchrun --nproc-per-node 2 tests/fsdp_checkpointing_check.py OUT.json
"""

import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.dist import full_weights, init_distributed, shard_models  # noqa: E402
from common.models import enable_gradient_checkpointing  # noqa: E402
from common.rollout import completion_logprobs  # noqa: E402


def step(rank: int, checkpointing: bool, fsdp: bool) -> tuple[dict, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64,
                                         tie_word_embeddings=True)).train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    (model,) = shard_models(types.SimpleNamespace(fsdp=fsdp), model)
    ids_BT = torch.randint(0, 300, (2, 4, 20), generator=torch.Generator().manual_seed(1))[rank]  # rows per rank
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[0, :3] = 0
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp_BC, _ = completion_logprobs(model, ids_BT, attn_BT, 8, 0.7)
    logp_BC.sum().backward()
    if not fsdp:
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {n: t.clone() for n, t in full_weights(model)}, sum(saved)


def main(out_path: str) -> None:
    rank, _, _ = init_distributed("cpu")
    plain, _ = step(rank, False, False)
    result = {}
    for checkpointing in (False, True):
        weights, saved = step(rank, checkpointing, True)
        result[f"checkpointing={checkpointing}"] = {
            "max_diff": max((weights[n] - plain[n]).abs().max().item() for n in plain), "saved": saved}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
