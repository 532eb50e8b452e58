"""Train the shipped block-diffusion model from scratch (see ``dllm_jax/train/README.md``).

``python -m dllm_jax.train --out train_out/sdar-tiny`` trains the tokenizer, then the model with the
objective of :mod:`dllm_jax.train.objective`, logging a line every ``--log-every`` steps, writing
Orbax checkpoints (params, optimizer state, step, data seed, elapsed time) every ``--ckpt-every``
steps and at the end, a loss curve PNG next to them, and a HF model directory under ``OUT/hf``.
``--resume`` continues from the newest checkpoint in ``OUT``; ``--export DIR`` also copies the final
HF directory to ``DIR`` (the shipped model is exported to ``dllm_jax/assets/sdar-tiny``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dllm_jax.config import ModelConfig
from dllm_jax.model.params import init_params
from dllm_jax.train import data as data_lib
from dllm_jax.train import objective
from dllm_jax.train import tokenizer as tok_lib

DEFAULT_BLOCK_SIZE = 32


@dataclasses.dataclass
class TrainConfig:
    out: str = "train_out/sdar-tiny"
    # model
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    rope_theta: float = 1000.0
    max_position_embeddings: int = 512
    # data
    seq_len: int = data_lib.DEFAULT_SEQ_LEN
    batch_size: int = 16
    block_sizes: tuple = objective.BLOCK_SIZES
    block_size_probs: tuple = (0.2, 0.2, 0.2, 0.4)
    end_weight: float = 4.0     # loss weight of the stop positions (objective.loss_fn)
    seed: int = 0
    # optimization
    steps: int = 7500           # length of the LR schedule (and of training unless --minutes stops it first)
    minutes: float = 0.0        # > 0: stop (and export) after this much training wall time
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # bookkeeping
    log_every: int = 50
    ckpt_every: int = 500
    export: str = ""            # also copy the final HF directory here

    def model_config(self, vocab_size: int, mask_id: int, eos_ids: tuple[int, ...]) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rope_theta=self.rope_theta, tie_word_embeddings=True,
            max_position_embeddings=self.max_position_embeddings, architecture="SDARForCausalLM",
            model_type="qwen3", mask_token_id=mask_id, block_size=DEFAULT_BLOCK_SIZE, eos_token_ids=eos_ids,
        )


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``tc.steps``."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    p = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    # AdamW with the learning rate applied by the step (so the schedule is a plain function of the step).
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.scale_by_adam(),
        optax.add_decayed_weights(tc.weight_decay),
    )


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation, block_size: int, end_weight: float):
    def step(params, opt_state, key, lr, tokens, prompt_len, answer_end):
        (loss, metrics), grads = jax.value_and_grad(objective.loss_fn, has_aux=True)(
            params, cfg, key, tokens, prompt_len, answer_end, block_size, end_weight)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        metrics["grad_norm"] = optax.global_norm(grads)
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def block_size_for_step(tc: TrainConfig, step: int) -> int:
    rng = np.random.default_rng([tc.seed, step, 1])
    return int(rng.choice(np.asarray(tc.block_sizes), p=np.asarray(tc.block_size_probs)))


# ----------------------------------------------------------------------------------------------
# Checkpoints (Orbax): params + optimizer state, and JSON metadata (step, seeds, elapsed, config)
# ----------------------------------------------------------------------------------------------

def _manager(ckpt_dir: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(mgr, step: int, params, opt_state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()


def restore_checkpoint(mgr, params, opt_state):
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"params": params, "opt_state": opt_state})
    out = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out["state"]["params"], out["state"]["opt_state"], out["meta"]


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------

def export_hf(params, cfg: ModelConfig, tokenizer, out_dir: str, card: dict | None = None) -> None:
    """A standard HF directory: config.json, model.safetensors, tokenizer files, generation_config.json."""
    from dllm_jax.model.converted import save_hf

    os.makedirs(out_dir, exist_ok=True)
    save_hf(jax.device_get(params), cfg, out_dir)
    tok_lib.save_tokenizer(tokenizer, out_dir)
    ids = tok_lib.special_ids(tokenizer)
    gen = {
        "eos_token_id": [ids[tok_lib.IM_END], ids[tok_lib.ENDOFTEXT]],
        "pad_token_id": ids[tok_lib.ENDOFTEXT],
        "mask_token_id": ids[tok_lib.MASK],
        "block_size": cfg.block_size,
        "do_sample": False,
        "max_new_tokens": 256,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if card is not None:
        with open(os.path.join(out_dir, "training_info.json"), "w") as f:
            json.dump(card, f, indent=2)


# ----------------------------------------------------------------------------------------------
# Logging and the loss curve
# ----------------------------------------------------------------------------------------------

def _read_log(path: str, upto_step: int | None = None) -> list[dict]:
    if not os.path.isfile(path):
        return []
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if upto_step is None or r["step"] <= upto_step]


def plot_loss(log_rows: list[dict], png_path: str, title: str = "") -> None:
    if not log_rows:
        return
    try:
        import matplotlib
    except ImportError:  # the plot is a by-product; training results do not depend on it
        print(f"matplotlib is not installed (pip install -e '.[train]'): {png_path} not written", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log_rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [r["loss"] for r in log_rows], label="loss (1/t-weighted ELBO per answer token)")
    ax[0].plot(steps, [r["masked_ce"] for r in log_rows], label="cross-entropy on masked tokens")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[0].grid(alpha=0.3)
    ax[1].plot([r["elapsed"] / 60 for r in log_rows], [1 - r["masked_acc"] for r in log_rows])
    ax[1].set_yscale("log")
    ax[1].set_xlabel("training wall time (min)")
    ax[1].set_ylabel("masked-token error rate")
    ax[1].grid(alpha=0.3)
    fig.suptitle(title or "block-diffusion training")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def train(tc: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    out = os.path.abspath(tc.out)
    os.makedirs(out, exist_ok=True)
    tok_dir = os.path.join(out, "tokenizer")
    if resume and os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        tok_lib.check_tokenizer(tokenizer)
    else:
        tokenizer = tok_lib.train_tokenizer()
        tok_lib.save_tokenizer(tokenizer, tok_dir)
    encoder = data_lib.Encoder(tokenizer)
    ids = tok_lib.special_ids(tokenizer)
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)
    cfg = tc.model_config(vocab, encoder.mask_id, (ids[tok_lib.IM_END], ids[tok_lib.ENDOFTEXT]))

    tx = make_optimizer(tc)
    params = init_params(cfg, jax.random.key(tc.seed))
    opt_state = tx.init(params)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    mgr = _manager(os.path.join(out, "checkpoints"))
    log_path = os.path.join(out, "train_log.jsonl")
    start_step, elapsed, cpu = 0, 0.0, 0.0
    if resume:
        restored = restore_checkpoint(mgr, params, opt_state)
        if restored is not None:
            params, opt_state, meta = restored
            start_step, elapsed, cpu = int(meta["step"]), float(meta["elapsed"]), float(meta.get("cpu_s", 0.0))
            if meta.get("seed", tc.seed) != tc.seed:
                raise ValueError(f"checkpoint was trained with seed {meta['seed']}, not {tc.seed}")
            print(f"resumed from step {start_step} ({elapsed / 60:.1f} min trained)", flush=True)
    rows = _read_log(log_path, start_step)
    with open(log_path, "w") as f:  # drop log lines past the checkpoint we resumed from
        f.writelines(json.dumps(r) + "\n" for r in rows)

    print(f"model: {n_params / 1e6:.2f}M params, vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, "
          f"{cfg.num_layers} layers, heads {cfg.num_heads}/{cfg.num_kv_heads}; batch {tc.batch_size} x "
          f"{tc.seq_len} tokens (two copies: {2 * tc.seq_len}); steps {tc.steps}"
          + (f", stop after {tc.minutes} min" if tc.minutes else ""), flush=True)
    steps_fns = {b: make_train_step(cfg, tx, b, tc.end_weight) for b in tc.block_sizes}
    base_key = jax.random.key(tc.seed + 1)

    def meta(step):
        return {"step": step, "elapsed": elapsed, "cpu_s": cpu_before + time.process_time() - cpu_start, "seed": tc.seed, "train_config": _jsonable(dataclasses.asdict(tc)),
                "model_config": cfg.to_hf_dict()}

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=tc.steps, initial=start_step, unit="step", mininterval=5, dynamic_ncols=True)
        except ImportError:
            bar = None
    step = start_step
    window = []
    session_start = t_last = time.time()
    elapsed_before, cpu_before, cpu_start = elapsed, cpu, time.process_time()
    tokens_since = 0
    log_f = open(log_path, "a")
    while step < tc.steps and not (tc.minutes and elapsed >= tc.minutes * 60):
        b = block_size_for_step(tc, step)
        batch = data_lib.training_batch(encoder, tc.seed, step, tc.batch_size, tc.seq_len)
        key = jax.random.fold_in(base_key, step)
        lr = learning_rate(tc, step)
        params, opt_state, metrics = steps_fns[b](
            params, opt_state, key, jnp.float32(lr), batch.tokens, batch.prompt_len, batch.answer_end)
        if window:  # wait for the previous step only: the next batch is built while this one runs
            jax.block_until_ready(window[-1]["loss"])
        window.append(metrics)
        tokens_since += tc.batch_size * tc.seq_len
        step += 1
        if step % tc.log_every == 0 or step == tc.steps:
            m = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
            now = time.time()
            elapsed = elapsed_before + now - session_start
            row = {"step": step, "lr": lr, "elapsed": round(elapsed, 1),
                   "cpu_s": round(cpu_before + time.process_time() - cpu_start, 1), **{k: round(v, 5) for k, v in m.items()},
                   "tokens_per_s": round(tokens_since / max(now - t_last, 1e-9), 1)}
            log_f.write(json.dumps(row) + "\n")
            log_f.flush()
            msg = (f"step {step:5d}  loss {m['loss']:.4f}  masked_ce {m['masked_ce']:.4f}  "
                   f"masked_acc {m['masked_acc']:.4f}  lr {lr:.2e}  tok/s {row['tokens_per_s']:.0f}  "
                   f"elapsed {elapsed / 60:.1f} min")
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, flush=True)
            window, tokens_since, t_last = [], 0, now
        else:
            elapsed = elapsed_before + time.time() - session_start
        if bar is not None:
            bar.update(1)
        if step % tc.ckpt_every == 0:
            save_checkpoint(mgr, step, params, opt_state, meta(step))
            plot_loss(_read_log(log_path), os.path.join(out, "loss_curve.png"))
    log_f.close()
    if bar is not None:
        bar.close()
    elapsed = elapsed_before + time.time() - session_start
    if mgr.latest_step() != step:
        save_checkpoint(mgr, step, params, opt_state, meta(step))
    mgr.close()
    rows = _read_log(log_path)
    plot_loss(rows, os.path.join(out, "loss_curve.png"),
              f"{n_params / 1e6:.2f}M-param SDAR-style model: {step} steps, {elapsed / 60:.1f} min")
    final = rows[-1] if rows else {}
    cpu = cpu_before + time.process_time() - cpu_start
    card = {
        "steps": step, "train_minutes": round(elapsed / 60, 2), "train_cpu_minutes": round(cpu / 60, 2), "final_log": final, "params": n_params,
        "train_config": _jsonable(dataclasses.asdict(tc)),
        "command": "python -m dllm_jax.train " + " ".join(_cli_args(tc)),
    }
    hf_dir = os.path.join(out, "hf")
    export_hf(params, cfg, tokenizer, hf_dir, card)
    if tc.export:
        if os.path.isdir(tc.export):
            shutil.rmtree(tc.export)
        shutil.copytree(hf_dir, tc.export)
    print(f"done: {step} steps in {elapsed / 60:.1f} min (process CPU time {cpu / 60:.1f} min); HF model in {hf_dir}"
          + (f" (exported to {tc.export})" if tc.export else ""), flush=True)
    return {"params": params, "config": cfg, "tokenizer": tokenizer, "steps": step, "elapsed": elapsed,
            "hf_dir": hf_dir, "final": final}


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _cli_args(tc: TrainConfig) -> list[str]:
    defaults = TrainConfig()
    args = []
    for f in dataclasses.fields(TrainConfig):
        v = getattr(tc, f.name)
        if v != getattr(defaults, f.name) or f.name == "out":
            if isinstance(v, tuple):
                v = ",".join(str(x) for x in v)
            args.append(f"--{f.name.replace('_', '-')} {v}")
    return args
