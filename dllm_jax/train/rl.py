"""``python -m dllm_jax.train.rl``: GRPO on the shipped model, with the engine's RL APIs (see README.md here).

One running :class:`dllm_jax.Engine` does every rollout, likelihood and evaluation; a JAX trainer (optax, the
project's Qwen3 functions) owns a second copy of the parameters and pushes them into that engine after every
step. A step:

1. ``--prompts-per-step`` prompts drawn from the *training* distribution of :mod:`dllm_jax.train.tasks` (``--tasks``;
   held-out prompts never appear), each sampled ``--group-size`` times by the engine (``--temperature``, a seed per
   rollout, ``return_logprob``); reward 1 for an exact match (:func:`tasks.is_correct`), else 0;
2. group-normalised advantages ``(r - mean) / (std + eps)``; groups whose rewards are all equal are skipped, and
   identical rollouts of a group are trained once with their advantages summed (the same loss, fewer rows);
3. ``Engine.score`` (``--estimator``, chain by default) gives the old policy's per-token log-likelihoods of those
   rollouts: the rollout's own sampling log-probabilities are per-denoise-step confidences, not a likelihood;
4. ``--ppo-epochs`` x ``--minibatches`` AdamW steps on ``-mean_seq sum_token min(r A, clip(r) A)`` (per-token ratio
   ``r`` of the trainer's differentiable estimate, :mod:`dllm_jax.train.rl_loss`, to the engine's: exactly 1 on the
   first minibatch, so with the default single one the loss is ``-mean(A * sum logp)`` and the ratio a check that
   trainer and engine agree; ``--clip-eps 0``: no ratio), optionally ``+ --kl-coef * KL`` to the initial weights;
5. ``Engine.update_weights_from_tensor`` with the in-memory parameters, ``weight_version=str(step)``; the next
   rollouts check that their ``meta_info["weight_version"]`` says so.

Held-out exact match per task (greedy, the decoding of ``dllm-jax eval``) and the held-out sampled reward of the
target tasks before training, every ``--eval-every`` steps and at the end. Writes ``OUT/rl.json`` (per step: reward,
loss, the four timings; the evaluations) and ``OUT/curve.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dllm_jax.train import rl_loss, tasks

TIMINGS = ("rollout_s", "score_s", "train_s", "update_s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dllm_jax.train.rl", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (each one weight update of the engine)")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="start no step after this much wall time (0: no limit)")
    p.add_argument("--tasks", default="times", help="comma-separated tasks the prompts come from")
    p.add_argument("--prompts-per-step", type=int, default=64,
                   help="prompts per step, one group of rollouts each (a large batch averages out what is specific "
                        "to a prompt)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (G)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="rollout length limit")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="cosine: from --lr down to 0 at --steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--ppo-epochs", type=int, default=2, help="passes over each step's rollouts")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (the engine is updated once)")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO ratio clip (0: no ratio, plain policy gradient)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the k3 KL to the initial policy")
    p.add_argument("--estimator", choices=("chain", "elbo"), default="chain")
    p.add_argument("--num-samples", type=int, default=8, help="ELBO Monte Carlo samples")
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every K steps (0: before and after)")
    p.add_argument("--eval-prompts", type=int, default=tasks.HELDOUT_POOL,
                   help="first N held-out prompts, all tasks interleaved (0: no evaluation)")
    p.add_argument("--eval-samples", type=int, default=4,
                   help="also the held-out sampled reward of the target tasks: rollouts per prompt (0: off)")
    p.add_argument("--threshold", type=float, default=0.9, help="LowConfidence threshold (dllm-jax eval's)")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--rows-per-chunk", type=int, default=512, help="likelihood rows per trainer device call")
    p.add_argument("--seqs-per-chunk", type=int, default=16, help="sequences per trainer device call")
    p.add_argument("--model-path", default=None, help="model directory (default: the shipped model)")
    p.add_argument("--out", default="train_out/rl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [t for t in args.tasks if t not in tasks.TASKS]
    if bad or not args.tasks:
        p.error(f"--tasks: unknown task(s) {bad}; choose from {', '.join(tasks.TASKS)}")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (GRPO needs different rollouts per group)")
    if args.group_size < 2:
        p.error("--group-size must be at least 2")
    return args


# ----------------------------------------------------------------------------------------------
# Engine-side helpers
# ----------------------------------------------------------------------------------------------

def evaluate_engine(engine, num_prompts: int, threshold: float) -> dict:
    """Held-out exact match per task, greedy, exactly as ``dllm-jax eval`` decodes."""
    from dllm_jax.evaluate import evaluate

    def generate_fn(prompts, block_size, threshold):
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 256})
        return [(o["output_ids"], o["meta_info"]["forward_passes"]) for o in outs]

    r = evaluate(generate_fn, num_prompts=num_prompts, block_size=engine.block_size,
                 threshold=threshold, tokenizer=engine.tokenizer)
    names = [ex.task for ex in tasks.heldout_set(num_prompts)]
    return {"accuracy": r["accuracy"], "per_task": {t: v["accuracy"] for t, v in r["per_task"].items()},
            "num_prompts": {t: v["num_prompts"] for t, v in r["per_task"].items()},
            "correct": {t: [c for c, n in zip(r["correct_per_prompt"], names) if n == t] for t in r["per_task"]}}


def paired_change(before: list[int], after: list[int]) -> dict:
    """Two evaluations of the same prompts: how many flipped each way, and the exact two-sided McNemar p-value
    (a binomial test on the flips: under no change, each flip goes either way with probability 1/2)."""
    from math import comb

    up = sum(1 for b, a in zip(before, after) if a > b)
    down = sum(1 for b, a in zip(before, after) if a < b)
    n, k = up + down, min(up, down)
    p = min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"improved": up, "regressed": down, "p_value": p}


def sampled_reward(engine, num_prompts: int, task_names, samples: int, temperature: float, max_new_tokens: int,
                   seed: int) -> tuple[float, list[float]]:
    """The policy's expected reward on the held-out prompts of ``task_names`` (among the first ``num_prompts``):
    ``samples`` rollouts each at the training temperature, with the same seeds at every evaluation (common random
    numbers: a change between two evaluations is the policy's). Smoother than greedy exact match, which flips
    whole answers on small weight changes. Returns the mean and each prompt's mean."""
    from dllm_jax.evaluate import prompt_ids

    examples = [ex for ex in tasks.heldout_set(num_prompts) if ex.task in task_names]
    pids = prompt_ids(engine.tokenizer, examples)
    ids = [p for p in pids for _ in range(samples)]
    sp = [{"max_new_tokens": max_new_tokens, "temperature": temperature,
           "seed": rollout_seed(seed + 1_000_003, 0, i)} for i in range(len(ids))]  # never a training seed
    outs = engine.generate(input_ids=ids, sampling_params=sp)
    rewards = exact_match_rewards([examples[i // samples] for i in range(len(ids))], [o["text"] for o in outs])
    return float(np.mean(rewards)), rewards.reshape(len(examples), samples).mean(axis=1).tolist()


def named_params(params) -> dict:
    """Our parameter paths (``layers.0.qkv``) -> host arrays: what ``update_weights_from_tensor`` takes."""
    from dllm_jax.model.params import key_path, path_name

    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return {path_name(key_path(path)): np.asarray(leaf) for path, leaf in leaves}


def rollout_seed(seed: int, step: int, i: int) -> int:
    return int(np.random.default_rng([seed, step, i]).integers(0, 2 ** 32 - 1))


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, args, cfg, params):
        self.args, self.cfg = args, cfg
        self.params = params
        self.ref_params = jax.tree.map(jnp.copy, params) if args.kl_coef > 0 else None
        self.tx = optax.chain(optax.clip_by_global_norm(args.grad_clip),
                              optax.adamw(self.schedule(), b1=0.9, b2=0.99, weight_decay=args.weight_decay))
        self.opt_state = self.tx.init(params)
        self._apply = jax.jit(lambda p, s, g: self._update(p, s, g))
        self.seq_len = cfg.block_size

    def schedule(self):
        a = self.args
        if a.lr_schedule == "constant":
            return a.lr
        # one schedule step per optimizer step
        return optax.cosine_decay_schedule(a.lr, max(1, a.steps * a.ppo_epochs * a.minibatches))

    def _update(self, params, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)

    def fit_seq_len(self, prompts, completions):
        B = self.cfg.block_size
        need = max(len(p) + len(c) for p, c in zip(prompts, completions))
        self.seq_len = max(self.seq_len, -(-need // B) * B)  # only grows: few compiled shapes

    def pack(self, prompts, completions, **kw):
        a = self.args
        return rl_loss.pack(self.cfg, prompts, completions, seq_len=self.seq_len, rows_per_chunk=a.rows_per_chunk,
                            seqs_per_chunk=a.seqs_per_chunk, estimator=a.estimator, num_samples=a.num_samples, **kw)

    def logprobs(self, params, prompts, completions, seed):
        a = self.args
        return rl_loss.sequence_logprobs(params, self.cfg, prompts, completions, seq_len=self.seq_len,
                                         rows_per_chunk=a.rows_per_chunk, seqs_per_chunk=a.seqs_per_chunk,
                                         estimator=a.estimator, num_samples=a.num_samples, seed=seed)

    def train(self, prompts, completions, adv, mult, old_lp, ref_lp, seed, rng) -> dict:
        """``ppo_epochs`` x ``minibatches`` optimizer steps over the sequences (``mult``: the rollouts each stands
        for; the loss is a mean over rollouts); returns the mean metrics."""
        a = self.args
        n = len(prompts)
        metrics = []
        for _ in range(a.ppo_epochs):
            order = rng.permutation(n)
            for mb in np.array_split(order, min(a.minibatches, n)):
                sel = [int(i) for i in mb]
                chunks = self.pack([prompts[i] for i in sel], [completions[i] for i in sel],
                                   adv=[adv[i] for i in sel], old_lp=[old_lp[i] for i in sel],
                                   ref_lp=None if ref_lp is None else [ref_lp[i] for i in sel], seed=seed)
                grads, ms = None, []
                denom = jnp.float32(sum(mult[i] for i in sel))  # the loss is a mean over the rollouts
                for ch in chunks:
                    g, m = rl_loss.chunk_grads(self.params, *(jnp.asarray(x) for x in ch.arrays()), denom,
                                               cfg=self.cfg, clip_eps=float(a.clip_eps), kl_coef=float(a.kl_coef),
                                               one_per_row=a.estimator == "chain")
                    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                    ms.append(m)
                m = {k: float(sum(float(x[k]) for x in ms)) for k in ("loss", "pg", "kl", "clipped", "tokens")}
                m["max_abs_log_ratio"] = max(float(x["max_abs_log_ratio"]) for x in ms)
                new_params, new_state, gnorm = self._apply(self.params, self.opt_state, grads)
                m["grad_norm"] = float(gnorm)
                m["skipped"] = not (np.isfinite(m["grad_norm"]) and np.isfinite(m["loss"]))
                if not m["skipped"]:  # a non-finite gradient would poison the weights: drop that step
                    self.params, self.opt_state = new_params, new_state
                metrics.append(m)
        good = [m for m in metrics if not m["skipped"]] or metrics
        out = {k: float(np.mean([m[k] for m in good])) for k in ("loss", "pg", "kl", "grad_norm")}
        out["clip_frac"] = float(sum(m["clipped"] for m in metrics) / max(sum(m["tokens"] for m in metrics), 1))
        # before the first update the trainer's estimate must be the engine's (the ratio is 1)
        out["first_max_abs_log_ratio"] = metrics[0]["max_abs_log_ratio"]
        out["optimizer_steps"] = sum(not m["skipped"] for m in metrics)
        out["skipped_steps"] = sum(m["skipped"] for m in metrics)
        return out


def exact_match_rewards(examples, texts) -> np.ndarray:
    """Reward per rollout: 1.0 for an exact match of its example's answer (:func:`tasks.is_correct`), else 0.0."""
    return np.array([float(tasks.is_correct(ex, text)) for ex, text in zip(examples, texts)])


def run(args, engine=None, reward_fn=None) -> dict:
    """Train (see the module doc). ``engine``: use this running engine (left running) instead of building one;
    ``reward_fn(examples, texts) -> [n]``: rewards per rollout (default :func:`exact_match_rewards`). Returns
    what ``rl.json`` holds, plus ``params`` (the trainer's final parameters)."""
    import dllm_jax

    t_start = time.perf_counter()
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    if engine is not None:
        return _run(args, engine, out_dir, t_start, reward_fn or exact_match_rewards)
    engine = dllm_jax.Engine(args.model_path, algorithm_config={"threshold": args.threshold},
                             max_running_requests=args.max_running_requests)
    try:
        return _run(args, engine, out_dir, t_start, reward_fn or exact_match_rewards)
    finally:
        engine.shutdown()


def _run(args, engine, out_dir, t_start, reward_fn) -> dict:
    from dllm_jax.evaluate import prompt_ids
    from dllm_jax.model.loader import load_model

    cfg = engine.config  # the engine's (block size, mask id): the trainer's estimate must be Engine.score's
    params = jax.tree.map(jnp.asarray, load_model(engine.model_path, dtype="float32").params)
    trainer = Trainer(args, cfg, params)
    rng = np.random.default_rng([args.seed, 1])
    G = args.group_size
    log_rows, evals = [], []
    json_path, png_path = os.path.join(out_dir, "rl.json"), os.path.join(out_dir, "curve.png")

    def do_eval(step):
        if not args.eval_prompts:
            return
        t = time.perf_counter()
        ev = evaluate_engine(engine, args.eval_prompts, args.threshold)
        ev["target_accuracy"] = float(np.mean([ev["per_task"][k] for k in args.tasks]))
        if args.eval_samples:
            ev["target_sampled_reward"], ev["target_sampled_per_prompt"] = sampled_reward(
                engine, args.eval_prompts, args.tasks, args.eval_samples, args.temperature, args.max_new_tokens,
                args.seed)
        ev.update(step=step, seconds=round(time.perf_counter() - t, 2))
        evals.append(ev)
        print(f"eval @ step {step:3d}: " + "  ".join(f"{k} {v:.3f}" for k, v in ev["per_task"].items())
              + f"  | all {ev['accuracy']:.3f}"
              + (f"  | sampled reward ({','.join(args.tasks)}) {ev['target_sampled_reward']:.3f}"
                 if args.eval_samples else "") + f"  ({ev['seconds']:.1f} s)", flush=True)

    def write():
        result = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
                  "model_path": engine.model_path, "steps": log_rows, "evals": evals,
                  "medians": {k: statistics.median(r[k] for r in log_rows) for k in TIMINGS} if log_rows else {},
                  "wall_s": round(time.perf_counter() - t_start, 1)}
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        return result

    print(f"RL (GRPO) on {engine.model_path}: tasks {','.join(args.tasks)}, {args.prompts_per_step} prompts x "
          f"{G} rollouts per step, estimator {args.estimator}, lr {args.lr}, up to {args.steps} steps"
          + (f" / {args.minutes} min" if args.minutes else ""), flush=True)
    do_eval(0)
    version = engine.get_weight_version()
    step = 0
    while step < args.steps and not (args.minutes and time.perf_counter() - t_start > args.minutes * 60):
        step += 1
        row = {"step": step}
        # 1. rollouts
        t = time.perf_counter()
        examples = tasks.training_examples(args.seed + 1, step, args.prompts_per_step, tasks=args.tasks)
        pids = prompt_ids(engine.tokenizer, examples)
        ids = [p for p in pids for _ in range(G)]
        sp = [{"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
               "seed": rollout_seed(args.seed, step, i)} for i in range(len(ids))]
        outs = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
        versions = {o["meta_info"]["weight_version"] for o in outs}
        if versions != {version}:
            raise RuntimeError(f"step {step}: rollouts report weight_version {versions}, expected {version!r}")
        rewards = np.asarray(reward_fn([examples[i // G] for i in range(len(ids))], [o["text"] for o in outs]),
                             np.float64).reshape(len(examples), G)
        adv, keep = rl_loss.group_advantages(rewards)
        row["rollout_s"] = time.perf_counter() - t
        row.update(reward=float(rewards.mean()), groups_kept=int(keep.sum()), weight_version=version,
                   completion_tokens=float(np.mean([len(o["output_ids"]) for o in outs])))
        # identical rollouts of a group (same prompt, same tokens, same reward, so same advantage) have identical
        # gradients: each distinct one is scored and trained once, its advantage summed over its copies (the loss
        # is unchanged: the surrogate is linear in A for a fixed sign of A)
        prompts, completions, advs, mults, groups = [], [], [], [], []
        for g in np.flatnonzero(keep):
            distinct: dict[tuple, int] = {}
            for j in range(G):
                c = tuple(outs[g * G + j]["output_ids"])
                key = (c, float(rewards[g, j]))
                if key not in distinct:
                    distinct[key] = len(completions)
                    prompts.append(pids[g]), completions.append(list(c)), advs.append(0.0), mults.append(0)
                    groups.append(g)
                advs[distinct[key]] += float(adv[g, j])
                mults[distinct[key]] += 1
        row.update(rollouts_kept=int(sum(mults)), sequences_trained=len(completions))
        # 2. old-policy likelihoods, by the engine (one call per group: same prompt)
        t = time.perf_counter()
        old_lp = []
        for g in np.flatnonzero(keep):
            comps = [c for c, gg in zip(completions, groups) if gg == g]
            scores = engine.score(input_ids=pids[g], completions=comps, estimator=args.estimator,
                                  num_samples=args.num_samples, seed=step)
            old_lp += [np.asarray(s["token_logprobs"]) for s in scores]
        row["score_s"] = time.perf_counter() - t
        # 3. the trainer
        t = time.perf_counter()
        if completions:
            trainer.fit_seq_len(prompts, completions)
            ref_lp = trainer.logprobs(trainer.ref_params, prompts, completions, step) if args.kl_coef > 0 else None
            row.update(trainer.train(prompts, completions, advs, mults, old_lp, ref_lp, step, rng))
        else:
            row.update(loss=0.0, pg=0.0, kl=0.0, grad_norm=0.0, clip_frac=0.0, optimizer_steps=0, skipped_steps=0)
        jax.block_until_ready(trainer.params)
        row["train_s"] = time.perf_counter() - t
        # 4. the new weights into the same engine, from memory
        t = time.perf_counter()
        if completions and row["optimizer_steps"]:
            version = str(step)
            engine.update_weights_from_tensor(named_params(trainer.params), weight_version=version)
        row["update_s"] = time.perf_counter() - t
        row["elapsed_s"] = time.perf_counter() - t_start
        row = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
        log_rows.append(row)
        print(f"step {step:3d}  reward {row['reward']:.3f}  groups {row['groups_kept']:2d}/{len(examples)}  "
              f"seqs {row['sequences_trained']:3d}  "
              f"loss {row['loss']:+.4f}  clip {row['clip_frac']:.3f}  |  rollout {row['rollout_s']:.1f} s  "
              f"score {row['score_s']:.1f} s  train {row['train_s']:.1f} s  update {row['update_s']:.2f} s  "
              f"({row['elapsed_s'] / 60:.1f} min)", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            do_eval(step)
        write()
    if not evals or evals[-1]["step"] != step:
        do_eval(step)
    result = write()
    result["params"] = trainer.params
    plot(result, png_path)
    print(report(result), flush=True)
    print(f"wrote {json_path} and {png_path}", flush=True)
    return result


def report(result: dict) -> str:
    lines = [f"wall time {result['wall_s'] / 60:.1f} min"]
    m = result["medians"]
    if m:
        lines.append(f"per-step medians over {len(result['steps'])} steps:")
        lines.append(f"{'rollout s':>10} {'score s':>8} {'train s':>8} {'update s':>9}")
        lines.append(f"{m['rollout_s']:>10.2f} {m['score_s']:>8.2f} {m['train_s']:>8.2f} {m['update_s']:>9.3f}")
    if not result["evals"]:
        return "\n".join(lines)
    before, after = result["evals"][0], result["evals"][-1]
    lines.append(f"held-out exact match, greedy (step {before['step']} -> step {after['step']}):")
    lines.append(f"{'task':<10} {'prompts':>7} {'before':>7} {'after':>7}")
    for t in before["per_task"]:
        lines.append(f"{t:<10} {before['num_prompts'][t]:>7d} {before['per_task'][t]:>7.3f} "
                     f"{after['per_task'][t]:>7.3f}")
    lines.append(f"{'all':<10} {sum(before['num_prompts'].values()):>7d} {before['accuracy']:>7.3f} "
                 f"{after['accuracy']:>7.3f}")
    c = result["config"]
    for t in c["tasks"]:
        if t in before.get("correct", {}):
            d = paired_change(before["correct"][t], after["correct"][t])
            lines.append(f"{t}, prompt by prompt: {d['improved']} fixed, {d['regressed']} broken (exact McNemar "
                         f"p = {d['p_value']:.3g})")
    if "target_sampled_reward" in before:
        lines.append(f"held-out reward of {','.join(c['tasks'])}, sampled (T {c['temperature']}, "
                     f"{c['eval_samples']} per prompt): {before['target_sampled_reward']:.3f} -> "
                     f"{after['target_sampled_reward']:.3f}")
        if "target_sampled_per_prompt" in before:
            diff = np.subtract(after["target_sampled_per_prompt"], before["target_sampled_per_prompt"])
            lines.append(f"  paired by prompt: {diff.mean():+.3f} +- {diff.std(ddof=1) / np.sqrt(len(diff)):.3f} "
                         f"(standard error over {len(diff)} prompts)")
    return "\n".join(lines)


def plot(result: dict, png_path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[train]'): {png_path} not written", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in result["steps"]]
    reward = [r["reward"] for r in result["steps"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(steps, reward, color="tab:blue", alpha=0.35, lw=1, label="training rollout reward (per step)")
    if len(reward) >= 5:
        k = 5
        smooth = np.convolve(reward, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color="tab:blue", lw=2, label=f"training rollout reward ({k}-step mean)")
    ev_steps = [e["step"] for e in result["evals"]]  # (no evaluation: empty lines)
    c = result["config"]
    targets = c["tasks"]
    ax.plot(ev_steps, [e["target_accuracy"] for e in result["evals"]], "o-", color="tab:red", lw=2,
            label=f"held-out exact match, greedy: {','.join(targets)}")
    ax.plot(ev_steps, [e["accuracy"] for e in result["evals"]], "s--", color="tab:gray",
            label="held-out exact match, greedy: all six tasks")
    if result["evals"] and "target_sampled_reward" in result["evals"][0]:
        ax.plot(ev_steps, [e["target_sampled_reward"] for e in result["evals"]], "^-", color="tab:green",
                label=f"held-out reward, sampled (T {c['temperature']}, {c['eval_samples']} per prompt): "
                      f"{','.join(targets)}")
    ax.set_xlabel("step (one engine weight update each)")
    ax.set_ylabel("exact match")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8)
    ax.set_title(f"GRPO on sdar-tiny: {c['prompts_per_step']} prompts x {c['group_size']} rollouts, "
                 f"{c['estimator']} likelihood, lr {c['lr']} ({c.get('lr_schedule', 'constant')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
