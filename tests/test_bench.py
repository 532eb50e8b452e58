"""The benchmark suite's plumbing: the transformers block-diffusion loop equals the engine token for token, the
CLI writes its tables / JSON / plots / summary, the roofline arithmetic matches reference/anchors.md."""

import gzip
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `bench` is a top-level folder of the repository, not always on the path
    sys.path.insert(0, REPO)

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import TINY_MASK_ID  # noqa: E402

M = TINY_MASK_ID
PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4], [], [M, 2, M, 3], list(range(2, 30)), [7] * 9]


@pytest.mark.parametrize("ignore_eos,fold", [(True, False), (False, True)])
def test_transformers_loop_and_engine_decide_alike(tiny_model, make_engine, tiny_oracle, ignore_eos, fold):
    """Both stacks decide as the float64 reference (so they differ only after a near-tie, e.g. the exactly tied
    positions of an all-mask first block); where their tokens agree, without the engine's folded commit forward
    the forward count agrees too (prefill + one per denoise step, the storing forward included)."""
    from bench.hf_baseline import HFBlockDiffusion
    from conftest import ENGINE_KW

    hf = HFBlockDiffusion(tiny_model, threshold=0.9, num_threads=1)
    engine = make_engine(tiny_model, algorithm_config={"threshold": 0.9}, enable_prefix_cache=False,
                         fold_commit_forward=fold, **dict(ENGINE_KW, max_running_requests=1, shape_buckets=dict(
                             ENGINE_KW["shape_buckets"], prefill_blocks=(16,))))  # a prompt in one forward, as HF
    params = {"max_new_tokens": 13, "ignore_eos": ignore_eos}
    stop = () if ignore_eos else (1,)  # the tiny model's EOS id
    outs = engine.generate(input_ids=[list(p) for p in PROMPTS], sampling_params=params)
    agree = 0
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(prompt, 13, ignore_eos=ignore_eos)
        for ids in (ref["output_ids"], out["output_ids"]):
            tiny_oracle.verify(prompt, ids, 13, config={"threshold": 0.9}, stop_ids=stop)
        if ref["output_ids"] == out["output_ids"]:
            agree += 1
            if not fold:
                assert ref["forward_passes"] == out["meta_info"]["forward_passes"], prompt
        assert M not in ref["output_ids"]
    assert agree >= len(PROMPTS) - 1  # at most the all-mask prompt, whose first pick is an exact tie


def test_cli_writes_tables_json_plots_and_summary(tmp_path, capsys):
    """`python -m bench baseline` on a tiny random model: every output file, identical tokens."""
    from bench.cli import run

    rc = run(["baseline", "--out", str(tmp_path), "--models", "tiny", "--baseline-prompts", "1",
              "--max-new-tokens", "8", "--hf-threads", "1", "--quick"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "baseline: one request at a time" in printed and "targets (every figure, met or not)" in printed
    for name in ("baseline.json", "baseline.png", "summary.json", "summary.txt"):
        assert (tmp_path / name).is_file(), name
    baseline = json.loads((tmp_path / "baseline.json").read_text())["models"]["tiny"]
    for schedule in ("fdfo", "sync"):
        assert baseline[schedule]["identical_fraction"] == 1.0
        assert baseline[schedule]["tpf"] <= baseline["hf"]["tpf"]  # equal, or one fewer per block (folded commit)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["failures"]
    names = [t["name"] for t in summary["targets"]]
    assert any(n.startswith("baseline [tiny, 1 request, fdfo]") for n in names)


def test_dllm_jax_cli_registers_bench(capsys):
    from dllm_jax.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--profile-dir" in capsys.readouterr().out


def test_roofline_floors_match_the_anchors():
    """reference/anchors.md section 4.2: 0.74 / 0.82 ms memory floors at batch 1, 7.6 / 9.1 ms compute at 64."""
    from bench.roofline import SDAR_1_7B, count_params, floors, model_config

    cfg = model_config(SDAR_1_7B)
    assert count_params(cfg) == pytest.approx(1.720e9, rel=1e-3)
    b1 = floors(cfg, 1, 1024)
    assert b1["bound"] == "memory" and b1["memory_floor_ms"] == pytest.approx(0.742, abs=0.005)
    assert floors(cfg, 1, 4096)["memory_floor_ms"] == pytest.approx(0.815, abs=0.005)
    b64 = floors(cfg, 64, 1024)
    assert b64["bound"] == "compute" and b64["compute_floor_ms"] == pytest.approx(7.62, abs=0.02)
    assert floors(cfg, 64, 4096)["compute_floor_ms"] == pytest.approx(9.08, abs=0.02)


def test_trace_summary(tmp_path):
    from bench.common import find_trace, summarize_trace

    d = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    d.mkdir(parents=True)
    events = [{"ph": "X", "name": "denoise_step", "dur": 1500.0}, {"ph": "X", "name": "denoise_step", "dur": 500.0},
              {"ph": "X", "name": "commit", "dur": 100.0}, {"ph": "M", "name": "process_name"}]
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = find_trace(str(tmp_path))
    assert trace is not None
    assert summarize_trace(trace) == [("denoise_step", 2, 2.0), ("commit", 1, 0.1)]
    assert summarize_trace(trace, ("commit",)) == [("commit", 1, 0.1)]


@pytest.mark.slow
def test_roofline_smoke(tmp_path):
    """``python -m bench.roofline --smoke`` (tiny shapes, XLA) runs anywhere and writes its JSON."""
    from bench.roofline import main

    out = tmp_path / "roofline.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("step_ms" in r for r in rows)


@pytest.mark.slow
def test_quick_suite_on_tiny_model(tmp_path):
    """Every CPU scenario end to end on the tiny model, with a profiled window (about two minutes)."""
    from bench.cli import run

    rc = run(["--quick", "--out", str(tmp_path), "--models", "tiny", "--prefix-models", "tiny", "--long-models",
              "tiny", "--schedule-models", "tiny", "--long-tokens", "128,256", "--prefix-tokens", "128",
              "--hf-threads", "1", "--profile-dir", str(tmp_path / "prof"), "--profile-steps", "8"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["failures"]
    assert summary["profile"]["trace"] and summary["profile"]["annotations"]
    for name in ("baseline", "concurrency", "prefix", "long", "schedules", "engine"):
        assert (tmp_path / f"{name}.json").is_file() and (tmp_path / f"{name}.png").is_file()


@pytest.mark.slow
def test_chain_scenario_identical_tokens(tmp_path):
    """`python -m bench chain --quick`: chaining off / on / forced, the same tokens at every level."""
    from bench.cli import run

    assert run(["chain", "--quick", "--out", str(tmp_path)]) == 0
    levels = json.loads((tmp_path / "chain.json").read_text())["levels"]
    assert set(levels) == {"1", "2", "4", "16"}
    for level in levels.values():
        assert all(r["identical"] for r in level.values())
        assert level["on"]["device_calls"] <= level["off"]["device_calls"]


def test_host_replay_plays_the_recorded_run_back(tiny_model, make_engine):
    """The efficiency bench's host-alone and device-alone figures: a recorded run played back without the device
    schedules the same calls and gives the same answers; its device calls replayed alone compute the recorded
    results; a run that differs from the recording is refused, not timed."""
    from bench.common import run_requests
    from bench.efficiency import _DevicePlayback
    from conftest import ENGINE_KW

    engine = make_engine(tiny_model, **dict(ENGINE_KW, max_running_requests=2))
    prompts, params = [list(p) for p in PROMPTS[:4]], {"max_new_tokens": 9, "ignore_eos": True}
    playback = _DevicePlayback()
    engine.flush_cache()
    with playback.recording():
        recorded = run_requests(engine, prompts, params, 2)
    assert playback.calls and engine.scheduler.stats["prefill_forwards"]
    for verify in (True, False):
        engine.flush_cache()
        with playback.playing(verify=verify):
            played = run_requests(engine, prompts, params, 2)
        assert played["outputs"] == recorded["outputs"] and played["device_calls"] == recorded["device_calls"]
        engine.scheduler.check_pages()
    # The device half: the recorded calls again, back to back, computing what they computed in the run.
    assert playback.device_seconds(engine.runner, verify=True) > 0
    engine.flush_cache()
    assert run_requests(engine, prompts, params, 2)["outputs"] == recorded["outputs"]
    engine.flush_cache()
    with pytest.raises(RuntimeError, match="host replay") as failed:
        with playback.playing(verify=True):
            run_requests(engine, [[11, 12, 13]] + prompts[1:], params, 2)
    engine._fail_all(failed.value)  # what the engine's loop does with a failed round: no page may be left held
    engine.scheduler.check_pages()


def test_transformers_batch_loop_equals_one_at_a_time(tiny_model):
    """``HFBlockDiffusion.generate_batch`` (the torch side of bench/side_by_side.py at batch 16) decides as the
    one-prompt loop: same tokens per prompt; one forward per step for the batch (the slowest row's steps)."""
    from bench.hf_baseline import HFBlockDiffusion

    hf = HFBlockDiffusion(tiny_model, threshold=0.9, num_threads=1)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4, 11, 12, 2, 2], [7] * 6]  # 6 tokens: the first block holds 2 of them
    single = []
    forwards = []
    for p in prompts:
        r = hf.generate(p, 9, ignore_eos=True)
        single.append(r["output_ids"])
        forwards.append(r["forward_passes"])
    batch = hf.generate_batch(prompts, 9, ignore_eos=True)
    assert batch["outputs"] == single
    assert max(forwards) <= batch["forward_passes"] <= sum(forwards)
    with pytest.raises(ValueError):
        hf.generate_batch([[1, 2], [3]], 4)


def test_overlap_probe_splits_host_time():
    """bench.roofline.OverlapProbe's accounting on a made-up timeline (in ms; the probe's clock is in seconds): a
    round with a prefill then a denoise call, then a denoise call alone."""
    from bench.roofline import OverlapProbe

    p = OverlapProbe(runner=None)
    p.t_start, p.t_end = 0.0, 40.0
    # [kind, dispatch start, dispatch end, ready]; denoise timeline: (entered, dispatched, sync, synced, returned)
    p.calls = [["prefill", 2.0, 3.0, None], ["denoise", 5.0, 6.0, 15.0], ["denoise", 20.0, 21.0, 30.0]]
    p.timeline = [(4.0, 6.0, 8.0, 15.0, 16.0), (19.0, 21.0, 32.0, 32.5, 33.0)]
    ms = lambda x: x / 1e3 if isinstance(x, float) else x  # noqa: E731
    p.t_start, p.t_end = ms(p.t_start), ms(p.t_end)
    p.calls = [[c[0], *map(ms, c[1:])] for c in p.calls]
    p.timeline = [tuple(map(ms, t)) for t in p.timeline]
    s = p.summary()
    assert s["calls"] == 2 and s["prefill_calls"] == 1
    # exposed: 0->2 (before the prefill) + 15->20 (between the results and the next dispatch) + 30->32 (late read)
    assert s["exposed_ms_per_call"] == pytest.approx((2 + 5 + 2) / 2)
    # hidden: 3->5 (planning while the prefill runs) + 6->8 + 21->30 (after each dispatch, device busy)
    assert s["hidden_ms_per_call"] == pytest.approx((2 + 2 + 9) / 2)
    assert s["dispatch_ms_per_call"] == pytest.approx(3 / 2)
    assert s["device_ms_per_call"] == pytest.approx((13 + 10) / 2)
    b = s["breakdown_ms_per_call"]
    assert b["prep"] == pytest.approx(1.0) and b["wait"] == pytest.approx(3.75)
    assert b["outside"] == pytest.approx((4 + 3 + 7) / 2)


def test_overlap_probe_on_a_runner():
    """The probe around a real ModelRunner (tiny model, XLA:CPU): every denoise call timed, the runner's timeline
    filled then cleared, the jitted functions restored."""
    import jax.numpy as jnp

    from bench.roofline import SMOKE, OverlapProbe, model_config, runner_overhead
    from dllm_jax.engine import runner as runner_mod
    from dllm_jax.model.params import init_params

    cfg = model_config(SMOKE)
    import jax

    params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.float32, std=0.02)
    saved = runner_mod.denoise_packed
    o = runner_overhead(cfg, params, 2, 32, "xla", iters=3, dtype=jnp.float32)
    assert runner_mod.denoise_packed is saved
    assert set(o["overlap_modes"]) == {"read_sync"}  # CPU: the results are read in place, no early copy
    ov = o["overlap"]
    assert ov["calls"] == 3 and ov["device_ms_per_call"] > 0 and 0 <= ov["hidden_frac"] <= 1
    assert ov["host_ms_per_call"] == pytest.approx(ov["exposed_ms_per_call"] + ov["dispatch_ms_per_call"]
                                                   + ov["hidden_ms_per_call"])
    assert OverlapProbe.__doc__


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    """``bash bench/gpu_check.sh --smoke`` on CPU: every stage of the GPU script (roofline now and at the previous
    commit, step profile, kernels with the attention sweep and a crossover table, the side-by-side with
    transformers, the DiffusionGemma kernel check and step) runs and the summary prints (about 5 minutes on the 2-core
    CI machine)."""
    import subprocess

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_check.sh"), "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for stage in ("roofline (this tree) exit 0", "step profile exit 0", "kernels exit 0",
                  "side by side: engine vs transformers exit 0", "DiffusionGemma kernels vs references exit 0",
                  "DiffusionGemma renoise step exit 0", "== summary =="):
        assert stage in out, (stage, out[-3000:])
    assert "step profile batch 1:" in out and "side by side batch" in out
    assert "DiffusionGemma kernel top_k pallas_interpret:" in out and "-> FAIL" not in out
    dest = os.path.join(REPO, "bench_out", "gpu")
    for name in ("roofline.json", "step_profile.json", "kernels.json", "side_by_side.json",
                 "confidence_crossover.smoke.json", "renoise_kernels.json", "renoise_gpu.json"):
        assert os.path.isfile(os.path.join(dest, name)), name


def test_gpu_check_parses_and_names_its_diffusion_gemma_stage():
    """``bash -n bench/gpu_check.sh`` and its DiffusionGemma stage (the kernel check, then the step bench)."""
    import subprocess

    script = os.path.join(REPO, "bench", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    text = open(script).read()
    assert "-m bench.renoise_gpu --check" in text and "-m bench.renoise_gpu $SMOKE" in text


def test_renoise_bench_finds_canvas_by_vocab_arrays():
    """bench.renoise_side.vocab_arrays: an HLO array with a vocabulary dimension next to a multiple of the canvas
    is reported; the weights ([V, H]) and vocabulary tiles ([N, tile]) are not."""
    from bench.renoise_side import vocab_arrays

    hlo = ("%a = f32[262144,64]{1,0} parameter(0)\n%b = f32[512,2048]{1,0} dot(%x, %y)\n"
           "%c = f32[512,262144]{1,0} dot(%x, %a)\n%d = pred[256,262144]{1,0} compare(%c, %c)")
    assert vocab_arrays(hlo, 262144, 256) == ["f32[512,262144]", "pred[256,262144]"]
    assert vocab_arrays(hlo.split("\n")[1], 262144, 256) == []


@pytest.mark.slow
def test_renoise_bench_smoke(tmp_path, capsys):
    """``python -m bench.renoise --smoke``: both sides in their own processes at 1 and 2 requests, the same steps
    per canvas on both, the growth table with its model, the JSON (four processes: 3-6 minutes on 2 busy cores)."""
    from bench.renoise import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "engine vs transformers generate" in printed and "engine peak RSS as requests grow" in printed
    result = json.loads((tmp_path / "renoise.json").read_text())
    rows = {(r["side"], r["requests"], r["slots"]): r for r in result["speed"]["rows"]}
    for n in (1, 2):
        engine, hf = rows[("engine", n, None)], rows[("hf", n, None)]
        assert engine["tokens"] == hf["tokens"] == 16 * n
        assert engine["steps_per_canvas"] == hf["steps_per_canvas"] == 2  # the same regime: every step run
        assert engine["speedup"] > 0 and engine["peak_rss"] > engine["imports_rss"] > 0
    growth = result["growth"]["rows"]
    assert [g["requests"] for g in growth] == [1, 2] and growth[0]["excess"] == 0
    assert growth[1]["kv_pools"] > growth[0]["kv_pools"] and growth[1]["state"] == 2 * growth[0]["state"]


def test_weight_update_bench_on_the_shipped_model(tmp_path, capsys):
    """``python -m bench weight_update`` (shipped model only): every update compiles nothing, and the release /
    resume table shows the device's bytes falling and coming back."""
    from bench.cli import run

    rc = run(["weight_update", "--out", str(tmp_path), "--quick", "--weight-update-layers", "0",
              "--weight-update-repeats", "1"])
    assert rc == 0
    assert "release / resume memory occupation" in capsys.readouterr().out
    shipped = json.loads((tmp_path / "weight_update.json").read_text())["models"]["shipped"]
    assert all(u["compiles"] == 0 for u in shipped["updates"].values())
    occ = shipped["occupation"]
    assert occ["compiles"] == 0
    before, released, resumed = (occ[s]["device_bytes_in_use"] for s in ("before", "after release", "after resume"))
    assert released < before and resumed == before


def test_score_check_smoke(tmp_path, capsys):
    """``python -m bench.score_check`` at a few prompts: both estimators, a JSON with the wins per task."""
    from bench.score_check import main

    out = tmp_path / "score_check.json"
    assert main(["--prompts", "6", "--wrong", "2", "--samples", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for estimator in ("chain", "elbo"):
        wins = result["estimators"][estimator]
        assert sum(n for _, n in wins["per_task"].values()) == 6 and 0 <= wins["wins"] <= 6
    assert "score_check: the correct answer ranked first" in capsys.readouterr().out


_IMPOSTOR = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # answers everything: /health, /v1/models, ...
        body = json.dumps({"status": "ok", "object": "list", "data": [{"id": "impostor"}]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("listening", flush=True)
srv.serve_forever()
"""

_FAKE_LM_EVAL = """
import json, sys, urllib.request
args = sys.argv[1:]
model_args = dict(kv.split("=", 1) for kv in args[args.index("--model_args") + 1].split(","))
base = model_args["base_url"].rsplit("/v1/", 1)[0]
names = [m["id"] for m in json.load(urllib.request.urlopen(base + "/v1/models"))["data"]]
with open(sys.argv[0] + ".json", "w") as f:
    json.dump({"base": base, "names": names}, f)
"""


def test_lm_eval_run_script_evaluates_its_own_server(tmp_path):
    """bench/lm_eval_task/run.sh (issue 49: it evaluated whatever already listened on its port and exited 1 without
    a word). With a port taken by another server it says that its own server could not start and never runs
    lm-eval; by default it picks a free port and lm-eval talks to the server it started, which is gone after."""
    import shutil
    import socket
    import subprocess

    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("run.sh needs bash and curl")
    fake = tmp_path / "lm_eval"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_LM_EVAL}")
    fake.chmod(0o755)
    impostor_py = tmp_path / "impostor.py"
    impostor_py.write_text(_IMPOSTOR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
    impostor = subprocess.Popen([sys.executable, str(impostor_py), str(busy)], stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, LM_EVAL=str(fake), PYTHON=sys.executable, JAX_PLATFORMS="cpu",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(REPO, "bench", "lm_eval_task", "run.sh")
    try:
        assert impostor.stdout.readline().strip() == "listening"
        taken = subprocess.run(["bash", script], env=dict(env, PORT=str(busy)), capture_output=True, text=True,
                               timeout=300)
        assert taken.returncode == 1, taken
        assert f"the server exited before it was ready (port {busy} taken?" in taken.stderr, taken.stderr
        assert "the server's log" in taken.stderr  # (uvicorn's bind error follows)
        assert not (tmp_path / "lm_eval.json").exists(), "lm-eval ran against the server already on the port"
        ok = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    finally:
        impostor.kill()
        impostor.wait()
    seen = json.loads((tmp_path / "lm_eval.json").read_text())
    assert seen["names"][0] == "sdar-tiny" and seen["names"][1].startswith("run-"), seen
    assert "ready on " + seen["base"] in ok.stdout
    port = int(seen["base"].rsplit(":", 1)[1])
    with socket.socket() as s:  # the script's server is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
