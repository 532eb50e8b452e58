"""``dllm-jax``: generate | eval | convert | plan, plus the commands other packages register (serve, bench).

Engine options are shared by every subcommand that builds an engine (:func:`add_engine_arguments`), so
``dllm-jax serve`` and ``dllm-jax generate`` accept the same flags as ``Engine(...)``.

``serve`` and ``bench`` live in their own packages, which depend on this one and never the reverse: they
register their subcommands through the ``dllm_jax.commands`` entry-point group (``pyproject.toml``), each entry a
``register(subparsers)`` function.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

COMMANDS_ENTRY_POINT = "dllm_jax.commands"


BACKEND_CHOICES = ("auto", "pallas", "xla", "pallas_interpret")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model-path", default=None, help="HF or converted model directory (default: the shipped model)")
    g.add_argument("--block-size", type=int, default=None, help="block size (default: the model's)")
    g.add_argument("--algorithm", default="LowConfidence",
                   help="decoding algorithm: LowConfidence, JointThreshold, JointThresholdInDel, EBSampling, "
                        "EntropyThreshold")
    g.add_argument("--algorithm-config", default=None,
                   help="YAML file or inline JSON object with the algorithm's options, e.g. '{\"threshold\": 0.9}'")
    g.add_argument("--schedule", choices=("fdfo", "sync"), default="fdfo")
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--max-running-requests", type=int, default=None)
    g.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV page pool size (default: chosen by --mem-fraction)")
    g.add_argument("--mem-fraction", type=float, default=None,
                   help="share of the memory free after the weights are placed that the KV pool takes: of the "
                        "GPU's free memory (default 0.85), of the available host memory on CPU (default 0.25)")
    g.add_argument("--sampling-defaults", choices=("model", "none"), default="model",
                   help="defaults of a request's unset temperature / top_p / top_k: the model's "
                        "generation_config.json (model), or greedy (none)")
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--max-prefill-tokens", type=int, default=None)
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    g.add_argument("--attention-backend", choices=BACKEND_CHOICES, default="auto",
                   help="auto (Pallas on GPU, XLA elsewhere), pallas (GPU only), xla, pallas_interpret (tests)")
    g.add_argument("--confidence-backend", choices=BACKEND_CHOICES, default="auto")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1)
    g.add_argument("--profile-dir", default=None, help="write a JAX profiler (perfetto) trace of the first steps here")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every shape bucket at start (default: on for serve, off otherwise)")
    g.add_argument("--shape-buckets", default=None, metavar="JSON",
                   help="padded shapes of the device calls, a JSON object with any of rows, pages, prefill_rows, "
                        "prefill_blocks (lists of sizes), e.g. '{\"rows\": [8], \"pages\": [16]}' (default: powers of "
                        "two up to what the limits need)")
    g.add_argument("--fold-commit-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="run the forward that writes a resolved block's exact KV inside the next block's first step "
                        "(default: on a GPU, where the extra row is nearly free; off on CPU, where it is not)")
    g.add_argument("--max-steps-per-call", type=int, default=None, metavar="N",
                   help="FDFO: the most denoise steps one device call runs while its batch stays the same "
                        "(default: until its first row is done; 1: one step per round)")
    g.add_argument("--chain-blocks", type=int, default=None, metavar="N",
                   help="FDFO: blocks a request may go on into inside one device call when nothing waits to join "
                        "(default: 4 without the folded commit forward, 0 with it; 0: off)")
    g.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persistent compilation cache directory, or 'off' (default: $DLLM_JAX_COMPILATION_CACHE "
                        "or ~/.cache/dllm-jax/xla)")


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of a multi-process run (one engine over several processes / hosts; see dllm_jax.distributed)."""
    from dllm_jax import distributed as d

    g = p.add_argument_group("multi-process (one engine over several hosts: run the same command on each)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help=f"process 0's address, reachable from every host (default: ${d.ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, default=None, help=f"processes in the group (default: "
                                                                     f"${d.ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, default=None,
                   help=f"this process's rank, 0 = the leader (default: ${d.ENV_PROCESS_ID})")
    g.add_argument("--collective-timeout", type=float, default=d.DEFAULT_COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                   help="a collective that waits longer on a peer fails, and the group with it (CPU / gloo; "
                        f"default {d.DEFAULT_COLLECTIVE_TIMEOUT_S:g})")
    g.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                   help="JAX's coordination service ends every process when one sends no heartbeat for this long "
                        "(default: JAX's, 100)")


def init_distributed(args: argparse.Namespace) -> bool:
    """Join the process group when the flags (or the environment) ask for one. Returns whether it did."""
    import os

    from dllm_jax import distributed as d

    wanted = (args.coordinator_address, args.num_processes, args.process_id,
              os.environ.get(d.ENV_NUM_PROCESSES), os.environ.get(d.ENV_PROCESS_ID))
    if all(v is None for v in wanted):
        return False
    d.initialize(args.coordinator_address, args.num_processes, args.process_id,
                 collective_timeout_s=args.collective_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
    return True


def engine_kwargs(args: argparse.Namespace) -> dict:
    config = args.algorithm_config
    if config is not None and config.lstrip().startswith("{"):
        config = json.loads(config)
    kwargs = dict(model_path=args.model_path, block_size=args.block_size, algorithm=args.algorithm,
                  algorithm_config=config, schedule=args.schedule, enable_prefix_cache=not args.disable_prefix_cache,
                  dtype=args.dtype, attention_backend=args.attention_backend,
                  confidence_backend=args.confidence_backend, tensor_parallel_size=args.tensor_parallel_size,
                  profile_dir=args.profile_dir, seed=args.seed, warmup=bool(args.warmup),
                  compilation_cache=args.compilation_cache,
                  sampling_defaults=getattr(args, "sampling_defaults", "model"))
    buckets = getattr(args, "shape_buckets", None)
    if buckets is not None:
        try:
            buckets = json.loads(buckets)
        except json.JSONDecodeError as e:
            raise ValueError(f"--shape-buckets: not valid JSON: {e}") from None
        if not isinstance(buckets, dict):
            raise ValueError("--shape-buckets: must be a JSON object, e.g. '{\"rows\": [8]}'")
        kwargs["shape_buckets"] = buckets
    for name in ("max_running_requests", "num_kv_pages", "mem_fraction", "context_length", "max_prefill_tokens",
                 "fold_commit_forward", "max_steps_per_call", "chain_blocks"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name, None)
    return kwargs


def build_engine(args: argparse.Namespace):
    from dllm_jax.engine import Engine

    return Engine(**engine_kwargs(args))


# ----------------------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    engine = build_engine(args)
    prompts = list(args.prompt)
    if args.file:
        with open(args.file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("dllm-jax generate: give a prompt or --file", file=sys.stderr)
        return 2
    texts = [p if args.raw else engine.apply_chat_template(p) for p in prompts]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed_sampling is not None:
        params["seed"] = args.seed_sampling
    if len(texts) == 1 and not args.json:
        for chunk in engine.generate(prompt=texts[0], sampling_params=params, stream=True):
            print(chunk["text"], end="", flush=True)
        print()
        engine.shutdown()
        return 0
    from tqdm import tqdm

    results = [None] * len(texts)
    with tqdm(total=len(texts), desc="generating", unit="prompt", disable=not sys.stderr.isatty() and not args.progress,
              file=sys.stderr) as bar:
        reqs = []
        for i, text in enumerate(texts):
            req = engine.make_request(engine.tokenize(text, f"prompt[{i}]"), params)
            reqs.append(engine.submit(req))
        done = set()
        while len(done) < len(reqs):
            engine.step()
            for i, req in enumerate(reqs):
                if req.finished and i not in done:
                    done.add(i)
                    results[i] = engine.result(req)
                    bar.update(1)
    for prompt, res in zip(prompts, results):
        if args.json:
            print(json.dumps({"prompt": prompt, **res}))
        else:
            print(res["text"])
    engine.shutdown()
    return 0


def cmd_convert(args) -> int:
    from dllm_jax.model.loader import convert_checkpoint

    convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, progress=sys.stderr.isatty())
    print(f"wrote {args.out_dir}")
    return 0


def cmd_eval(args) -> int:
    from dllm_jax.evaluate import evaluate, format_report

    algorithm_config = {"threshold": args.threshold}
    args.algorithm_config = json.dumps(algorithm_config) if args.algorithm_config is None else args.algorithm_config
    if args.block_size is None:
        args.block_size = 32
    engine = build_engine(args)

    def generate_fn(prompts, block_size, threshold):
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.max_new_tokens})
        return [(o["output_ids"], o["meta_info"]["forward_passes"]) for o in outs]

    result = evaluate(generate_fn, num_prompts=args.num_prompts, block_size=engine.block_size,
                      threshold=args.threshold, tokenizer=engine.tokenizer)
    result["algorithm"] = args.algorithm
    result["schedule"] = engine.schedule
    print(format_report(result))
    engine.shutdown()
    return 0


def cmd_plan(args) -> int:
    from dllm_jax.plan import run

    return run(args)


def main(argv=None) -> int:
    from dllm_jax import __version__

    p = argparse.ArgumentParser(prog="dllm-jax", description="Serve block-diffusion language models with JAX.")
    p.add_argument("--version", action="version", version=f"dllm-jax {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams a single prompt)")
    g.add_argument("prompt", nargs="*", help="prompt(s); wrapped in the chat template unless --raw")
    g.add_argument("--file", help="one prompt per line")
    g.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed-sampling", type=int, default=None, help="sampling seed for every request")
    g.add_argument("--json", action="store_true", help="print one JSON result per prompt")
    g.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    add_engine_arguments(g)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a HF safetensors directory to the engine's own layout (matrices "
                                       "pre-transposed, in --dtype), which loads at the speed of reading it")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    c.set_defaults(fn=cmd_convert)

    e = sub.add_parser("eval", help="exact-match accuracy and tokens per forward on the held-out tasks")
    e.add_argument("--num-prompts", type=int, default=200)
    e.add_argument("--threshold", type=float, default=0.9, help="the algorithm's threshold")
    e.add_argument("--max-new-tokens", type=int, default=256)
    add_engine_arguments(e)
    e.set_defaults(fn=cmd_eval)

    pl = sub.add_parser("plan", help="per-device memory of a model on a TP / EP mesh, without allocating")
    from dllm_jax.plan import add_arguments as add_plan_arguments

    add_plan_arguments(pl)
    pl.set_defaults(fn=cmd_plan)

    for register in _plugin_commands():
        register(sub)

    args = p.parse_args(argv)
    configure_logging()
    try:
        return args.fn(args) or 0
    except ValueError as err:
        print(f"dllm-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


def configure_logging(level: str = "info") -> None:
    """What a command-line user sees: our own one-line messages on stderr, JAX's and transformers' chatter
    (backend probing, advisory banners) only when it is a warning."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dllm-jax: %(message)s"))
    ours = logging.getLogger("dllm_jax")
    ours.handlers[:] = [handler]
    ours.setLevel(level.upper())
    ours.propagate = False
    for name in ("jax", "jax._src.xla_bridge", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _plugin_commands():
    """``register(subparsers)`` functions of the installed packages that add subcommands (serve, bench)."""
    from importlib.metadata import entry_points

    out = []
    for ep in sorted(entry_points(group=COMMANDS_ENTRY_POINT), key=lambda e: e.name):
        try:
            out.append(ep.load())
        except ImportError as e:  # a plugin whose own dependencies are missing: every other command still works
            logging.getLogger("dllm_jax").debug("command %s unavailable: %s", ep.name, e)
    return out


if __name__ == "__main__":
    sys.exit(main())
