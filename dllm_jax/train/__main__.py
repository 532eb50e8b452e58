"""``python -m dllm_jax.train``: train the shipped block-diffusion model (see README.md here)."""

from __future__ import annotations

import argparse
import dataclasses

from dllm_jax.train.train import TrainConfig, train


def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m dllm_jax.train", description=__doc__)
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        v = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, tuple):
            conv = float if isinstance(v[0], float) else int
            p.add_argument(flag, default=v, type=lambda s, c=conv: tuple(c(x) for x in s.split(",")),
                           help=f"comma-separated (default {','.join(map(str, v))})")
        else:
            p.add_argument(flag, default=v, type=type(v), help=f"(default {v})")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="log lines only, no tqdm bar")
    args = p.parse_args(argv)
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if len(tc.block_sizes) != len(tc.block_size_probs):
        p.error("--block-sizes and --block-size-probs must have the same length")
    return tc, args


def main(argv=None) -> None:
    tc, args = parse_args(argv)
    train(tc, resume=args.resume, progress=not args.no_progress)


if __name__ == "__main__":
    main()
