"""``dllm-jax``: generate | eval | convert | plan, plus the commands other packages register (serve, bench).

Engine options are shared by every subcommand that builds an engine: :func:`add_engine_arguments` makes one flag
of each field of :class:`dllm_jax.EngineConfig`, so ``dllm-jax generate``, ``eval`` and ``serve`` accept the same
options as ``Engine(...)``.

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


def add_engine_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """One flag per field of :class:`dllm_jax.EngineConfig`, generated from the dataclass: ``--`` + the field's
    name with dashes (plus the field's extra spellings, e.g. ``--tp``), its help, choices and type; a boolean is
    ``--x / --no-x`` (and ``off_flag``, e.g. ``--disable-prefix-cache``); a dict field takes a JSON object.
    Every flag defaults to None, "not given": the field's own default applies (:func:`engine_kwargs`), and a
    command may tell an unset flag from a given one (``serve`` warms up unless ``--no-warmup``)."""
    import dataclasses

    from dllm_jax.engine.config import EngineConfig, field_kinds

    g = p.add_argument_group("engine", "the fields of dllm_jax.EngineConfig (dllm_jax/engine/config.py)")
    for f in dataclasses.fields(EngineConfig):
        m = f.metadata
        flags = m["flags"] or ("--" + f.name.replace("_", "-"),)
        kinds, _ = field_kinds(f)
        text = m["help"] + ("" if f.default is None else f" (default: {f.default})")
        kw = dict(dest=f.name, default=None, help=text.replace("%", "%%"))
        if bool in kinds:
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            if m["off_flag"]:
                g.add_argument(m["off_flag"], dest=f.name, action="store_const", const=False, default=None,
                               help=f"the same as --no-{flags[-1][2:]}")
            continue
        kind = int if int in kinds else float if float in kinds else str  # a dict field: its JSON text
        g.add_argument(*flags, type=kind, choices=m["choices"], metavar=m["metavar"] or ("JSON" if dict in kinds
                                                                                          else None), **kw)
    return g


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
    """The given engine flags as ``Engine(**kwargs)`` keywords, one per field of EngineConfig (a dict field's JSON
    text parsed; a field that also takes a string, as algorithm_config's YAML path, is JSON only when it starts
    with ``{``). A flag left unset (None) is left out: the field's default applies."""
    import dataclasses

    from dllm_jax.engine.config import EngineConfig, field_kinds

    kwargs = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        kinds, _ = field_kinds(f)
        if dict in kinds and isinstance(value, str) and (str not in kinds or value.lstrip().startswith("{")):
            flag = "--" + f.name.replace("_", "-")
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag}: not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"{flag}: must be a JSON object")
        kwargs[f.name] = value
    return kwargs


def build_engine(args: argparse.Namespace):
    from dllm_jax.engine import Engine, EngineConfig

    return Engine(EngineConfig(**engine_kwargs(args)))


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
    shown = sys.stderr.isatty() if args.progress is None else args.progress  # --progress: an EngineConfig field
    with tqdm(total=len(texts), desc="generating", unit="prompt", disable=not shown, file=sys.stderr) as bar:
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
    result["algorithm"] = engine.algorithm_name
    result["schedule"] = engine.schedule
    print(format_report(result))
    engine.shutdown()
    return 0


def cmd_plan(args) -> int:
    from dllm_jax.plan import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``dllm-jax`` parser: its own subcommands, then the installed packages' (serve, bench)."""
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
    add_engine_arguments(g)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a HF safetensors directory to the engine's own layout (one tensor "
                                       "per leaf, fused tensors split, in --dtype), which loads at the speed of "
                                       "reading it")
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
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
