"""``EngineConfig``: every engine option once (dllm_jax/engine/config.py). The flags of ``dllm-jax generate``,
``eval`` and ``serve`` are generated from its fields (a field added there is a flag with no other edit), today's
spellings keep working, bad values are a ValueError naming the field, and ``Engine(config)`` builds the same
engine as ``Engine(**kwargs)`` and as the command line."""

import argparse
import dataclasses
import json

import pytest

from conftest import ENGINE_KW
from dllm_jax.engine.config import EngineConfig, field_kinds, option

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def _engine_parsers() -> dict:
    from dllm_jax.cli import build_parser

    commands = _subparsers(build_parser())
    parsers = {name: commands[name] for name in ("generate", "eval")}
    try:
        import serve.cli
    except ImportError:  # serve's own dependencies missing: dllm-jax has no serve command then
        return parsers
    parsers["serve"] = commands["serve"]
    parsers["python -m serve"] = serve.cli.build_parser()
    return parsers


def _flags(f: dataclasses.Field) -> tuple:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def test_every_field_is_a_flag_of_generate_eval_and_serve_with_its_help():
    parsers = _engine_parsers()
    assert {"generate", "eval"} <= set(parsers)
    for command, parser in parsers.items():
        by_flag = parser._option_string_actions
        for f in dataclasses.fields(EngineConfig):
            for flag in _flags(f):
                assert flag in by_flag, f"{command}: no {flag} for EngineConfig.{f.name}"
                action = by_flag[flag]
                assert action.dest == f.name and action.default is None, (command, flag)
                assert f.metadata["help"] in action.help.replace("%%", "%"), (command, flag)
            if bool in field_kinds(f)[0]:
                assert "--no-" + f.name.replace("_", "-") in by_flag, (command, f.name)


def test_every_field_has_a_one_line_help():
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata.get("help")
        assert isinstance(text, str) and text.strip() and "\n" not in text, f.name


def test_the_flags_are_the_fields():
    """The engine group's flags are exactly the dataclass's fields (one dest each): nothing listed by hand."""
    from dllm_jax.cli import add_engine_arguments

    group = add_engine_arguments(argparse.ArgumentParser())
    assert {a.dest for a in group._group_actions} == set(FIELDS)


def test_a_field_added_to_the_dataclass_is_a_flag_with_no_other_edit(monkeypatch):
    import dllm_jax.engine.config as config_module
    from dllm_jax.cli import add_engine_arguments, engine_kwargs

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(EngineConfig):
        draft_steps: int | None = option(None, "a new option", minimum=1)
        eager_commit: bool = option(False, "a new switch")

    monkeypatch.setattr(config_module, "EngineConfig", Extended)
    parser = argparse.ArgumentParser()
    group = add_engine_arguments(parser)
    assert {a.dest for a in group._group_actions} == set(FIELDS) | {"draft_steps", "eager_commit"}
    kwargs = engine_kwargs(parser.parse_args(["--draft-steps", "3", "--eager-commit", "--tp", "2"]))
    assert kwargs == {"draft_steps": 3, "eager_commit": True, "tensor_parallel_size": 2}
    assert Extended(**kwargs).draft_steps == 3
    with pytest.raises(ValueError, match=r"draft_steps: must be an integer >= 1 or None, got 0"):
        Extended(draft_steps=0)


@pytest.mark.parametrize("argv, expected", [
    ([], {}),  # every flag unset: the dataclass's defaults apply (and serve can tell --no-warmup from nothing)
    (["--tp", "2"], {"tensor_parallel_size": 2}),
    (["--tensor-parallel-size", "2", "--ep", "2"], {"tensor_parallel_size": 2, "expert_parallel_size": 2}),
    (["--disable-prefix-cache"], {"enable_prefix_cache": False}),
    (["--no-enable-prefix-cache"], {"enable_prefix_cache": False}),
    (["--no-warmup"], {"warmup": False}),
    (["--warmup", "--no-fold-commit-forward"], {"warmup": True, "fold_commit_forward": False}),
    (["--shape-buckets", '{"rows": [8], "pages": [16]}'], {"shape_buckets": {"rows": [8], "pages": [16]}}),
    (["--algorithm-config", '{"threshold": 0.9}'], {"algorithm_config": {"threshold": 0.9}}),
    (["--algorithm-config", "sdar.yaml"], {"algorithm_config": "sdar.yaml"}),
    (["--schedule", "sync", "--dtype", "bfloat16", "--sampling-defaults", "none"],
     {"schedule": "sync", "dtype": "bfloat16", "sampling_defaults": "none"}),
    (["--mem-fraction", "0.3", "--num-kv-pages", "40", "--max-running-requests", "4"],
     {"mem_fraction": 0.3, "num_kv_pages": 40, "max_running_requests": 4}),
    (["--mask-token-id", "5", "--profile-steps", "8", "--expert-parallel-size", "1"],  # had no flag before
     {"mask_token_id": 5, "profile_steps": 8, "expert_parallel_size": 1}),
    (["--chain-blocks", "0", "--max-steps-per-call", "1", "--compilation-cache", "off"],
     {"chain_blocks": 0, "max_steps_per_call": 1, "compilation_cache": "off"}),
])
def test_flags_parse_as_before(argv, expected):
    from dllm_jax.cli import build_parser, engine_kwargs

    for command in ("generate", "eval"):
        kwargs = engine_kwargs(build_parser().parse_args([command, *argv]))
        assert kwargs == expected, command
        if not isinstance(kwargs.get("algorithm_config"), str):  # (a YAML path is read on construction)
            EngineConfig(**kwargs)  # valid


def test_bad_flags():
    from dllm_jax.cli import build_parser, engine_kwargs

    parser = build_parser()
    for argv in (["--schedule", "eager"], ["--tp", "two"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):  # argparse: choices and types
            parser.parse_args(["generate", *argv])
    for argv, message in ((["--shape-buckets", "{rows"], "--shape-buckets: not valid JSON"),
                          (["--shape-buckets", "[8]"], "--shape-buckets: must be a JSON object"),
                          (["--algorithm-config", "{"], "--algorithm-config: not valid JSON")):
        with pytest.raises(ValueError, match=message):
            engine_kwargs(parser.parse_args(["generate", *argv]))


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "eager"}, r"schedule: must be one of \('fdfo', 'sync'\), got 'eager'"),
    ({"max_running_requests": 0}, "max_running_requests: must be an integer >= 1, got 0"),
    ({"max_running_requests": "8"}, "max_running_requests: must be an integer >= 1"),
    ({"max_steps_per_call": 0}, "max_steps_per_call: must be an integer >= 1 or None, got 0"),
    ({"chain_blocks": 65}, "chain_blocks: must be an integer from 0 to 64 or None, got 65"),
    ({"chain_blocks": True}, "chain_blocks: must be an integer from 0 to 64 or None, got True"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size: must be an integer >= 1, got 0"),
    ({"expert_parallel_size": 1.5}, "expert_parallel_size: must be an integer >= 1, got 1.5"),
    ({"block_size": 0}, "block_size: must be an integer >= 1"),
    ({"algorithm_config": {"block_size": -4}}, "block_size: must be an integer >= 1, got -4"),
    ({"algorithm_config": 3}, "algorithm_config: expected a dict or a YAML path, got int"),
    ({"algorithm_config": "/nonexistent/sdar.yaml"}, "algorithm_config: cannot read /nonexistent/sdar.yaml"),
    ({"dtype": "float16"}, "dtype: must be one of"),
    ({"sampling_defaults": "openai"}, "sampling_defaults: must be one of"),
    ({"attention_backend": "cuda"}, "attention_backend: must be one of"),
    ({"confidence_backend": None}, "confidence_backend: must be a string, got None"),
    ({"mem_fraction": "half"}, "mem_fraction: must be a number or None"),
    ({"seed": -1}, "seed: must be an integer >= 0"),
    ({"profile_steps": -1}, "profile_steps: must be an integer >= 0"),
    ({"warmup": "yes"}, "warmup: must be True or False"),
    ({"shape_buckets": [8]}, "shape_buckets: must be a dict or None"),
    ({"model_path": 3}, "model_path: must be a string or a path or None"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=message):  # also when overriding a valid config
        dataclasses.replace(EngineConfig(), **kwargs)


def test_algorithm_config_yaml_sets_block_size(tmp_path):
    path = tmp_path / "algo.yaml"
    path.write_text("threshold: 0.8\nblock_size: 8\n")
    config = EngineConfig(algorithm_config=str(path))
    assert config.algorithm_options() == {"threshold": 0.8, "block_size": 8}
    resolved = config.resolved()
    assert resolved.block_size == 8 and resolved.algorithm_config == {"threshold": 0.8, "block_size": 8}
    assert EngineConfig(algorithm_config=path, block_size=4).resolved().block_size == 4  # explicit wins
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="algorithm_config: .*list.yaml must hold a mapping"):
        EngineConfig(algorithm_config=tmp_path / "list.yaml")


def test_derived_defaults_on_cpu():
    resolved = EngineConfig().resolved()  # the tests run JAX on CPU
    assert (resolved.dtype, resolved.attention_backend, resolved.confidence_backend) == ("float32", "xla", "xla")
    assert resolved.fold_commit_forward is False and resolved.chain_blocks == 4
    assert EngineConfig(fold_commit_forward=True).resolved().chain_blocks == 0  # a chained block needs the forward
    assert EngineConfig(fold_commit_forward=True, chain_blocks=2).resolved().chain_blocks == 2
    assert EngineConfig(progress=True).resolved().progress is True
    assert EngineConfig(dtype="bfloat16").resolved().dtype == "bfloat16"
    with pytest.raises(ValueError, match="attention_backend: 'pallas' needs a GPU"):
        EngineConfig(attention_backend="pallas").resolved()


def test_numpy_numbers_become_python_numbers():
    import numpy as np

    config = EngineConfig(max_running_requests=np.int64(4), mem_fraction=np.float32(0.5))
    assert type(config.max_running_requests) is int and type(config.mem_fraction) is float


def test_unknown_option_is_refused_before_loading():
    from dllm_jax import Engine

    with pytest.raises(TypeError, match="unknown option 'max_batch'"):
        Engine("/nonexistent/model/dir", max_batch=4)
    with pytest.raises(TypeError, match="config: expected a dllm_jax.EngineConfig"):
        Engine(config={"block_size": 4})
    with pytest.raises(TypeError, match="give the EngineConfig once"):
        Engine(EngineConfig(), config=EngineConfig())
    with pytest.raises(ValueError, match="max_running_requests"):  # an override is checked too
        Engine(config=EngineConfig(model_path="/nonexistent/model/dir"), max_running_requests=0)


def test_config_kwargs_and_flags_build_the_same_engine(tiny_model):
    import dllm_jax
    from dllm_jax import Engine
    from dllm_jax.cli import build_engine, build_parser

    assert dllm_jax.EngineConfig is EngineConfig
    kw = dict(ENGINE_KW, schedule="sync", algorithm_config={"threshold": 0.8}, chain_blocks=2, seed=3)
    engines = [Engine(tiny_model, **kw),
               Engine(EngineConfig(model_path=str(tiny_model), **kw)),
               Engine(config=EngineConfig(model_path=str(tiny_model), **dict(kw, schedule="fdfo")), schedule="sync")]
    flags = ["--model-path", str(tiny_model), "--schedule", "sync", "--algorithm-config", '{"threshold": 0.8}',
             "--chain-blocks", "2", "--seed", "3", "--max-running-requests", "8", "--context-length", "64",
             "--num-kv-pages", "96", "--shape-buckets", json.dumps({k: list(v) for k, v in
                                                                    ENGINE_KW["shape_buckets"].items()})]
    engines.append(build_engine(build_parser().parse_args(["generate", *flags])))
    try:
        info = engines[0].get_model_info()
        assert info["schedule"] == "sync" and info["chain_blocks"] == 2 and info["max_running_requests"] == 8
        for engine in engines[1:]:
            assert engine.get_model_info() == info
        assert engines[0].engine_config == engines[1].engine_config == engines[2].engine_config
        assert engines[0].engine_config.model_path == engines[0].model_path
        assert engines[0].engine_config.fold_commit_forward is False  # derived: CPU
    finally:
        for engine in engines:
            engine.shutdown()
