"""``python -m dllm_jax.train.eval_naive``: evaluate a model with the naive reference decoder.

Same defaults and report as ``dllm-jax eval`` (the shipped model, the held-out set, B = 32,
LowConfidence 0.9), but decoding with :mod:`dllm_jax.train.naive_decode` instead of the engine.
"""

from __future__ import annotations

import argparse
import time

from dllm_jax.evaluate import evaluate, format_report


def naive_generate_fn(model_path: str | None = None, *, max_new_tokens: int = 256, batch_size: int = 16):
    from dllm_jax.model.loader import load_model
    from dllm_jax.train.naive_decode import naive_generate

    if model_path is None:
        from dllm_jax.assets import DEFAULT_MODEL_PATH

        model_path = DEFAULT_MODEL_PATH
    model = load_model(model_path)

    def generate_fn(prompts, block_size, threshold):
        return naive_generate(model.params, model.config, prompts, block_size=block_size, threshold=threshold,
                              max_new_tokens=max_new_tokens, batch_size=batch_size)

    return generate_fn, model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dllm_jax.train.eval_naive", description=__doc__)
    p.add_argument("--model-path", default=None, help="model directory (default: the shipped model)")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    generate_fn, model = naive_generate_fn(args.model_path, max_new_tokens=args.max_new_tokens,
                                           batch_size=args.batch_size)
    t0 = time.time()
    result = evaluate(generate_fn, num_prompts=args.num_prompts, block_size=args.block_size,
                      threshold=args.threshold, tokenizer=model.tokenizer)
    print(f"model: {model.model_path} (naive reference decoder, {time.time() - t0:.0f} s)")
    print(format_report(result))


if __name__ == "__main__":
    main()
