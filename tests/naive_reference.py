"""A deliberately naive block-diffusion decoder: no cache, no paging, no batching.

Every step re-runs the whole sequence with the block-causal mask through ``forward_full`` and applies
LowConfidence with the mask id excluded. The engine must produce exactly these tokens (greedy, float32).
"""

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.model.loader import load_model
from dllm_jax.model.qwen3 import block_causal_mask, forward_full
from pallas_kernels.confidence import confidence_stats_from_logits


class NaiveDecoder:
    def __init__(self, model_path, block_size=None):
        m = load_model(model_path, block_size=block_size)
        self.cfg, self.params = m.config, m.params
        self.B = m.config.block_size
        self.mask = m.config.mask_token_id
        self._fwd = jax.jit(lambda p, t: forward_full(p, self.cfg, t, jnp.arange(t.shape[1])[None],
                                                      jnp.asarray(block_causal_mask(t.shape[1], self.B))[None]))

    def generate(self, prompt, max_new_tokens, threshold=0.95, stop_ids=()):
        """Returns (output_ids, forwards)."""
        B, mask = self.B, self.mask
        seq = list(prompt)
        out, forwards = [], 0
        while len(out) < max_new_tokens:
            offset = len(seq) // B * B
            block = np.array(seq[offset:] + [mask] * (offset + B - len(seq)))
            immutable = np.arange(B) < len(seq) - offset
            while True:
                logits = self._fwd(self.params, jnp.asarray([seq[:offset] + block.tolist()]))[0, offset:]
                forwards += 1
                x, p, _ = confidence_stats_from_logits(logits, exclude_token_id=mask)
                x, p = np.asarray(x), np.asarray(p)
                masked = (block == mask) & ~immutable
                if not masked.any():
                    break
                conf = np.where(masked, p, -np.inf)
                commit = masked & (conf > threshold)
                if not commit.any():
                    commit[conf.argmax()] = True  # exact argmax, lowest position on equal floats
                block = np.where(commit, x, block)
            new = block[immutable.sum():].tolist()
            for t in new:
                out.append(t)
                if t in stop_ids or len(out) >= max_new_tokens:
                    return out, forwards
            seq = seq + new
        return out, forwards
