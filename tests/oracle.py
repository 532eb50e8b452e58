"""A float64 oracle for block-diffusion decoding, independent of the engine.

The model runs in float64 through ``transformers`` (or any ``logits_fn(token_ids) -> [S, V]`` float64 function,
e.g. the numpy LLaDA2 reference), re-encoding the whole sequence under the block-causal mask at every step; the
decoding rules are the reference's (SGLang's algorithms, SDAR's loop, as ``reference/sglang-dllm-engine.md``
section 2 writes them), with the mask id never a candidate.

Every decision of a step is scored by its *relative margin*: the gap between the two best candidates (tokens of a
committed position, positions of the at-least-one pick, the boundary of EBSampling's entropy budget) or between
a score and its threshold, divided by the larger magnitude. A decision whose margin is below ``NEAR_TIE``
(1e-5, ten times float32's rounding of these quantities) is a *near-tie*: a float32 run may legitimately take
either side of it, and which side it takes may depend on the batch shape.

:meth:`Oracle.verify` checks one engine output block by block: given the output's own prefix, the block it
committed must be one the reference can reach by taking the exact decisions everywhere except at near-ties,
where every side is explored. Any other difference fails, with the decision that contradicts the reference.
So a greedy float32 output may differ from the float64 reference (and from another float32 run) only after a
near-tie, and every difference is classified.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

NEAR_TIE = 1e-5
ENTROPY_EPS = {"EntropyThreshold": 1e-8}  # the reference's log(p + eps); EBSampling uses the exact entropy
DEFAULTS = {"LowConfidence": {"threshold": 0.95}, "EBSampling": {"gamma": 0.15},
            "EntropyThreshold": {"threshold": 0.95},
            "JointThreshold": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16,
                               "penalty_lambda": 0.0}}


def margin(a: float, b: float) -> float:
    """Relative gap between two scores (0 for equal ones)."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


@dataclasses.dataclass
class Verdict:
    prompt: list[int]
    output: list[int]
    reference: list[int]  # the oracle's own exact-decision output
    near_tie_blocks: list[int]  # blocks where the output took a near-tie's other side

    @property
    def equal(self) -> bool:
        return self.output == self.reference


class DecisionError(AssertionError):
    pass


class Oracle:
    """``Oracle(model_dir)`` (transformers, float64) or ``Oracle(logits_fn=..., block_size=, mask_id=)`` where
    ``logits_fn(token_ids, block_size)`` returns the float64 logits ``[S, V]`` under the block-causal mask."""

    def __init__(self, model_dir: str | None = None, *, block_size: int | None = None, mask_id: int | None = None,
                 logits_fn=None, max_states: int = 4000):
        if logits_fn is None:
            logits_fn, cfg = _transformers_logits(model_dir)
            block_size = block_size or cfg.get("block_size") or 4
            mask_id = mask_id if mask_id is not None else cfg["mask_token_id"]
        self.logits_fn = logits_fn
        self.B = int(block_size)
        self.mask = int(mask_id)
        self.max_states = max_states
        self._memo: dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------------------------------------
    def logits(self, seq: tuple[int, ...]) -> np.ndarray:
        """float64 logits of the last block of ``seq`` (length a multiple of B), mask id at -inf."""
        if seq not in self._memo:
            out = np.array(self.logits_fn(list(seq), self.B), dtype=np.float64)[-self.B:]
            out[:, self.mask] = -np.inf
            self._memo[seq] = out
            if len(self._memo) > 20000:
                self._memo.clear()
        return self._memo[seq]

    # ------------------------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens, algorithm="LowConfidence", config=None, stop_ids=()):
        """The reference's own output (exact decisions everywhere; ties to the lowest index)."""
        rules = _Rules(algorithm, config, self.mask)
        seq, out = list(prompt), []
        while len(out) < max_new_tokens:
            block, n_imm = self._first_block(seq)
            final = self._explore(tuple(seq[:len(seq) // self.B * self.B]), block, n_imm, rules, exact=True)
            new = list(next(iter(final))[n_imm:])
            done, out = _append(out, new, max_new_tokens, stop_ids)
            if done:
                break
            seq = list(prompt) + out
        return out

    def verify(self, prompt, output, max_new_tokens, algorithm="LowConfidence", config=None,
               stop_ids=()) -> Verdict:
        """Check an engine output against the reference (see the module docstring); raises DecisionError."""
        prompt, output = [int(t) for t in prompt], [int(t) for t in output]
        rules = _Rules(algorithm, config, self.mask)
        reference = self.generate(prompt, max_new_tokens, algorithm, config, stop_ids)
        seq, out, ties = list(prompt), [], []
        while len(out) < len(output):
            block, n_imm = self._first_block(seq)
            offset = len(seq) // self.B * self.B
            exact = next(iter(self._explore(tuple(seq[:offset]), block, n_imm, rules, exact=True)))
            want = output[len(out):len(out) + self.B - n_imm]
            reachable = [exact]
            if list(exact[n_imm:n_imm + len(want)]) != want:
                reachable = self._explore(tuple(seq[:offset]), block, n_imm, rules, exact=False)
            matches = [f for f in reachable if list(f[n_imm:n_imm + len(want)]) == want]
            if not matches:
                raise DecisionError(
                    f"prompt {prompt}: block {offset // self.B} (offset {offset}) of the output is "
                    f"{want}; the float64 reference commits {list(exact[n_imm:])}, and no side of a near-tie "
                    f"(relative margin < {NEAR_TIE}) reaches the output's block ({len(reachable)} reachable)")
            if list(exact[n_imm:n_imm + len(want)]) != want:
                ties.append(offset // self.B)
            done, out = _append(out, list(matches[0][n_imm:]), max_new_tokens, stop_ids)
            if out != output[:len(out)]:
                raise DecisionError(f"prompt {prompt}: stop handling differs at token {len(out)}")
            if done:
                break
            seq = prompt + out
        if out != output:
            raise DecisionError(f"prompt {prompt}: output {output} does not end where the reference stops "
                                f"({out})")
        return Verdict(prompt, output, reference, ties)

    def verify_all(self, prompts, outputs, max_new_tokens, algorithm="LowConfidence", config=None,
                   stop_ids=()) -> list[Verdict]:
        assert len(prompts) == len(outputs)
        return [self.verify(p, o, max_new_tokens, algorithm, config, stop_ids) for p, o in zip(prompts, outputs)]

    # ------------------------------------------------------------------------------------------
    def _first_block(self, seq):
        offset = len(seq) // self.B * self.B
        n_imm = len(seq) - offset
        return tuple(seq[offset:]) + (self.mask,) * (self.B - n_imm), n_imm

    def _explore(self, prefix: tuple, block: tuple, n_imm: int, rules: "_Rules", *, exact: bool) -> list[tuple]:
        """Final blocks reachable from ``block``: the exact decision path only, or every side of every
        near-tie too. States are (block, algorithm state); each costs one float64 forward."""
        immutable = np.arange(self.B) < n_imm
        finals, seen = [], set()
        stack = [(block, rules.initial())]
        while stack:
            ids, state = stack.pop()
            key = (ids, state)
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > self.max_states:
                raise DecisionError(f"near-tie exploration exceeded {self.max_states} states")
            logits = self.logits(prefix + ids)
            choices = rules.step(np.array(ids), immutable, logits, state, exact=exact)
            for new_ids, new_state, done in choices:
                if done:
                    if new_ids not in finals:
                        finals.append(new_ids)
                else:
                    stack.append((new_ids, new_state))
            if exact and finals:
                return finals
        return finals


def _append(out, new, max_new_tokens, stop_ids):
    out = list(out)
    for t in new:
        out.append(int(t))
        if int(t) in stop_ids or len(out) >= max_new_tokens:
            return True, out
    return False, out


# ----------------------------------------------------------------------------------------------
# The reference's decision rules, with near-tie alternatives
# ----------------------------------------------------------------------------------------------

def _softmax_stats(logits):
    top = logits.max(-1, keepdims=True)
    e = np.exp(logits - top)
    p = e / e.sum(-1, keepdims=True)
    return p


class _Rules:
    def __init__(self, name, config, mask_id):
        if name not in DEFAULTS:
            raise ValueError(f"the oracle has no reference rule for {name}")
        self.name = name
        self.cfg = {**DEFAULTS[name], **(config or {})}
        self.mask = mask_id

    def initial(self):
        return (0, False) if self.name == "JointThreshold" else ()

    # Each returns a list of (ids tuple, state, done): the exact decision first, then near-tie alternatives.
    def step(self, ids, immutable, logits, state, *, exact):
        if self.name == "JointThreshold":
            return self._joint(ids, immutable, logits, state, exact)
        masked = (ids == self.mask) & ~immutable
        if not masked.any():
            return [(tuple(int(t) for t in ids), state, True)]  # this forward saw the final tokens
        p = _softmax_stats(logits)
        if self.name == "LowConfidence":
            conf = p.max(-1)
            sets = _threshold_sets(conf, masked, self.cfg["threshold"], higher_is_better=True, exact=exact)
        elif self.name == "EntropyThreshold":
            h = _entropy(p, ENTROPY_EPS[self.name])
            sets = _threshold_sets(h, masked, self.cfg["threshold"], higher_is_better=False, exact=exact)
        else:
            sets = _eb_sets(_entropy(p, 0.0), masked, self.cfg["gamma"], exact=exact)
        out = []
        for commit in sets:
            for new in _token_choices(ids, commit, p, exact):
                out.append((new, state, False))
        return _unique(out)

    def _joint(self, ids, immutable, logits, state, exact):
        """SGLang's JointThreshold (reference section 2.3): M2T above ``threshold`` (at least one) plus T2T edits
        of generated tokens whose argmax differs with p above ``edit_threshold``; done at a fixed point or once
        the post-edit budget is spent."""
        cfg = self.cfg
        post, finished = state
        unchanged = tuple(int(t) for t in ids)
        if finished:
            return [(unchanged, state, True)]
        logits = logits.copy()
        if cfg["penalty_lambda"] > 0:
            for i in range(1, len(ids)):
                logits[i, ids[i - 1]] -= cfg["penalty_lambda"]
        p = _softmax_stats(logits)
        conf = p.max(-1)
        masked = (ids == self.mask) & ~immutable
        if masked.any():
            m2t_sets = _threshold_sets(conf, masked, cfg["threshold"], higher_is_better=True, exact=exact)
        else:
            post += 1
            if post > cfg["max_post_edit_steps"]:
                return [(unchanged, (post, True), True)]  # budget spent: no edits, the block is final
            m2t_sets = [np.zeros_like(masked)]
        generated = ~masked & ~immutable
        out = []
        for m2t in m2t_sets:
            for t2t in _edit_sets(ids, generated, p, conf, cfg["edit_threshold"], exact):
                transfer = m2t | t2t
                if not transfer.any():
                    out.append((unchanged, (post, True), True))  # fixed point: this forward saw the final tokens
                    continue
                for new in _token_choices(ids, transfer, p, exact):
                    if new == unchanged:  # edits that write the same tokens: a fixed point as well
                        out.append((unchanged, (post, True), True))
                    else:
                        out.append((new, (post, False), False))
        return _unique(out)


def _unique(choices):
    seen, out = set(), []
    for c in choices:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _entropy(p, eps):
    if eps:
        return -(p * np.log(p + eps)).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)


def _threshold_sets(score, masked, threshold, *, higher_is_better, exact):
    """Commit sets of "every masked score beyond the threshold, at least the best one": the exact one first,
    then (unless exact) the other side of each near-tie: a score within NEAR_TIE of the threshold flipped in or
    out, and, where the at-least-one rule applies, every position within NEAR_TIE of the best."""
    worst = -np.inf if higher_is_better else np.inf
    s = np.where(masked, score, worst)
    above = masked & ((s > threshold) if higher_is_better else (s < threshold))
    best = float(s.max() if higher_is_better else s.min())
    candidates = [above]
    if not exact:
        for i in np.flatnonzero(masked):
            if margin(float(score[i]), threshold) < NEAR_TIE:
                flipped = above.copy()
                flipped[i] = not flipped[i]
                candidates.append(flipped)
    sets = []
    for sel in candidates:
        if sel.any():
            sets.append(sel)
        elif exact:
            sets.append(_one(masked, int(np.argmax(s) if higher_is_better else np.argmin(s))))
        else:
            sets += [_one(masked, int(i)) for i in np.flatnonzero(masked) if margin(float(s[i]), best) < NEAR_TIE]
    return sets


def _eb_sets(h, masked, gamma, *, exact):
    """EBSampling: reveal in ascending entropy while the entropy already revealed this step is <= gamma."""
    idx = np.flatnonzero(masked)
    order = idx[np.argsort(h[idx], kind="stable")]
    sorted_h = h[order]
    before = np.concatenate([[0.0], np.cumsum(sorted_h)[:-1]])
    reveal = np.zeros(len(order), bool)
    reveal[0] = True
    reveal |= before <= gamma
    count = int(reveal.sum())  # a prefix of the order: ``before`` never decreases
    sets = [_mask_of(masked, order[:count])]
    if exact:
        return sets
    # The cut: the budget test of the first position left out (or the last taken) within NEAR_TIE of gamma.
    for k in range(1, len(order)):
        if margin(float(before[k]), gamma) < NEAR_TIE or (before[k] == 0 and gamma == 0):
            sets.append(_mask_of(masked, order[:k]))
            sets.append(_mask_of(masked, order[:k + 1]))
    # Near-equal entropies straddling the cut: any of them may be the ones revealed.
    if count < len(order):
        edge = float(h[order[count - 1]])
        group = [int(j) for j in order if margin(float(h[j]), edge) < NEAR_TIE]
        inside = [int(j) for j in order[:count] if int(j) not in group]
        taken = count - len(inside)
        for chosen in itertools.islice(itertools.combinations(group, taken), 64):
            sets.append(_mask_of(masked, inside + list(chosen)))
    return sets


def _edit_sets(ids, generated, p, conf, edit_threshold, exact):
    x = p.argmax(-1)
    base = generated & (ids != x) & (conf > edit_threshold)
    sets = [base]
    if exact:
        return sets
    for i in np.flatnonzero(generated):
        second = np.sort(p[i])[-2]
        if margin(float(conf[i]), float(second)) < NEAR_TIE or margin(float(conf[i]), edit_threshold) < NEAR_TIE:
            flipped = base.copy()
            flipped[i] = not flipped[i]
            sets.append(flipped)
    return sets


def _token_choices(ids, commit, p, exact):
    """Blocks with the committed positions set to their argmax; unless exact, also each committed position's
    second-best token when it is within NEAR_TIE of the best."""
    x = p.argmax(-1)
    base = np.where(commit, x, ids)
    out = [tuple(int(t) for t in base)]
    if exact:
        return out
    for i in np.flatnonzero(commit):
        order = np.argsort(-p[i], kind="stable")
        for alt in order[1:4]:
            if margin(float(p[i, order[0]]), float(p[i, alt])) < NEAR_TIE:
                other = base.copy()
                other[i] = alt
                out.append(tuple(int(t) for t in other))
    return out


def _one(masked, i):
    out = np.zeros_like(masked)
    out[i] = True
    return out


def _mask_of(masked, positions):
    out = np.zeros_like(masked)
    out[list(positions)] = True
    return out


# ----------------------------------------------------------------------------------------------
# transformers, float64
# ----------------------------------------------------------------------------------------------

def _transformers_logits(model_dir):
    import torch
    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    moe = bool(cfg.get("num_experts"))
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    hf_cfg = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**{
        k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map")})
    extra = {"experts_implementation": "eager"} if moe else {}  # grouped_mm has no float64 kernel
    model = cls.from_pretrained(model_dir, config=hf_cfg, dtype=torch.float64, attn_implementation="eager",
                                **extra).eval()
    def logits_fn(tokens, block):
        n = len(tokens)
        blk = torch.arange(n) // block
        visible = blk[None, :] <= blk[:, None]
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([tokens]), attention_mask=mask[None, None],
                        position_ids=torch.arange(n)[None], use_cache=False)
        return out.logits[0].numpy()

    return logits_fn, cfg
