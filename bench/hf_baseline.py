"""The baseline people use today: a Hugging Face ``transformers`` Qwen3 driven by SDAR's block-diffusion loop.

Written from the description of the loop SDAR's authors publish (``generate.py::block_diffusion_generate``):

1. prefill: one forward over the prompt's *complete* blocks under the block-causal mask, storing their K/V in a
   ``DynamicCache``;
2. per block (the first one holds the prompt's tail, whose positions are fixed): while the block still has
   masks, run the model over all ``B`` positions against the cache *without keeping* the block's K/V (the cache
   is cropped back), and unmask with greedy LowConfidence; once no mask is left, one more forward over the final
   tokens stores the block's K/V;
3. stop at an EOS / stop id (tokens after it dropped) or at ``max_new_tokens`` (the excess of the block dropped).

It follows the engine's decode semantics exactly, so the two must produce the same tokens (greedy, float32):
the mask id is never a candidate (its logit is excluded before the argmax and the softmax), the threshold test
is strict (``p > threshold``), a step commits at least one position (the exact argmax of the confidence, equal
floats going to the lowest position), logits at position ``i`` predict token ``i`` (no shift), and a
block counts ``m + 1`` forwards for ``m`` unmasking steps (the last one being the storing forward).

Masks are 4D float additive masks (0 = visible, the dtype's minimum = hidden): transformers applies a custom 4D
mask as given (no causal mask on top), under ``eager`` and ``sdpa`` alike.

:meth:`HFBlockDiffusion.generate_batch` runs the same loop over a batch of equal-length prompts (one forward per
step for the whole batch, the synchronous schedule: every row takes a step until the last row's block is final,
then one storing forward for all); ``device="cuda"`` puts the model and every tensor on a GPU (the torch side of
``bench/side_by_side.py``).

Only torch and transformers are needed (``pip install dllm-jax[bench]``).
"""

from __future__ import annotations

import inspect
import os
import time

import numpy as np

class HFBlockDiffusion:
    """``HFBlockDiffusion(model_dir).generate(prompt_ids, max_new_tokens)`` -> dict (see :meth:`generate`)."""

    def __init__(self, model_dir: str, *, block_size: int | None = None, threshold: float = 0.95,
                 attn_implementation: str = "sdpa", num_threads: int | None = None, dtype: str = "float32",
                 device: str = "cpu"):
        import torch
        from transformers import Qwen3ForCausalLM

        from dllm_jax.model.loader import resolve_config
        from dllm_jax.model.tokenizer import load_tokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.tokenizer = load_tokenizer(model_dir)
        cfg = resolve_config(model_dir, self.tokenizer, block_size=block_size)
        self.block_size = int(cfg.block_size)
        self.mask_id = int(cfg.mask_token_id)
        self.eos_ids = frozenset(int(e) for e in cfg.eos_token_ids)
        self.threshold = float(threshold)
        self.dtype = getattr(torch, dtype)  # float32 (the engine's CPU default) or bfloat16
        self.device = torch.device(device)
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=self.dtype,
                                                      attn_implementation=attn_implementation).eval()
        if self.device.type != "cpu":
            self.model = self.model.to(self.device)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.forwards = 0
        self.num_threads = torch.get_num_threads()

    def calibrate_threads(self, candidates=None, reps: int = 3) -> int:
        """Give the baseline its best torch thread count: time a block forward with each candidate (default:
        1 and the machine's count) and keep the fastest. On a busy machine torch's intra-op threads can be an
        order of magnitude slower than one thread (spinning workers), which would flatter the engine."""
        torch = self.torch
        default = torch.get_num_threads()
        candidates = sorted(set(candidates or (1, default, os.cpu_count() or 1)))
        ids = np.full(self.block_size, self.mask_id, np.int64)
        best, best_t = default, float("inf")
        self.thread_timings = {}
        for n in candidates:
            torch.set_num_threads(n)
            times = []
            with torch.inference_mode():
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    self._forward(ids, 0, torch.zeros(1, 1, self.block_size, self.block_size), None,
                                  keep_logits=True)
                    times.append(time.perf_counter() - t0)
            self.thread_timings[n] = min(times[1:])
            if self.thread_timings[n] < best_t:
                best, best_t = n, self.thread_timings[n]
        torch.set_num_threads(best)
        self.forwards = 0
        self.num_threads = best
        return best

    # ------------------------------------------------------------------------------------------
    def _forward(self, ids: list[int] | np.ndarray, start: int, mask, cache, *, keep_logits: bool):
        """One forward over ``ids`` (``[n]``, or ``[rows, n]`` for a batch) at positions ``start ...``; the logits
        (``[n, V]`` / ``[rows, n, V]``) or None."""
        torch = self.torch
        ids = np.asarray(ids, np.int64)
        batched = ids.ndim == 2
        ids_t = torch.as_tensor(ids if batched else ids[None], device=self.device)
        pos = torch.arange(start, start + ids_t.shape[1], device=self.device)[None].expand(ids_t.shape[0], -1)
        if mask is not None:
            mask = mask.to(self.device).expand(ids_t.shape[0], -1, -1, -1)
        kwargs = {self._cache_kw: cache}
        out = self.model(input_ids=ids_t, position_ids=pos, attention_mask=mask, use_cache=True,
                         logits_to_keep=0 if keep_logits else 1, **kwargs)
        self.forwards += 1
        if not keep_logits:
            return None
        return out.logits if batched else out.logits[0]

    def _block_causal_mask(self, n: int):
        """``[1, 1, n, n]`` additive mask: key k visible from query q iff ``k // B <= q // B``."""
        torch = self.torch
        blk = torch.arange(n) // self.block_size
        visible = blk[None, :] <= blk[:, None]
        mask = torch.zeros(n, n, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None]

    def _candidates(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """Per position (``[..., V]`` logits, on their device): the argmax token with the mask id excluded, and its
        probability; only these ``2 x positions`` numbers come to the host."""
        torch = self.torch
        logits = logits.float().clone()
        logits[..., self.mask_id] = -float("inf")
        top, arg = logits.max(dim=-1)
        p = torch.exp(top - torch.logsumexp(logits, dim=-1))
        return arg.cpu().numpy(), p.cpu().numpy().astype(np.float32)

    def _select(self, logits, block: np.ndarray, immutable: np.ndarray) -> np.ndarray:
        """One greedy LowConfidence update of ``block`` (the engine's rule, see the module docstring)."""
        x, p = self._candidates(logits)
        return self._commit(x, p, block, immutable)

    def _commit(self, x: np.ndarray, p: np.ndarray, block: np.ndarray, immutable: np.ndarray) -> np.ndarray:
        masked = (block == self.mask_id) & ~immutable
        conf = np.where(masked, p, -np.inf)
        commit = masked & (conf > np.float32(self.threshold))
        if not commit.any():
            commit[int(np.argmax(conf))] = True  # the exact argmax, lowest position on equal floats
        return np.where(commit, x, block)

    # ------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False,
                 stop_token_ids=()) -> dict:
        """Greedy block diffusion for one prompt. Returns ``output_ids``, ``forward_passes`` (prefill included),
        ``latency`` and ``time_to_first_block`` (seconds)."""
        from transformers import DynamicCache

        torch = self.torch
        B, mask_id = self.block_size, self.mask_id
        stop = set(int(t) for t in stop_token_ids) | (set() if ignore_eos else set(self.eos_ids))
        prompt = [int(t) for t in prompt_ids]
        t0 = time.perf_counter()
        first_block = None
        forwards0 = self.forwards
        out: list[int] = []
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            offset = len(prompt) // B * B
            if offset:
                self._forward(prompt[:offset], 0, self._block_causal_mask(offset), cache, keep_logits=False)
            finished = max_new_tokens <= 0
            while not finished:
                n_imm = min(B, max(0, len(prompt) - offset))
                block = np.full(B, mask_id, np.int64)
                block[:n_imm] = prompt[offset:offset + n_imm]
                immutable = np.arange(B) < n_imm
                visible = torch.zeros(1, 1, B, offset + B, dtype=self.dtype)  # the whole prefix and itself
                while True:
                    if not ((block == mask_id) & ~immutable).any():
                        # The block is final: one forward over it stores its K/V (no logits needed).
                        self._forward(block, offset, visible, cache, keep_logits=False)
                        break
                    logits = self._forward(block, offset, visible, cache, keep_logits=True)
                    _crop_to(cache, offset)  # denoising forwards do not keep the block's K/V
                    block = self._select(logits, block, immutable)
                if first_block is None:
                    first_block = time.perf_counter()
                for tok in block[n_imm:].tolist():
                    out.append(int(tok))
                    if tok in stop or len(out) >= max_new_tokens:
                        finished = True
                        break
                offset += B
        end = time.perf_counter()
        return {"output_ids": out, "forward_passes": self.forwards - forwards0, "latency": end - t0,
                "time_to_first_block": (first_block or end) - t0}


    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False,
                       stop_token_ids=()) -> dict:
        """The loop of :meth:`generate` over equal-length ``prompts`` at once (one forward per step for the batch;
        a row whose block is final rides along unchanged until every row's is, then one forward stores the
        blocks' K/V). Returns ``outputs`` (one list per prompt), ``forward_passes`` and ``latency``."""
        from transformers import DynamicCache

        torch = self.torch
        B, mask_id = self.block_size, self.mask_id
        prompts = [[int(t) for t in p] for p in prompts]
        n = len(prompts[0])
        if any(len(p) != n for p in prompts):
            raise ValueError("generate_batch: the prompts must have one length")
        rows = len(prompts)
        stop = set(int(t) for t in stop_token_ids) | (set() if ignore_eos else set(self.eos_ids))
        ids = np.asarray(prompts, np.int64)
        t0 = time.perf_counter()
        forwards0 = self.forwards
        out: list[list[int]] = [[] for _ in range(rows)]
        finished = np.full(rows, max_new_tokens <= 0)
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            offset = n // B * B
            if offset:
                self._forward(ids[:, :offset], 0, self._block_causal_mask(offset), cache, keep_logits=False)
            while not finished.all():
                n_imm = min(B, max(0, n - offset))
                block = np.full((rows, B), mask_id, np.int64)
                block[:, :n_imm] = ids[:, offset:offset + n_imm]
                immutable = np.broadcast_to(np.arange(B) < n_imm, (rows, B))
                visible = torch.zeros(1, 1, B, offset + B, dtype=self.dtype)
                while True:
                    if not ((block == mask_id) & ~immutable).any():
                        self._forward(block, offset, visible, cache, keep_logits=False)
                        break
                    logits = self._forward(block, offset, visible, cache, keep_logits=True)
                    _crop_to(cache, offset)
                    x, p = self._candidates(logits)
                    for r in range(rows):
                        if ((block[r] == mask_id) & ~immutable[r]).any():
                            block[r] = self._commit(x[r], p[r], block[r], immutable[r])
                for r in range(rows):
                    if finished[r]:
                        continue
                    for tok in block[r, n_imm:].tolist():
                        out[r].append(int(tok))
                        if tok in stop or len(out[r]) >= max_new_tokens:
                            finished[r] = True
                            break
                offset += B
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"outputs": out, "forward_passes": self.forwards - forwards0, "latency": time.perf_counter() - t0}


def _crop_to(cache, length: int) -> None:
    """Drop the cache's tokens past ``length`` (negative counts work on old and new transformers alike)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
