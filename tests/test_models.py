"""common/models.py: loaded models have dropout off, so train-mode log-probs are deterministic."""

import pytest
import torch

from common.models import load_model
from common.rollout import completion_logprobs


def _gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                               embd_pdrop=0.1, attn_pdrop=0.1)).save_pretrained(path)


def _qwen2(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64, attention_dropout=0.1)).save_pretrained(path)


@pytest.mark.parametrize("build", [_gpt2, _qwen2], ids=["gpt2_pdrop", "qwen2_attention_dropout"])
def test_loaded_model_has_no_dropout_in_train_mode(build, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    build(str(tmp_path))
    ids_BT = torch.randint(0, 50, (4, 12))
    mask_BT = torch.ones_like(ids_BT)
    raw = AutoModelForCausalLM.from_pretrained(str(tmp_path)).train()  # the checkpoint really has dropout
    assert not torch.equal(*(completion_logprobs(raw, ids_BT, mask_BT, 4)[0] for _ in range(2)))

    model = load_model(str(tmp_path))
    assert model.training
    first, second = (completion_logprobs(model, ids_BT, mask_BT, 4)[0] for _ in range(2))
    assert torch.equal(first, second)
    assert torch.equal(first, completion_logprobs(model.eval(), ids_BT, mask_BT, 4)[0])


@pytest.mark.parametrize("build", [_gpt2, _qwen2], ids=["gpt2_pdrop", "qwen2_attention_dropout"])
def test_reward_model_backbone_has_no_dropout_in_train_mode(build, tmp_path):
    """ppo_slm.py trains its Bradley-Terry reward model in train mode from this loader: scores are deterministic."""
    from transformers import AutoModelForSequenceClassification

    from ppo_slm_stages import load_score_model

    torch.manual_seed(0)
    build(str(tmp_path))
    ids_BT = torch.randint(1, 50, (4, 12))
    raw = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), num_labels=1).train()
    raw.config.pad_token_id = 0
    assert not torch.equal(raw(input_ids=ids_BT).logits, raw(input_ids=ids_BT).logits)  # it really has dropout
    rm = load_score_model(str(tmp_path)).train()
    rm.config.pad_token_id = 0
    assert torch.equal(rm(input_ids=ids_BT).logits, rm(input_ids=ids_BT).logits)
