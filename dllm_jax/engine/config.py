"""``EngineConfig``: every option of :class:`dllm_jax.Engine`, described once.

A field is an option: its name, type and default, a one-line help (``metadata["help"]``), and for the checks and
the command line: ``choices``, bounds (``minimum`` / ``maximum``), extra flag spellings (``flags``, e.g.
``--tp``) and a flag that turns a boolean off (``off_flag``). From these fields alone come

* the checks: :meth:`EngineConfig.validate` (run on construction) refuses a bad value with a ``ValueError``
  naming the field; checks that need the loaded model (``context_length`` / ``max_prefill_tokens`` against the
  block size, the algorithm's own options, the KV pool's size) stay in the engine;
* the derived defaults: :meth:`EngineConfig.resolved` fills in every ``None`` / ``"auto"`` that depends on the
  platform or on another field (documented in each field's help);
* the flags of ``dllm-jax generate``, ``eval`` and ``serve``: ``--`` + the field's name with dashes
  (:func:`dllm_jax.cli.add_engine_arguments`), so a field added here is a flag with no other edit.

``Engine(EngineConfig(block_size=8))``, ``Engine(block_size=8)`` and ``Engine(config=cfg, block_size=8)`` build
the same engine. This module imports neither JAX nor the engine: the command line reads it to build its parser.
"""

import dataclasses
import numbers
import os
import sys
import types
import typing

SCHEDULES = ("fdfo", "sync")
SAMPLING_DEFAULTS = ("model", "none")
DTYPES = ("auto", "float32", "bfloat16")
BACKENDS = ("auto", "pallas", "xla", "pallas_interpret")  # dllm_jax.decode.backends.BACKENDS (that one imports JAX)
DEFAULT_MAX_RUNNING_REQUESTS = 32
DEFAULT_CHAIN_BLOCKS = 4  # chain_blocks when the commit forward is not folded
MAX_CHAIN_BLOCKS = 64


def option(default, help: str, *, choices: tuple | None = None, minimum: int | None = None,
           maximum: int | None = None, flags: tuple[str, ...] = (), off_flag: str | None = None,
           metavar: str | None = None):
    """One field of :class:`EngineConfig`: its default and what the checks and the command line read."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "flags": tuple(flags),
        "off_flag": off_flag, "metavar": metavar})


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The options of :class:`dllm_jax.Engine` (one field each; ``help`` says what it does and what ``None`` /
    ``"auto"`` resolve to). Invalid values raise ``ValueError`` naming the field at construction."""

    model_path: str | os.PathLike | None = option(
        None, "model directory: a published HF checkpoint (SDAR / Qwen3, SDAR-MoE, LLaDA2) or one `dllm-jax "
              "convert` wrote (None: the small model shipped inside the package)", metavar="DIR")
    block_size: int | None = option(
        None, "tokens per block, also the KV page size (None: algorithm_config's block_size key, else the "
              "model's default)", minimum=1)
    algorithm: str | None = option(
        None, "decoding algorithm (SGLang's names; default: the model family's): LowConfidence (SDAR / LLaDA2's "
              "default), JointThreshold, JointThresholdInDel, EBSampling, EntropyThreshold; Gemma4Renoise "
              "(DiffusionGemma's, its only one)")
    algorithm_config: dict | str | os.PathLike | None = option(
        None, "the algorithm's options: a dict (on the command line a JSON object, e.g. '{\"threshold\": 0.9}') or "
              "an SGLang-style YAML path; its block_size key sets block_size when that is unset",
        metavar="YAML|JSON")
    schedule: str = option(
        "fdfo", "fdfo (first done, first out: rows join and leave between steps, and a device call runs steps only "
                "until its first row is done) or sync (each round runs whole blocks on the device)",
        choices=SCHEDULES)
    enable_prefix_cache: bool = option(
        True, "reuse the KV of prompt blocks another request already computed (the block radix index)",
        off_flag="--disable-prefix-cache")
    max_running_requests: int = option(
        DEFAULT_MAX_RUNNING_REQUESTS, "rows per denoise step: the most requests decoded together", minimum=1)
    num_kv_pages: int | None = option(
        None, "KV page pool size, one page per block; small values force retraction (None: chosen by "
              "mem_fraction)")
    mem_fraction: float | None = option(
        None, "share of the memory free once the weights are placed that the KV pool takes: of the device's free "
              "memory on GPU (None: 0.85), of the available host memory on CPU (None: 0.25); too little for one "
              "request at context_length is a ValueError (dllm_jax/engine/memory.py)")
    sampling_defaults: str = option(
        "model", "model: a request's unset temperature / top_p / top_k take the values of the model's "
                 "generation_config.json (do_sample: false meaning greedy); none: SamplingParams' own (greedy)",
        choices=SAMPLING_DEFAULTS)
    dtype: str = option(
        "auto", "weights, KV pool and activations, with float32 norms, softmaxes, logits and decisions (auto: "
                "bfloat16 on GPU, float32 elsewhere; bfloat16 works on CPU too)", choices=DTYPES)
    attention_backend: str = option(
        "auto", "auto (pallas on GPU, xla elsewhere), pallas (compiled kernels: GPU only, refused elsewhere), xla, "
                "pallas_interpret (tests)", choices=BACKENDS)
    confidence_backend: str = option(
        "auto", "the kernel that turns logits into confidences and candidates; the same choices as "
                "attention_backend (auto on GPU: pallas or xla per shape, from the measured table "
                "pallas_kernels/confidence_crossover.json)", choices=BACKENDS)
    tensor_parallel_size: int = option(
        1, "devices the heads and hidden dimensions are sharded over (a device mesh, dllm_jax/sharding.py; "
           "several processes: the total device count)", minimum=1, flags=("--tp", "--tensor-parallel-size"))
    expert_parallel_size: int = option(
        1, "devices the experts of an MoE model are sharded over (mesh axis ep; tensor_parallel_size x "
           "expert_parallel_size devices in all)", minimum=1, flags=("--ep", "--expert-parallel-size"))
    profile_dir: str | os.PathLike | None = option(
        None, "write a JAX profiler (perfetto) trace of the first profile_steps steps here (None: no trace)",
        metavar="DIR")
    profile_steps: int = option(
        64, "engine steps a trace records (profile_dir, start_profile); 0: until stop_profile", minimum=0)
    seed: int = option(0, "seed of the sampling seeds of requests that give none", minimum=0)
    weight_version: str = option(
        "default", "the name of the loaded weights, in every answer's meta_info.weight_version until an update "
                   "renames them (update_weights_from_disk / _from_tensor, update_weight_version)")
    context_length: int | None = option(
        None, "the most tokens (prompt and output) of one request, at least one block (None or 0: the model's "
              "max_position_embeddings)")
    max_prefill_tokens: int = option(2048, "prompt tokens encoded per prefill forward, at least one block")
    mask_token_id: int | None = option(
        None, "the mask token's id (None: from config.json or the tokenizer)", minimum=0)
    warmup: bool = option(
        False, "compile every shape bucket at start, so that no request waits on a compile (dllm-jax serve: on "
               "unless --no-warmup)")
    fold_commit_forward: bool | None = option(
        None, "run the forward that only writes a resolved block's exact KV inside the next block's first step: "
              "the same tokens, one sequential forward fewer per block, one more row in that step; False: SGLang's "
              "forward count (None: True on an accelerator, where the extra row is nearly free; False on CPU, "
              "where it measured slower at 1, 16 and 64 requests, bench/RESULTS.md)")
    compilation_cache: str | os.PathLike | None = option(
        None, "persistent compilation cache directory, or 'off' (None: $DLLM_JAX_COMPILATION_CACHE or "
              "~/.cache/dllm-jax/xla; dllm_jax/compile_cache.py)", metavar="DIR")
    progress: bool | None = option(
        None, "progress bars while the weights load and the buckets compile, and over dllm-jax generate's "
              "batch (None: when stderr is a terminal)")
    shape_buckets: dict | None = option(
        None, "padded shapes of the device calls: a dict (a JSON object) with any of rows, pages, prefill_rows, "
              "prefill_blocks (lists of sizes), e.g. '{\"rows\": [8], \"pages\": [16]}' (None: powers of two up to "
              "what the limits need; ShapeBuckets in dllm_jax/engine/compilation.py)", metavar="JSON")
    max_steps_per_call: int | None = option(
        None, "FDFO: the most denoise steps one device call runs while its batch stays the same; it ends anyway "
              "when its first row is done, and runs one step whenever a request could join, one is still "
              "prefilling or a row streams provisional blocks (None: no further limit; 1: one step per round, as "
              "SGLang)", minimum=1, metavar="N")
    chain_blocks: int | None = option(
        None, "when no request waits to join, blocks a request may go on into inside the same device call unless "
              "a stop token ends it (FDFO: calls of up to two requests; sync: a request running alone; never "
              "streamed requests or ones with stop strings, logprobs or penalties): fewer host round trips, the "
              "same tokens (None: 4, or 0 when fold_commit_forward is on, since a block a request goes on from "
              "needs the forward folding saves; 0: off)", minimum=0, maximum=MAX_CHAIN_BLOCKS, metavar="N")
    grammar_frontier: str = option(
        "forced", "structured output, mask-block models: 'forced' decides a constrained row's first undecided "
                  "position at every step (a token from the grammar's mask: the most tokens per forward measured on "
                  "the shipped model, one device step per call); 'model' lets the algorithm decide it by its "
                  "confidence under the mask, in the model's own order, so the device loop goes on until a row "
                  "decides it (forced once the row runs 3 positions past it or breaks the grammar in a block; "
                  "dllm_jax/decode/grammar_mask.py)", choices=("forced", "model"))
    host_overlap: bool = option(
        True, "while a denoise call runs on the device, the host hands the previous round's outputs to their "
              "consumers (stream chunks) and admits and prefills new requests (never by retracting a running "
              "one); off: all of it between calls, as before", off_flag="--disable-host-overlap")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # numpy scalars and the like become plain Python numbers
            value = getattr(self, f.name)
            kinds, _ = field_kinds(f)
            if isinstance(value, bool) or value is None:
                continue
            if int in kinds and isinstance(value, numbers.Integral):
                object.__setattr__(self, f.name, int(value))
            elif float in kinds and isinstance(value, numbers.Real):
                object.__setattr__(self, f.name, float(value))
        self.validate()

    def validate(self) -> None:
        """Every check that needs no model: types, choices and bounds of each field, then ``algorithm_config``
        (readable, a mapping) and the ``block_size`` it may set. Raises ``ValueError`` naming the field."""
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))
        options = self.algorithm_options()
        if self.block_size is None and "block_size" in options:
            block_size = options["block_size"]
            if not _is_int(block_size) or block_size < 1:
                raise ValueError(f"block_size: must be an integer >= 1, got {block_size!r} (algorithm_config's)")

    def algorithm_options(self) -> dict:
        """``algorithm_config`` as a dict (read from its YAML file when it is a path)."""
        return load_algorithm_config(self.algorithm_config)

    def resolved(self) -> "EngineConfig":
        """This config with its derived defaults filled in for the platform JAX runs on: ``algorithm_config``
        loaded (a dict), ``block_size`` from its ``block_size`` key when unset, ``dtype`` and the two backends'
        ``"auto"``, ``fold_commit_forward`` (on an accelerator), ``chain_blocks`` (by ``fold_commit_forward``) and
        ``progress`` (stderr is a terminal). A backend the platform cannot run is refused here."""
        import jax

        from dllm_jax.decode.backends import resolve_backend
        from pallas_kernels import resolve_confidence_backend

        platform = jax.default_backend()
        options = self.algorithm_options()
        fold = platform != "cpu" if self.fold_commit_forward is None else bool(self.fold_commit_forward)
        return dataclasses.replace(
            self, algorithm_config=options,
            block_size=options.get("block_size") if self.block_size is None else self.block_size,
            attention_backend=resolve_backend(self.attention_backend, "attention_backend"),
            confidence_backend=resolve_confidence_backend(self.confidence_backend, "confidence_backend"),
            dtype=("bfloat16" if platform == "gpu" else "float32") if self.dtype == "auto" else self.dtype,
            fold_commit_forward=fold,
            chain_blocks=(0 if fold else DEFAULT_CHAIN_BLOCKS) if self.chain_blocks is None else self.chain_blocks,
            progress=sys.stderr.isatty() if self.progress is None else bool(self.progress))


def engine_config(model_path=None, config: EngineConfig | None = None, options: dict | None = None) -> EngineConfig:
    """The config of ``Engine(model_path, config=config, **options)``: an :class:`EngineConfig` given positionally
    or as ``config=``, with ``options`` overriding its fields, or the options alone."""
    options = dict(options or {})
    if isinstance(model_path, EngineConfig):
        if config is not None:
            raise TypeError("Engine: give the EngineConfig once, positionally or as config=")
        config, model_path = model_path, None
    if model_path is not None:
        options["model_path"] = model_path
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    for name in options:
        if name not in names:
            raise TypeError(f"Engine: unknown option {name!r} (the options are the fields of dllm_jax.EngineConfig)")
    if config is None:
        return EngineConfig(**options)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config: expected a dllm_jax.EngineConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **options) if options else config


def field_kinds(f: dataclasses.Field) -> tuple[tuple[type, ...], bool]:
    """A field's accepted types other than None, and whether None is accepted."""
    tp = f.type
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    return tuple(a for a in args if a is not type(None)), type(None) in args


def load_algorithm_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        import yaml

        try:
            with open(config) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"algorithm_config: cannot read {config}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"algorithm_config: {config} must hold a mapping")
        return data
    raise ValueError(f"algorithm_config: expected a dict or a YAML path, got {type(config).__name__}")


_NAMES = {str: "a string", dict: "a dict", os.PathLike: "a path"}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check(f: dataclasses.Field, value) -> None:
    kinds, optional = field_kinds(f)
    if value is None and optional:
        return
    if f.name == "algorithm_config":  # its own messages (a path is read by algorithm_options)
        return
    m = f.metadata
    lo, hi = m.get("minimum"), m.get("maximum")
    if int in kinds:
        ok = _is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
        expected = ("an integer" + (f" from {lo} to {hi}" if lo is not None and hi is not None else
                                    f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""))
    elif float in kinds:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        expected = "a number"
    elif bool in kinds:
        ok, expected = isinstance(value, bool), "True or False"
    else:
        ok = isinstance(value, kinds)
        expected = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
    if not ok:
        raise ValueError(f"{f.name}: must be {expected}{' or None' if optional else ''}, got {value!r}")
    if m.get("choices") is not None and value not in m["choices"]:
        raise ValueError(f"{f.name}: must be one of {m['choices']}, got {value!r}")
