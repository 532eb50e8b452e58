"""``Engine.score``: log-likelihoods of completions given a prompt (:mod:`dllm_jax.decode.likelihood`), for RL
policy ratios and multiple-choice evaluation. A mixin of :class:`dllm_jax.engine.engine.Engine`; it runs on the
engine's current weights under its lock (never between a weight update's leaves), outside the scheduler.

``Engine.prompt_logprobs``: every prompt token's chain log-probability given the tokens before it (the prompt scored
as ``ids[:1]`` + completion ``ids[1:]``), with the top-k alternatives: OpenAI's ``echo`` + ``logprobs``, which
lm-eval's loglikelihood and multiple-choice tasks read."""

from __future__ import annotations

import numpy as np

from dllm_jax.decode.likelihood import ESTIMATORS, chain_scores, score


class Scoring:
    def score(self, prompt: str | list[str] | None = None, completions: list | None = None, *,
              input_ids: list[int] | list[list[int]] | None = None, estimator: str = "chain", num_samples: int = 8,
              seed: int = 0) -> list[dict] | list[list[dict]]:
        """Score each completion (text, tokenized without special tokens, or token ids) after the prompt (raw text
        or ``input_ids``). Returns per completion ``{"tokens", "token_logprobs", "logprob", "num_tokens"}``.

        The batch forms :meth:`generate` takes (a list of prompt texts, or ``input_ids`` as a list of id lists)
        score every completion after each prompt and return one such list per prompt. Errors name the field:
        ``prompt[1]`` / ``input_ids[1]`` in a batch, ``completions[2]``."""
        self._require_scheduler("score")
        self._check_occupied("score")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator: must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= 1024:
            raise ValueError(f"num_samples: must be an integer in [1, 1024], got {num_samples!r}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt (text) or input_ids")
        prompts, fields, single = self._score_prompts(prompt, input_ids)
        if not isinstance(completions, (list, tuple)) or not completions:
            raise ValueError("completions: must be a non-empty list of texts or token-id lists")
        tokens_list = [self.tokenize(c, f"completions[{i}]") if isinstance(c, str) else c
                       for i, c in enumerate(completions)]
        for i, tokens in enumerate(tokens_list):
            if not isinstance(tokens, (list, tuple)):
                raise ValueError(f"completions[{i}]: must be a text or a list of integer token ids")
            if tokens:
                self.make_request(list(tokens), {"max_new_tokens": 1}, field=f"completions[{i}]")  # the id checks
        for ids, field in zip(prompts, fields):
            if ids:
                self.make_request(ids, {"max_new_tokens": 1}, field=field)
            for i, tokens in enumerate(tokens_list):
                self.make_request(ids + list(tokens), {"max_new_tokens": 1}, field=f"completions[{i}]")  # it fits
                if len(ids) + len(tokens) > self.context_length:
                    what = "prompt" if single else field
                    raise ValueError(f"completions[{i}]: {what} + completion ({len(ids) + len(tokens)} tokens) "
                                     f"exceed context_length {self.context_length}")
        out = []
        for ids in prompts:
            scored = []
            for tokens in tokens_list:
                tokens = list(tokens)
                with self._lock:
                    lps = score(self.runner.params, self.config, ids, tokens, estimator=estimator,
                                num_samples=num_samples, seed=seed)
                scored.append({"tokens": tokens, "token_logprobs": lps.tolist(), "logprob": float(np.sum(lps)),
                               "num_tokens": len(tokens)})
            out.append(scored)
        return out[0] if single else out

    def _score_prompts(self, prompt, input_ids) -> tuple[list[list[int]], list[str], bool]:
        """(each prompt's ids, the field naming it, whether it was one prompt) for :meth:`score`."""
        if prompt is not None:
            if isinstance(prompt, str):
                return [self.tokenize(prompt, "prompt")], ["prompt"], True
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                fields = [f"prompt[{i}]" for i in range(len(prompt))]
                return [self.tokenize(p, f) for p, f in zip(prompt, fields)], fields, False
            raise ValueError("prompt: must be a string or a non-empty list of strings")
        if isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(x, (list, tuple)) for x in input_ids):
            return [list(x) for x in input_ids], [f"input_ids[{i}]" for i in range(len(input_ids))], False
        if isinstance(input_ids, (list, tuple)):
            return [list(input_ids)], ["input_ids"], True
        raise ValueError("input_ids: must be a list of token ids or a list of such lists")

    def prompt_logprobs(self, input_ids: list[int], top_k: int = 0, *, field: str = "input_ids") -> dict:
        """Per prompt token, the chain estimator's log-probability given the tokens before it (the first token's is
        ``None``: nothing conditions it). Returns ``{"input_token_logprobs": [[logprob | None, token_id], ...]}``
        and with ``top_k`` > 0 ``"input_top_logprobs"``: per token ``None`` for the first, else the ``top_k`` most
        likely ``[logprob, token_id]`` (mask id excluded), most likely first. ``field`` names the input in errors.
        A model without a mask token (DiffusionGemma) has no such estimator here: ValueError."""
        self.check_prompt_logprobs(field)
        self._check_occupied("prompt_logprobs")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k < self.config.vocab_size:
            raise ValueError(f"top_k: must be an integer in [0, {self.config.vocab_size - 1}], got {top_k!r}")
        ids = list(input_ids)
        if not ids:
            raise ValueError(f"{field}: the prompt is empty")
        self.make_request(ids, {"max_new_tokens": 1}, field=field)  # the id and length checks
        with self._lock:
            lps, top_lps, top_ids = chain_scores(self.runner.params, self.config, ids[:1], ids[1:], top_k=top_k)
        out = {"input_token_logprobs": [[None, ids[0]]] + [[float(lp), t] for lp, t in zip(lps, ids[1:])]}
        if top_k:
            out["input_top_logprobs"] = [None] + [[[float(lp), int(t)] for lp, t in zip(row_lp, row_id)]
                                                  for row_lp, row_id in zip(top_lps, top_ids)]
        return out

    def check_prompt_logprobs(self, field: str = "input_ids") -> None:
        """A ValueError naming ``field`` unless this engine can score prompts: the chain estimator unmasks with the
        mask token, which a uniform-noise family (DiffusionGemma) does not have."""
        from dllm_jax.model.family import family_of

        family = family_of(self.config)
        if getattr(self, "runner", None) is None or not self.capabilities.score:
            raise ValueError(f"{field}: prompt log-probabilities (the chain estimator) need a mask-token "
                             f"block-diffusion model; {family.name} models have no mask token, so they are not "
                             f"available for this model")
