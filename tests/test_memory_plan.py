"""--plan-memory (common/memory_plan.py): the formulas on models small enough to count by hand and tensor by tensor,
the plan of a config-only folder answered by grpo.py before torch loads, and the fit and the flag it suggests."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import ROOT

from common import memory_plan as mp
from common.args import cli

TINY = mp.Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32, tied=True,
                qkv_bias=True)
"""Small enough to count by hand: per layer q 8x8, k 8x4, v 8x4, o 8x8, gate, up, down 8x16 = 576 matrix weights,
16 q/k/v biases, 2 norms of 8: 608; two layers, tied embeddings 32x8, the final norm 8: 1,480 parameters."""


def test_parameters_counted_by_hand_and_equal_to_transformers_models():
    assert (TINY.layer_matmul, TINY.layer_params, TINY.params) == (576, 608, 1480)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from common.models import add_lora

    qwen = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=16, tie_word_embeddings=True)
    llama = dict(vocab_size=50, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                 head_dim=16, intermediate_size=40, tie_word_embeddings=False)  # head_dim x heads != hidden
    for cls, cfg_cls, kw in ((Qwen2ForCausalLM, Qwen2Config, qwen), (LlamaForCausalLM, LlamaConfig, llama)):
        model = cls(cfg_cls(**kw))
        shape = mp.shape_of(model.config.to_dict())
        assert shape.params == sum(p.numel() for p in model.parameters()), cls.__name__
        targets = ("q_proj", "v_proj", "down_proj")
        wrapped = add_lora(model, ["a"], 4, 8, targets)
        lora = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
        assert mp.lora_params(shape, mp.Lora(4, targets)) == lora


def test_update_bytes_of_the_tiny_model_by_hand():
    # 2 rows of 3 prompt + 4 completion tokens: 14 tokens, 2 x 5 x 32 = 320 logits entries (the C + 1 last positions)
    # float32: 40h + 16I = 576 bytes per token and layer, x 2 layers x 14 tokens = 16,128, final norm 8h x 14 = 896;
    # logits: max(2 x 4 x 320 + two float32 blocks of 320 = 5,120, 4 x 320 + the head's gradient 4 x 32 x 8 = 2,304)
    assert mp.micro_batch_bytes(TINY, 2, 3, 4) == (16128 + 896, 5120)
    # checkpointed: each layer's input (4h x 14 x 2 = 896) and one layer recomputed (576 x 14 = 8,064)
    assert mp.micro_batch_bytes(TINY, 2, 3, 4, checkpointing=True) == (896 + 8064 + 896, 5120)
    # autocast: 38h + 8I = 432 a token and layer, plus each layer's bf16 weight copy (2 x 576), the final norm 896;
    # logits 2 bytes: max(2 x 2 x 320 + 2,560 + the head's bf16 copy 2 x 256, 2 x 320 + 8 x 256) = 4,352
    assert mp.micro_batch_bytes(TINY, 2, 3, 4, "autocast") == (2 * (14 * 432 + 1152) + 896, 4352)
    # LoRA r 2 on q and v, float32 base: 576 - the norms' inputs 2 x 4 x 8 - the linears' inputs 4 x (8 + 8 + 16)
    # + the q/k/v input kept by the adapters 4 x 8 + their rank-r outputs 4 x 2 x 2 = 432 - 64 + 32 + 16 - ... :
    lora = mp.Lora(2, ("q_proj", "v_proj"))
    assert mp.layer_activation_bytes(TINY, "float32", lora) == 576 - 64 - 128 + 32 + 16
    # a frozen LM head: no weight gradient, the logits' moment alone
    assert mp.micro_batch_bytes(TINY, 2, 3, 4, lora=lora)[1] == 5120
    # KV cache: 4 rows x 7 tokens x 2 layers x (k and v) x 1 head x 4 x 4 bytes
    assert mp.kv_cache_bytes(TINY, 4, 7, 4) == 4 * 7 * 2 * 2 * 4 * 4


def test_held_state_per_rank_full_lora_and_fsdp():
    s = mp.Setup(rows=4, group=2, micro_batch=2, prompt=3, completion=4)
    full = mp.phases(TINY, mp.Holds(reference=True), s, [])["update: micro-batch"]
    p = TINY.params
    assert (full["policy weights"], full["gradients"], full["AdamW state"], full["reference model"]) == (
        4 * p, 4 * p, 8 * p, 4 * p)
    one = mp.phases(TINY, mp.Holds(), replace(s, micro_batch=4), [])  # one micro-batch per optimizer step
    assert "gradients" not in one["update: micro-batch"] and one["update: optimizer step"]["gradients"] == 4 * p
    sharded = mp.phases(TINY, mp.Holds(reference=True), replace(s, fsdp=True, ranks=4), [])["update: micro-batch"]
    assert sharded["policy weights"] == p and sharded["AdamW state"] == 2 * p  # 1/4 each
    holds = mp.Holds(lora_r=2, lora_targets=("q_proj", "v_proj"), adapters=3)
    held = mp.phases(TINY, holds, replace(s, dtype="bfloat16"), [])["update: micro-batch"]
    one = mp.lora_params(TINY, holds.lora)
    assert held["policy weights (frozen base)"] == 2 * p  # the base in --dtype
    assert held[f"LoRA adapters (3 x {one:,})"] == 4 * 3 * one and held["AdamW state"] == 8 * one  # one trains
    assert held["gradients"] == 4 * one


def saved_bytes_per_token_and_layer(make, lora=None, dtype=torch.float32, tokens=24) -> float:
    """Bytes a decoder layer saves for backward per token: a 2-layer minus a 1-layer model, tensor by tensor."""
    from common.models import add_lora
    from common.rollout import position_ids

    saved = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = make(layers).to(dtype).train()
        model = add_lora(model, ["a"], lora.r, 2 * lora.r, lora.targets) if lora else model
        params, found = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids_BT = torch.randint(0, 64, (1, tokens))
        attn_BT = torch.ones_like(ids_BT)
        attn_BT[0, :2] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=position_ids(attn_BT), logits_to_keep=1,
                  use_cache=False)
        saved[layers] = sum(found.values())
    return (saved[2] - saved[1]) / tokens


ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("lora_targets", [None, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"), ALL_LINEARS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_formula_equals_the_tensors_a_layer_saves(lora_targets, dtype):
    """The per-token, per-layer coefficients (full fine-tuning, and LoRA on a frozen base in float32 and bfloat16)
    against the bytes a Llama layer with grouped KV heads actually saves for backward, counted tensor by tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(layers):
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, num_hidden_layers=layers,
                                            num_attention_heads=6, num_key_value_heads=2, intermediate_size=256,
                                            tie_word_embeddings=True))

    shape = mp.shape_of(make(1).config.to_dict())
    lora = mp.Lora(4, lora_targets) if lora_targets else None
    counted = saved_bytes_per_token_and_layer(make, lora, getattr(torch, dtype))
    assert counted == pytest.approx(mp.layer_activation_bytes(shape, dtype, lora), rel=0.03)


def test_the_moved_formula_gives_update_memory_md_figures():
    """benchmarks/speed/update_memory.py imports the formula from here: its committed 'formula MB' column is unchanged."""
    from benchmarks.speed import update_memory as um

    rows = [ln.split("|")[1:-1] for ln in open(os.path.join(ROOT, "benchmarks", "speed", "update_memory.md"))
            if ln.startswith("| model |") or ln.startswith("| logits |")]
    checked = 0
    for level, dtype, code, ckpt, b, c, _, formula, *_ in ([x.strip() for x in r] for r in rows):
        if code == "new":
            config = dict(level=level, dtype=dtype, code=code, ckpt=ckpt == "on", rows=int(b), completion=int(c))
            assert um.mb(um.predicted(config)) == formula, config
            checked += 1
    assert checked == 9


def test_mirrored_constants_equal_their_sources(monkeypatch, tmp_path):
    import inspect

    from common import dist, rollout
    from grounds import cache

    assert mp.LOGPROB_CHUNK == rollout.LOGPROB_CHUNK
    assert mp.DEFAULT_PROMPT_BUDGET == rollout.DEFAULT_PROMPT_BUDGET
    assert mp.GENERATION_ROWS == inspect.signature(rollout.HFEngine).parameters["max_batch"].default
    assert mp.BUCKET_BYTES == dist.BUCKET_BYTES
    for env in ({}, {"XDG_CACHE_HOME": str(tmp_path)}, {"TINYPOST_CACHE": str(tmp_path / "t")}):
        for k in ("XDG_CACHE_HOME", "TINYPOST_CACHE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert mp.cache_root() == cache.cache_root()


def test_an_embedded_name_reads_its_built_folder(weak_model_dir):
    assert mp.config_path("Testbed-Weak") == os.path.join(weak_model_dir, "config.json")


def qwen_1p5b_folder(tmp_path) -> str:
    """A folder holding only the config.json of Qwen2.5-1.5B's shape (nothing that could be loaded)."""
    cfg = dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
               num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
               max_position_embeddings=32768)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_grpo_plans_a_config_only_folder_before_torch_loads(tmp_path):
    folder = qwen_1p5b_folder(tmp_path)
    r = subprocess.run([sys.executable, "-X", "importtime", "grpo.py", "--plan-memory", "--model-name", folder,
                        "--device", "cuda", "--dtype", "bfloat16", "--max-prompt-tokens", "256", "--max-new-tokens",
                        "1024", "--micro-batch-size", "16", "--device-memory-gb", "80"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers", "safetensors")}, "imported torch"
    out = r.stdout
    assert "1.54 B parameters" in out and "peak: " in out and "update: micro-batch" in out
    assert r.returncode == 1 and "does not fit" in out and "--gradient-checkpointing" in out  # 16 rows: ~110 GB


def test_fit_and_the_suggested_flag_that_makes_it_fit(tmp_path):
    shape = mp.read_shape(qwen_1p5b_folder(tmp_path))
    s = mp.Setup(dtype="bfloat16", rows=128, group=8, micro_batch=16, prompt=256, completion=1024, device="cuda",
                 device_bytes=80e9)
    lines, ok = mp.render("q", shape, mp.Holds(), s, [])
    assert ok is False and "update: micro-batch" in lines[-2]
    flags = lines[-1].split("fits with any one of: ")[1].split(" | ")
    assert flags[0] == "--gradient-checkpointing" and flags[1].startswith("--micro-batch-size ")
    usable = 0.9 * 80e9
    assert mp.peak(mp.phases(shape, mp.Holds(), replace(s, checkpointing=True), []))[1] <= usable
    b = int(flags[1].split()[-1])  # the largest micro-batch that fits: twice it does not
    assert mp.peak(mp.phases(shape, mp.Holds(), replace(s, micro_batch=b), []))[1] <= usable
    assert mp.peak(mp.phases(shape, mp.Holds(), replace(s, micro_batch=2 * b), []))[1] > usable
    assert mp.render("q", shape, mp.Holds(), replace(s, checkpointing=True), [])[1] is True
    # nothing alone is enough on 16 GB: several flags together, each at its mildest
    lines, ok = mp.render("q", shape, mp.Holds(), replace(s, device_bytes=16e9), [])
    assert "fits with all of: " in lines[-1]
    # vLLM: a share too small for its own weights is named
    lines, _ = mp.render("q", shape, mp.Holds(), replace(s, backend="vllm", vllm_share=0.02), [])
    assert any("cannot hold its weights and one sequence's KV cache" in ln for ln in lines)
    # an assumed prompt length that does not fit: the peak at shorter --max-prompt-tokens, each below the last
    long = replace(s, prompt=2048, checkpointing=True, micro_batch=16, device_bytes=40e9)
    lines, ok = mp.render("q", shape, mp.Holds(), long, [], prompt_note="assumed: set --max-prompt-tokens")
    peaks = [mp.peak(mp.phases(shape, mp.Holds(), replace(long, prompt=p), []))[1] for p in (1024, 512, 256, 128)]
    said = ", ".join(f"{p}: {mp.gb(x)}" for p, x in zip((1024, 512, 256, 128), peaks))
    assert ok is False and lines[-1].endswith(said)
    assert peaks == sorted(peaks, reverse=True) and peaks[0] < mp.peak(mp.phases(shape, mp.Holds(), long, []))[1]
    assert "assumed" not in mp.render("q", shape, mp.Holds(), long, [], prompt_note="--max-prompt-tokens")[0][-1]


def test_plan_memory_exits_with_the_fit_and_says_nothing_without_the_flag(tmp_path, capsys):
    from grpo import Args

    folder = qwen_1p5b_folder(tmp_path)
    flags = ["--model-name", folder, "--max-prompt-tokens", "64", "--max-new-tokens", "64", "--micro-batch-size", "1",
             "--num-eval-problems", "0"]
    assert cli(Args, flags, holds=lambda a: {}).model_name == folder  # no --plan-memory: the flags, nothing printed
    assert capsys.readouterr().out == ""
    for gb, status in (("80", 0), ("4", 1)):
        with pytest.raises(SystemExit) as e:
            cli(Args, [*flags, "--plan-memory", "--device-memory-gb", gb], holds=lambda a: {})
        assert e.value.code == status and "peak: " in capsys.readouterr().out


def test_a_name_with_no_config_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="finds none for 'nobody/no-such-model'"):
        mp.read_shape("nobody/no-such-model")
    with pytest.raises(SystemExit, match="has no config.json"):
        mp.read_shape(str(tmp_path))


def test_a_hub_id_reads_config_json_from_the_local_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps(dict(model_type="llama", hidden_size=8, num_hidden_layers=2,
                                                          num_attention_heads=2, intermediate_size=16, vocab_size=32)))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    shape = mp.read_shape("acme/tiny")
    assert (shape.hidden, shape.layers, shape.kv_heads, shape.tied, shape.qkv_bias) == (8, 2, 2, False, False)


def weights_alive() -> dict:
    """{storage: bytes} of the parameters and buffers of every torch module alive now."""
    import gc

    gc.collect()
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for o in gc.get_objects()
            if isinstance(o, torch.nn.Module) for t in (*o.parameters(), *o.buffers())}


class Loaded(Exception):
    """Raised at a trainer's dist.shard_models call: every model it trains with is loaded, nothing sharded yet."""


def declared_holds(trainer: str, argv: list[str]):
    """The trainer's module, its args at `argv` and the Holds its own statement `Args.parse(holds=...)` declares (read
    from its file: running the file would train when the statement is missing)."""
    import ast
    import importlib

    module = importlib.import_module(trainer)
    calls = [k.value for c in ast.walk(ast.parse(open(module.__file__).read())) if isinstance(c, ast.Call)
             and ast.unparse(c.func) == "Args.parse" for k in c.keywords if k.arg == "holds"]
    assert len(calls) == 1, f"{trainer}.py does not declare what it loads: Args.parse(holds=...) once"
    args = cli(module.Args, argv)
    return module, args, mp.Holds(**eval(ast.unparse(calls[0]))(args))


TINY_RUNS = {  # flags of a cheap run on the tiny model (each stops once its models are loaded)
    "grpo": ["--beta", "0.1"], "oc_grpo": [], "rloo_sec": ["--beta", "0.1"], "adakp": ["--beta", "0.1"],
    "mada_rl": ["--num-generators", "2", "--num-critics", "1", "--lora-r", "2"],
    "mada_rl bfloat16": ["--num-generators", "2", "--num-critics", "1", "--dtype", "bfloat16"],
    "direct_opd": ["--teacher-pre", "{tiny}", "--teacher-post", "{tiny}"],
    "direct_opd bfloat16": ["--teacher-pre", "{tiny}", "--teacher-post", "{tiny}", "--dtype", "bfloat16"],
    "rlpf": ["--beta", "0.1", "--tasks", "sum_range", "--timing-repeats", "1", "--calibration-scorings", "1"],
    "ppo_slm": ["--num-train-examples", "64", "--num-eval-pairs", "16", "--num-eval-prompts", "16", "--num-prompts",
                "8", "--minibatch-size", "4", "--max-new-tokens", "4", "--sft-steps", "1", "--sft-batch-size", "8",
                "--rm-steps", "1", "--rm-batch-size", "8"],
}


@pytest.mark.parametrize("run", list(TINY_RUNS))
def test_each_trainers_plan_counts_the_models_it_loads(monkeypatch, tmp_path, tiny_model_dir, run):
    """A trainer's declared Holds (its own statement, at its flags) against the parameters and buffers its main()
    has loaded when it shards its models (dist.shard_models, where every trainer hands over all it trains with): a
    model loaded and not declared, or declared and not loaded, fails here."""
    from common import dist

    argv = ["--model-name", tiny_model_dir, "--output-dir", str(tmp_path),
            *(a.format(tiny=tiny_model_dir) for a in TINY_RUNS[run])]
    trainer = run.split()[0]
    module, args, holds = declared_holds(trainer, argv)
    before, loaded = weights_alive(), {}

    def count_and_stop(args, *models):
        loaded.update({k: v for k, v in weights_alive().items() if k not in before})
        raise Loaded

    monkeypatch.setattr(dist, "shard_models", count_and_stop)
    with pytest.raises(Loaded):
        module.main(args)
    shape = mp.read_shape(tiny_model_dir)
    s, _, _ = mp.setup_of(args, holds, shape)
    planned = mp.phases(shape, holds, s, mp.frozen_shapes(holds, s.dtype))["generation"]
    counted = sum(v for k, v in planned.items()
                  if k.startswith(("policy weights", "LoRA adapters", "reference model", "frozen models", "value head")))
    assert sum(loaded.values()) == pytest.approx(counted, rel=0.01), (trainer, sum(loaded.values()), planned)
