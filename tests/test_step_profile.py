"""bench/step_profile.py: the compiled step's HLO read back (scopes, emitting functions, op classes), the trace's
device op events on CPU (a real trace) and in a GPU-shaped trace (device plane, stream lines), the summary."""

import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import step_profile as sp  # noqa: E402


def rms_norm(x):  # the classifier knows the model's function names
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def linear(x, w):
    return x @ w


def _toy(x, w1, w2, pool, idx):
    h = rms_norm(x)
    h = linear(h, w1)
    with jax.named_scope("kv_write"):
        pool = pool.at[idx].set(h[:, :4])
    with jax.named_scope("mlp"):
        h = jax.nn.silu(h @ w2)
    with jax.named_scope("confidence"):
        logits = h @ w2.T
        top = jnp.max(logits, axis=-1)
    with jax.named_scope("algorithm"):
        pick = jnp.argmax(top)
    return pool, pick, top


def _args():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return f(8, 16), f(16, 32), f(32, 48), f(20, 4), jnp.arange(8, dtype=jnp.int32)


def test_parse_and_classify_compiled_hlo():
    compiled = jax.jit(_toy).lower(*_args()).compile()
    instrs, comps, module = sp.parse_hlo(compiled.as_text())
    assert module.startswith("jit__toy") and instrs and comps
    funcs = {i.func for i in instrs.values()}
    assert {"rms_norm", "linear"} <= funcs  # resolved through the StackFrames tables
    classes = {n: sp.classify(n, instrs, comps) for n in instrs}
    dots = {n: c for n, c in classes.items() if instrs[n].opcode in ("dot", "fusion") and
            any(instrs[m].opcode == "dot" for comp in instrs[n].calls for m in comps.get(comp, ()))
            or instrs[n].opcode == "dot"}
    assert {"projections", "mlp", "lm_head_confidence"} <= set(dots.values()), dots
    assert "kv_write" in classes.values() and "norms_rope" in classes.values()
    for cls in classes.values():
        assert cls in sp.CLASSES


def _inner(x):
    return jnp.sin(x)


def _middle(x):
    return _inner(x) * 2


def _outer(x):
    return _middle(x) + 1


def test_stack_frames_resolve_to_the_call_chain():
    """Each instruction's Python call chain, innermost first, from the text's stack-frame tables: the classifier
    sees a matmul's callers (``linear`` inside ``swiglu``) when the innermost function is a helper."""
    instrs, _, _ = sp.parse_hlo(jax.jit(_outer).lower(jnp.ones(3)).compile().as_text())
    sin = [i for i in instrs.values() if i.op_name.endswith("/sin")]
    assert sin and [f for f, _ in sin[0].stack][:3] == ["_inner", "_middle", "_outer"]
    assert sin[0].func == "_inner" and sin[0].file.endswith("test_step_profile.py")


def test_cpu_trace_events_and_summary(tmp_path):
    """A real profiler trace on CPU: the XLA:CPU thunks of the module, by HLO instruction, attributed to classes."""
    fn = jax.jit(_toy)
    args = _args()
    compiled = fn.lower(*args).compile()
    instrs, comps, module = sp.parse_hlo(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for _ in range(3):
        out = compiled(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    got = sp.device_op_events(str(tmp_path), module)
    assert got["events"] and not got["on_device"] and got["source"].endswith(".xplane.pb"), got["errors"]
    assert {e.module for e in got["events"]} == {module}
    names = {e.hlo_op for e in got["events"]}
    assert names <= set(instrs), names - set(instrs)
    floors = {c: dict(bytes=1000.0, flops=0.0) for c in sp.CLASSES}
    s = sp.summarize(got["events"], 3, instrs, comps, step_ms=None, floors=floors, ceilings={})
    assert s["busy_us_per_step"] > 0 and s["unattributed_us"] == 0
    assert abs(sum(c["us_per_step"] for c in s["classes"]) - s["busy_us_per_step"]) < 1e-6
    assert abs(sum(c["share"] for c in s["classes"]) - 1.0) < 1e-6  # no step time given: shares of the busy time
    assert all(c["x_floor"] > 0 for c in s["classes"] if c["us_per_step"])
    # the JSON trace gives the same events
    files = sp.find_profile_files(str(tmp_path))
    events, on_device = sp._events_from_json(files["json"])
    assert not on_device and {e.hlo_op for e in events if e.module == module} == names


def test_gpu_shaped_trace_reads_stream_lines(tmp_path):
    """A device plane as the GPU profiler writes it: kernels on stream lines carry hlo_op / hlo_module; the derived
    'XLA Ops' / 'XLA Modules' lines and host events are not counted again."""
    d = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    d.mkdir(parents=True)
    M = lambda pid, name, tid=None, kind="process_name": dict(ph="M", pid=pid, tid=tid, name=kind,  # noqa: E731
                                                              args=dict(name=name))
    X = lambda pid, tid, name, ts, dur, **args: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur,  # noqa: E731
                                                     args=args)
    events = [M(1, "/device:GPU:0"), M(1, "Stream #13(Compute)", 13, "thread_name"),
              M(1, "XLA Ops", 2, "thread_name"), M(1, "XLA Modules", 1, "thread_name"), M(7, "/host:CPU"),
              X(1, 13, "gemm_kernel_a", 0, 10, hlo_op="custom-call.1", hlo_module="jit_denoise"),
              X(1, 13, "loop_add_fusion_2", 12, 3, hlo_op="loop_add_fusion.2", hlo_module="jit_denoise"),
              X(1, 13, "other_module_kernel", 20, 50, hlo_op="fusion", hlo_module="jit_other"),
              X(1, 2, "custom-call.1", 0, 10, hlo_op="custom-call.1", hlo_module="jit_denoise"),
              X(1, 1, "jit_denoise", 0, 15), X(7, 3, "PjitFunction(denoise)", 0, 30)]
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = sp.device_op_events(str(tmp_path), "jit_denoise")
    assert got["on_device"]
    assert sorted((e.hlo_op, e.dur_us) for e in got["events"]) == [("custom-call.1", 10), ("loop_add_fusion.2", 3)]
    # kernels without an hlo_op (launched inside a CUDA graph) map back by XLA's kernel naming
    instrs = {"loop_add_fusion.2": sp.Instr("loop_add_fusion.2", "fusion", op_name="jit(denoise)/mlp/add")}
    ev = [sp.OpEvent("loop_add_fusion_2", "loop_add_fusion_2", "", 0.0, 4.0, "s")]
    s = sp.summarize(ev, 1, instrs, {}, step_ms=0.008, floors=None, ceilings={})
    assert s["ops"][0]["hlo_op"] == "loop_add_fusion.2" and s["ops"][0]["cls"] == "mlp"
    assert s["ops"][0]["share"] == pytest.approx(0.5)


def test_class_floors_add_up_to_the_step_floor():
    """The classes' FLOPs sum to the step's (bench.roofline.floors; elementwise work aside) and their bytes cover the
    step's (weights and prefix K/V once; the classes add the activations)."""
    from bench.roofline import SDAR_1_7B, floors, model_config

    cfg = model_config(SDAR_1_7B)
    for rows, prefix in ((1, 1024), (64, 1024), (8, 4096)):
        cls = sp.class_floors(cfg, rows, prefix, 32, 2)
        step = floors(cfg, rows, prefix)
        assert sum(c["flops"] for c in cls.values()) == pytest.approx(step["flops"], rel=0.02)
        # (at batch 64 the activations between the classes, which the step floor leaves out, add a third)
        assert step["bytes"] <= sum(c["bytes"] for c in cls.values()) <= 1.4 * step["bytes"]


@pytest.mark.slow
def test_step_profile_smoke(tmp_path):
    """``python -m bench.step_profile --smoke``: a tiny model's denoise step traced at batch 1 and 2 on CPU."""
    out = tmp_path / "sp.json"
    assert sp.main(["--smoke", "--out", str(out), "--trace-dir", str(tmp_path / "traces")]) == 0
    data = json.loads(out.read_text())
    assert [p["batch"] for p in data["profiles"]] == [1, 2]
    for p in data["profiles"]:
        assert p["events"] and p["busy_us_per_step"] > 0 and p["unattributed_us"] == 0
        got = {c["cls"] for c in p["classes"] if c["us_per_step"] > 0}
        assert {"projections", "attention", "mlp", "norms_rope", "lm_head_confidence", "kv_write"} <= got
