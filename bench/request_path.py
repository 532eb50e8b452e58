"""Which host-side files of this repository run during one request (issue 45's "one request's path"): one
``Engine.generate`` after a first one compiled, traced with ``sys.setprofile`` on every thread; prints the files
and how many distinct functions of each ran. ``python -m bench.request_path shipped|diffusion_gemma``."""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading

import dllm_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dllm_jax.__file__)))
PACKAGES = tuple(os.path.join(ROOT, p) + os.sep for p in ("dllm_jax", "serve", "pallas_kernels"))


def trace(engine, **request) -> collections.Counter:
    """``(file, function) -> calls`` of this repository's code during the second of two identical requests."""
    engine.generate(**request)  # compiles what the request needs
    seen: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGES):
                seen[(os.path.relpath(path, ROOT), frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        engine.generate(**request)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def _engine_and_request(which: str):
    if which == "shipped":
        return dllm_jax.Engine(warmup=False), {"prompt": "Why is the sky blue?",
                                               "sampling_params": {"max_new_tokens": 32}}
    from dllm_jax.testing.diffusion_gemma import write_tiny_diffusion_gemma
    from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer

    path = tempfile.mkdtemp(prefix="dllm-request-path-")
    ids = write_gemma_tokenizer(path)
    write_tiny_diffusion_gemma(path, canvas_length=8, tie=True, vocab_size=405, sliding_window=6,
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    return dllm_jax.Engine(model_path=path, warmup=False), {"input_ids": list(range(5, 45)),
                                                            "sampling_params": {"max_new_tokens": 24, "seed": 1}}


def main(argv=None) -> int:
    which = (argv if argv is not None else sys.argv[1:] or ["shipped"])[0]
    if which not in ("shipped", "diffusion_gemma"):
        raise SystemExit("usage: python -m bench.request_path shipped|diffusion_gemma")
    engine, request = _engine_and_request(which)
    try:
        seen = trace(engine, **request)
    finally:
        engine.shutdown()
    files = collections.Counter(path for path, _ in seen)
    print(f"{which}: {len(files)} files, {len(seen)} distinct functions")
    for path, n in sorted(files.items()):
        print(f"  {path}: {n} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
