"""Test-wide settings: CPU only, four virtual CPU devices (for the sharding tests), float32 matmuls, and one
persistent compilation cache for the whole run.

The suite's time is almost all XLA compilation, so: every executable goes to a compilation cache shared by the
run's processes (this one, the servers and CLIs it starts), created empty for the run unless
``DLLM_JAX_COMPILATION_CACHE`` points somewhere already (a developer may keep one between runs; CI starts empty).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile for a shorter suite: most of its time is XLA compilation (measured: 335 s of 580 s summed over the tests;
# the engine's step alone, ~135 fusions for a 2-layer model, 1.3-4 s a compile, half of it in XLA's fusion emitters
# and half in LLVM). LLVM at -O1 without its expensive passes compiles the step about 10% faster (1.79 -> 1.63 s)
# and runs the shipped model as fast as the default -O2 does; XLA's older loop emitters instead of its MLIR fusion
# emitters (--xla_cpu_use_fusion_emitters=false) halve a tiny engine's warm-up compile (10-12 s -> 5.3 s) and took
# the suite from 234 s to 176 s (two processes, back to back); -O0 would compile a third faster but doubled the
# shipped model's step time (all measured). The HLO programs, fusions and dot kernels are XLA's either way;
# elementwise code may round differently in the last bit (measured: the same tokens, log-probabilities within 3e-6),
# so the float64-reference checks classify the same way. Servers and CLIs the tests start get the same flags (same
# programs: one cache). DLLM_TEST_XLA_FLAGS="" runs the suite with XLA's default compilation.
TEST_XLA_FLAGS = os.environ.get("DLLM_TEST_XLA_FLAGS",
                                "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true "
                                "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}".strip())
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # also in the subprocesses: same programs, cache hits
# torch (the transformers references) on one thread: its tiny float64 forwards are call-bound, and two intra-op
# threads on a 2-core machine that another test worker keeps busy made each 25x slower (measured 28 ms vs 1.1 ms)
os.environ.setdefault("OMP_NUM_THREADS", "1")

if "DLLM_JAX_COMPILATION_CACHE" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="dllm-test-xla-")
    os.environ["DLLM_JAX_COMPILATION_CACHE"] = _cache_dir  # inherited by the subprocesses tests start
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from dllm_jax import compile_cache  # noqa: E402

compile_cache.enable()  # every jit of the run, not only the engines'


# ----------------------------------------------------------------------------------------------
# Shared fixtures: a tiny random model, engines whose pages are checked after every test
# ----------------------------------------------------------------------------------------------
import pytest  # noqa: E402

TINY_MASK_ID = 63
TINY_EOS_ID = 1


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches(request):
    """Drop every compiled executable after each test module. The suite compiles thousands of XLA programs in
    one process and each keeps a few memory mappings of its JIT code alive (about 5 measured); with all of
    them kept, XLA's CPU compiler segfaulted late in the run (in tests/test_tp.py), near the kernel's default
    limit of 65,530 mappings. ``DLLM_TEST_LOG_MAPS=FILE`` logs the mapping count per module."""
    yield
    import gc

    log_path = os.environ.get("DLLM_TEST_LOG_MAPS")
    before = _count_maps() if log_path else 0
    jax.clear_caches()
    gc.collect()
    if log_path:
        with open(log_path, "a") as log:
            log.write(f"{request.module.__name__} {before} {_count_maps()}\n")


def _count_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def build_tiny_model(path, *, block_size=4, seed=0, std=0.5, vocab=64, layers=2, max_pos=256, tie=False,
                     kv_heads=2, eos=TINY_EOS_ID):
    """A random Qwen3 small enough to compile in about a second; ``std`` 0.5 gives peaky distributions, so
    LowConfidence commits several tokens per step and ties are rare."""
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params

    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=max_pos,
                      mask_token_id=TINY_MASK_ID, block_size=block_size, eos_token_ids=(eos,),
                      tie_word_embeddings=tie)
    params = init_params(cfg, jax.random.PRNGKey(seed), std=std)
    save_hf(params, cfg, str(path))
    return str(path)


# Engine tests that are not about bucketing share one small, fixed set of shapes (and pool size): each spec
# (algorithm, schedule, backend) then compiles one denoise and one prefill executable for the whole run, which
# every test using it reuses. Tests about buckets, batch shapes or memory set their own.
ENGINE_KW = dict(max_running_requests=8, context_length=64, num_kv_pages=96,
                 shape_buckets=dict(rows=(16,), pages=(16,), prefill_rows=(1,), prefill_blocks=(4,)))


# The shipped model (B = 32) in tests that are not about buckets: answers of up to 160 tokens fit 8 pages.
SHIPPED_KW = dict(max_running_requests=8, context_length=256, num_kv_pages=72,
                  shape_buckets=dict(rows=(16,), pages=(8,), prefill_rows=(1,), prefill_blocks=(2,)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_oracle(tiny_model):
    """The float64 reference decoder of ``tiny_model`` (tests/oracle.py)."""
    from oracle import Oracle

    return Oracle(tiny_model)


@pytest.fixture(scope="session")
def tiny_model_b32(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny32") / "model", block_size=32)


def assert_pages_back(engine):
    """Every page is free or held by the radix index; nothing running, queued or locked."""
    s = engine.scheduler
    assert not s.running and not s.waiting, "requests left in the engine"
    s.check_pages()
    assert engine.radix.protected == 0, "radix locks left"
    assert engine.allocator.num_free + engine.radix.total == engine.allocator.capacity


@pytest.fixture
def make_engine():
    """Build engines for a test; after it, check that all of their KV pages came back."""
    from dllm_jax import Engine

    engines = []

    def make(model_path, **kwargs):
        engine = Engine(model_path, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        assert_pages_back(engine)
