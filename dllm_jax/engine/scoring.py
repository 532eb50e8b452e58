"""``Engine.score``: log-likelihoods of completions given a prompt (:mod:`dllm_jax.decode.likelihood`), for RL
policy ratios and multiple-choice evaluation. A mixin of :class:`dllm_jax.engine.engine.Engine`; it runs on the
engine's current weights under its lock (never between a weight update's leaves), outside the scheduler."""

from __future__ import annotations

import numpy as np

from dllm_jax.decode.likelihood import ESTIMATORS, score


class Scoring:
    def score(self, prompt: str | None = None, completions: list | None = None, *, input_ids: list[int] | None = None,
              estimator: str = "chain", num_samples: int = 8, seed: int = 0) -> list[dict]:
        """Score each completion (text, tokenized without special tokens, or token ids) after the prompt (raw text
        or ``input_ids``). Returns per completion ``{"tokens", "token_logprobs", "logprob", "num_tokens"}``."""
        self._require_scheduler("score")
        self._check_occupied("score")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator: must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= 1024:
            raise ValueError(f"num_samples: must be an integer in [1, 1024], got {num_samples!r}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt (text) or input_ids")
        ids = self.tokenize(prompt, "prompt") if prompt is not None else list(input_ids)
        if not isinstance(completions, (list, tuple)) or not completions:
            raise ValueError("completions: must be a non-empty list of texts or token-id lists")
        out = []
        for i, c in enumerate(completions):
            tokens = self.tokenize(c, f"completions[{i}]") if isinstance(c, str) else list(c)
            self.make_request(ids + tokens, {"max_new_tokens": 1}, field=f"completions[{i}]")  # the id checks
            if len(ids) + len(tokens) > self.context_length:
                raise ValueError(f"completions[{i}]: prompt + completion ({len(ids) + len(tokens)} tokens) exceed "
                                 f"context_length {self.context_length}")
            with self._lock:
                lps = score(self.runner.params, self.config, ids, tokens, estimator=estimator,
                            num_samples=num_samples, seed=seed)
            out.append({"tokens": tokens, "token_logprobs": lps.tolist(), "logprob": float(np.sum(lps)),
                        "num_tokens": len(tokens)})
        return out
