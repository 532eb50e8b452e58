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
