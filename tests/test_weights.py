"""RL rollouts, issue 38 items 1-2: in-place weight updates (from disk, from tensors; no compile, atomic, the cache
flushed, the version in ``meta_info``) and pause / continue (abort, retract, in place), in Python and over HTTP.

One engine on the shipped model for the module (``max_steps_per_call=1``: one denoise step per round, so a test can
stop a request between two of its blocks), and one fresh engine on a perturbed copy as the reference.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

import dllm_jax
from dllm_jax.assets import DEFAULT_MODEL_PATH
from dllm_jax.engine.compilation import compiled_executables
from dllm_jax.engine.output import FinishWatcher
from dllm_jax.engine.pause import PAUSE_ABORT_MESSAGE
from dllm_jax.model.checkpoint_names import params_to_hf
from dllm_jax.model.params import key_path, path_name
from dllm_jax.train import tasks

from conftest import SHIPPED_KW, assert_pages_back

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL_PATH, "model.safetensors")),
                                reason="shipped model not exported yet")

KW = dict(SHIPPED_KW, max_steps_per_call=1)
GREEDY = {"max_new_tokens": 48, "temperature": 0}
# seven blocks (prompts are 15-16 tokens, the context 256): room for an HTTP pause to land while it runs
LONG = {"max_new_tokens": 220, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    e = dllm_jax.Engine(None, **KW)
    yield e
    e.shutdown()
    assert_pages_back(e)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.apply_chat_template(ex.prompt) for ex in tasks.heldout_set(4)[:3]]


@pytest.fixture(scope="module")
def originals(engine):
    """The shipped weights by parameter path (host copies)."""
    return {path_name(key_path(p)): np.array(v) for p, v in jax.tree_util.tree_flatten_with_path(
        engine.runner.params)[0]}


def _tree(engine, flat: dict):
    leaves = jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]
    treedef = jax.tree_util.tree_structure(engine.runner.params)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_name(key_path(p))] for p, _ in leaves])


@pytest.fixture(scope="module")
def perturbed(engine, originals, tmp_path_factory):
    """The shipped model with every weight scaled by 1 + N(0, 0.2): an HF directory and a converted one."""
    from dllm_jax.model.converted import save_converted, save_hf

    rng = np.random.default_rng(0)
    flat = {k: (v * (1 + 0.2 * rng.standard_normal(v.shape))).astype(v.dtype) for k, v in originals.items()}
    root = tmp_path_factory.mktemp("perturbed")
    hf_dir, converted_dir = str(root / "hf"), str(root / "converted")
    save_hf(_tree(engine, flat), engine.config, hf_dir)
    for name in os.listdir(DEFAULT_MODEL_PATH):  # tokenizer, template, generation config
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(DEFAULT_MODEL_PATH, name), hf_dir)
    save_converted(hf_dir, _tree(engine, flat), converted_dir)
    return {"hf": hf_dir, "converted": converted_dir, "flat": flat}


@pytest.fixture(scope="module")
def expected(engine, prompts, perturbed):
    """Greedy answers of the shipped weights (this engine, before any update) and of a fresh engine on the copy."""
    base = [o["output_ids"] for o in engine.generate(prompts, GREEDY)]
    long = engine.generate(prompts[0], LONG)["output_ids"]
    fresh = dllm_jax.Engine(perturbed["hf"], **KW)
    try:
        copy = [o["output_ids"] for o in fresh.generate(prompts, GREEDY)]
    finally:
        fresh.shutdown()
    assert copy != base  # the perturbation changes the answers
    return {"base": base, "perturbed": copy, "long": long}


def _rewrite_json(path, **changes):
    import json

    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump({**data, **changes}, f)


def _restore(engine, originals, version="v0"):
    engine.update_weights_from_tensor(originals, weight_version=version)


def _ids(outs):
    return [o["output_ids"] for o in outs]


# ----------------------------------------------------------------------------------------------
# Weight updates
# ----------------------------------------------------------------------------------------------
def test_update_from_disk_decodes_like_a_fresh_engine(engine, prompts, perturbed, expected):
    assert engine.generate(prompts[0], GREEDY)["meta_info"]["weight_version"] == "default"
    assert engine.radix.total > 0  # cached prompt blocks, computed by the old weights
    before = compiled_executables()
    result = engine.update_weights_from_disk(perturbed["hf"], weight_version="v1")
    assert result["success"] and result["weight_version"] == "v1" and result["num_parameters"] == len(perturbed["flat"])
    assert engine.radix.total == 0  # flushed
    outs = engine.generate(prompts, GREEDY)
    assert _ids(outs) == expected["perturbed"]
    assert all(o["meta_info"]["weight_version"] == "v1" and o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert compiled_executables() == before
    assert engine.get_weight_version() == "v1"
    qkv = perturbed["flat"]["layers.1.qkv"]  # q|k|v fused, [q; k; v] on one shard
    q = qkv[:engine.config.q_size]
    # matrices are stored [out, in] as the checkpoint stores them: the checkpoint name reads its rows of the fused
    # leaf, as does the unfused path; the fused path reads the leaf
    np.testing.assert_array_equal(engine.get_weights_by_name("model.layers.1.self_attn.q_proj.weight", 5), q[:5])
    np.testing.assert_array_equal(engine.get_weights_by_name("layers.1.q", None), q)
    np.testing.assert_array_equal(engine.get_weights_by_name("layers.1.qkv", None), qkv)
    engine.scheduler.check_pages()


def test_update_from_tensors_restores_the_original_answers(engine, prompts, originals, expected):
    """Checkpoint names (numpy arrays); a directory of the same weights keeps the version."""
    before = compiled_executables()
    hf_named = params_to_hf(_tree(engine, originals), engine.config)
    result = engine.update_weights_from_tensor(list(hf_named.items()), weight_version="v0")
    assert result["success"] and result["num_parameters"] == len(originals)
    outs = engine.generate(prompts, GREEDY)
    assert _ids(outs) == expected["base"] and outs[0]["meta_info"]["weight_version"] == "v0"
    engine.update_weights_from_disk(DEFAULT_MODEL_PATH)  # the same weights
    assert engine.get_weight_version() == "v0"  # no version given: unchanged, as SGLang
    assert compiled_executables() == before


@pytest.mark.parametrize("order", ["by layer", "q of every layer first", "one segment"])
def test_fused_leaves_from_their_segments(engine, originals, perturbed, order, monkeypatch):
    """Checkpoint-named q / k / v and gate / up tensors fill their fused leaves whatever the order: a leaf whose
    segments come together is built on the host (CPU), one whose segments come far apart (more than
    MAX_OPEN_BUFFERS leaves open) or only in part by donated writes; every leaf ends equal to the source rows and
    the leaves not named keep their values."""
    from dllm_jax.model import weight_update as wu
    from dllm_jax.model.placement import _Placer

    hf = params_to_hf(_tree(engine, perturbed["flat"]), engine.config)
    segments = [n for n in hf if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                              "gate_proj.weight", "up_proj.weight"))]
    if order == "q of every layer first":
        segments.sort(key=lambda n: (n.split(".")[-2], n))  # k, q, v, gate, up of all layers grouped
        assert 2 * engine.config.num_layers > wu.MAX_OPEN_BUFFERS  # fused leaves: qkv, gate_up
    elif order == "one segment":
        segments = [n for n in segments if n.endswith("layers.1.self_attn.k_proj.weight")]
    on_host = []
    write_host = _Placer.write_host
    monkeypatch.setattr(_Placer, "write_host", lambda self, part, shape, value: on_host.append(part) or
                        write_host(self, part, shape, value))
    try:
        engine.update_weights_from_tensor([(n, hf[n]) for n in segments], flush_cache=True)
        want = {"by layer": len(segments), "one segment": 0}.get(order)
        assert len(on_host) == want if want is not None else 0 < len(on_host) < len(segments), len(on_host)
        for name in segments:
            np.testing.assert_array_equal(engine.get_weights_by_name(name, None), hf[name], err_msg=name)
        if order == "one segment":  # q and v of that layer kept theirs
            q_name = "model.layers.1.self_attn.q_proj.weight"
            np.testing.assert_array_equal(engine.get_weights_by_name(q_name, None),
                                          params_to_hf(_tree(engine, originals), engine.config)[q_name])
        np.testing.assert_array_equal(engine.get_weights_by_name("layers.0.o", None), originals["layers.0.o"])
    finally:
        _restore(engine, originals)


def test_update_from_converted_dir_and_torch_tensors(engine, prompts, originals, perturbed, expected):
    import torch

    before = compiled_executables()
    engine.update_weights_from_disk(perturbed["converted"], weight_version="v1-converted")
    assert _ids(engine.generate(prompts, GREEDY)) == expected["perturbed"]
    engine.update_weights_from_tensor({k: torch.from_numpy(v) for k, v in originals.items()}, weight_version="v0")
    assert _ids(engine.generate(prompts, GREEDY)) == expected["base"]
    # bfloat16 tensors are cast to the leaf's float32 (the values change: only the cast is checked)
    bf16 = torch.from_numpy(originals["final_norm"]).to(torch.bfloat16)
    engine.update_weights_from_tensor([("final_norm", bf16)], flush_cache=False)
    np.testing.assert_array_equal(engine.get_weights_by_name("final_norm", None), bf16.float().numpy())
    _restore(engine, originals)
    assert compiled_executables() == before


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.0.self_attn.q_proj.weight": np.zeros((128, 64), np.float32)}, "q_proj.weight.*shape"),
    ({"layers.0.q": np.zeros((128, 128), np.float32), "model.layers.0.self_attn.nope.weight": np.zeros(3)},
     "nope.weight.*not a parameter"),
    ({"embed": np.zeros((768, 128), np.int32)}, "'embed'.*floating"),
    ({"model.layers.9.mlp.up_proj.weight": np.zeros((512, 128), np.float32)}, "layer 9"),
    ({"layers.0.k": np.zeros((64, 128), np.float32), "model.layers.0.self_attn.k_proj.weight":
        np.zeros((64, 128), np.float32)}, "k_proj.*as tensor 'layers.0.k'"),
], ids=["shape", "unknown-name", "dtype", "layer", "twice"])
def test_refused_update_changes_nothing(engine, bad, match):
    leaves = jax.tree.leaves(engine.runner.params)
    version = engine.get_weight_version()
    with pytest.raises(ValueError, match=match):
        engine.update_weights_from_tensor(bad, weight_version="never")
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.runner.params), leaves))
    assert engine.get_weight_version() == version


def test_refused_directories(engine, perturbed, tiny_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    leaves = jax.tree.leaves(engine.runner.params)
    with pytest.raises(ValueError, match="config.json describes another model"):
        engine.update_weights_from_disk(tiny_model)
    partial = tmp_path / "partial"
    shutil.copytree(perturbed["hf"], partial)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.down_proj.weight"):
        engine.update_weights_from_disk(partial)
    with pytest.raises(ValueError, match="model_path: .* not a directory"):
        engine.update_weights_from_disk(tmp_path / "absent")
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.runner.params), leaves))


def test_tensor_parallel_update_keeps_every_shard_in_place(prompts, originals, perturbed, expected):
    """TP 2: each new leaf is placed with its old leaf's sharding, so the TP executables take it as well."""
    engine = dllm_jax.Engine(None, tensor_parallel_size=2, **KW)
    try:
        shardings = [x.sharding for x in jax.tree.leaves(engine.runner.params)]
        assert _ids(engine.generate(prompts, GREEDY)) == expected["base"]
        before = compiled_executables()
        engine.update_weights_from_disk(perturbed["hf"], weight_version="tp-1")
        assert [x.sharding for x in jax.tree.leaves(engine.runner.params)] == shardings
        assert _ids(engine.generate(prompts, GREEDY)) == expected["perturbed"]
        engine.update_weights_from_tensor({k: jax.numpy.asarray(v) for k, v in originals.items()})
        assert [x.sharding for x in jax.tree.leaves(engine.runner.params)] == shardings
        assert _ids(engine.generate(prompts, GREEDY)) == expected["base"]
        assert compiled_executables() == before
    finally:
        engine.shutdown()
    assert_pages_back(engine)


@pytest.mark.parametrize("layout, names", [
    ("sdar_moe", ["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.gate.weight"]),
    ("llada2", ["model.layers.0.attention.query_key_value.weight", "model.layers.1.mlp.experts.5.up_proj.weight"]),
], ids=["sdar-moe", "llada2"])
def test_published_layouts_update_in_place(tmp_path, layout, names):
    """Per-expert tensors written into their stacked leaf, LLaDA2's fused q/k/v split, its normalised head: an
    update from disk or from the checkpoint's tensors gives the loader's leaves exactly (model level, no engine)."""
    import jax.numpy as jnp

    from dllm_jax.config import ModelConfig
    from dllm_jax.model import weight_update as wu
    from dllm_jax.model.placement import load_safetensors_params
    from dllm_jax.testing import published

    pubs = [published.write_published(str(tmp_path / f"m{seed}"), layout, seed=seed, std=0.5, keep_tensors=True,
                                      remote_code_traps=False) for seed in (0, 1)]
    if layout == "llada2":  # a head normalised at load (Bailing's norm_head)
        for pub in pubs:
            _rewrite_json(os.path.join(pub.path, "config.json"), norm_head=True)
    cfg = ModelConfig.from_model_dir(pubs[0].path)
    assert bool(cfg.norm_head) == (layout == "llada2")
    load = lambda pub: load_safetensors_params(pub.path, cfg, jnp.float32)  # noqa: E731
    params, target = load(pubs[0]), load(pubs[1])
    plan = wu.plan_directory(cfg, params, pubs[1].path)
    try:
        wu.apply_directory(cfg, params, plan)
    finally:
        plan.close()
    jax.tree.map(np.testing.assert_array_equal, params, target)
    wu.apply_tensors(cfg, params, wu.plan_tensors(cfg, params, pubs[0].tensors))
    jax.tree.map(np.testing.assert_array_equal, params, load(pubs[0]))
    for name in names:
        want = pubs[0].tensors[name].astype(np.float32)
        np.testing.assert_array_equal(wu.read_weight(cfg, params, name, 3), want[:3])


def test_update_waits_for_running_requests(engine, prompts, originals, expected):
    """flush_cache=True: the running requests finish on the old weights first (the caller's thread runs the rounds
    when no loop thread does); they report the version they were decoded with."""
    engine.update_weight_version("v0")
    reqs = _submit(engine, prompts, GREEDY)
    engine.step()
    assert engine.scheduler.running
    _restore(engine, originals, "v-next")
    assert all(r.finished for r in reqs) and [r.weight_version for r in reqs] == ["v0"] * len(reqs)
    assert [r.output_ids for r in reqs] == expected["base"]
    assert engine.radix.total == 0


# ----------------------------------------------------------------------------------------------
# Pause and continue (the caller's thread drives the rounds: each pause lands between two blocks)
# ----------------------------------------------------------------------------------------------
def _submit(engine, prompts, params):
    reqs = [engine.make_request(engine.tokenize(p, "prompt"), params, rid=None, on_event=FinishWatcher())
            for p in prompts]
    for req in reqs:
        engine.submit(req)
    return reqs


def _run_until_output(engine, reqs):
    while not any(r.output_ids for r in reqs):
        engine.step()
    assert not any(r.finished for r in reqs), "a request finished before the pause"


def _finish(engine, reqs):
    while not all(r.finished for r in reqs):
        engine.step()
    engine.scheduler.check_pages()


def test_pause_retract_gives_the_uninterrupted_tokens(engine, prompts, expected):
    reqs = _submit(engine, prompts, GREEDY)
    _run_until_output(engine, reqs)
    kept = [list(r.output_ids) for r in reqs]
    state = engine.pause_generation("retract")
    assert state["parked"] == 0 and state["queued"] == len(reqs)
    assert not engine.scheduler.running and [r.output_ids for r in reqs] == kept  # committed tokens kept
    engine.scheduler.check_pages()
    late = _submit(engine, prompts[:1], GREEDY)  # queued while paused, not refused
    assert not engine.step() and not any(r.finished for r in reqs + late)
    engine.flush_cache()  # allowed: retracted requests hold no pages; they re-encode on resume
    engine.continue_generation()
    _finish(engine, reqs + late)
    assert [r.output_ids for r in reqs] == expected["base"] and late[0].output_ids == expected["base"][0]
    assert all(r.retractions == 1 for r in reqs)


def test_pause_in_place_keeps_kv_and_refuses_a_flush(engine, prompts, originals, expected):
    reqs = _submit(engine, prompts, GREEDY)
    _run_until_output(engine, reqs)
    pages = [list(r.pages) for r in reqs]
    assert engine.pause_generation("in_place")["parked"] == len(reqs)
    assert not engine.step() and [list(r.pages) for r in reqs] == pages
    with pytest.raises(RuntimeError, match="paused in place"):
        engine.flush_cache()
    with pytest.raises(ValueError, match="flush_cache: .* paused in place"):
        engine.update_weights_from_tensor(originals, weight_version="refused")
    # without a flush the update goes through; the parked requests continue on these (identical) weights
    engine.update_weights_from_tensor(originals, weight_version="v-mixed", flush_cache=False)
    engine.continue_generation()
    _finish(engine, reqs)
    assert [r.output_ids for r in reqs] == expected["base"] and all(r.retractions == 0 for r in reqs)
    assert {engine.meta_info(r)["weight_version"] for r in reqs} == {"v-mixed"}
    assert engine.flush_cache()


def test_pause_abort_ends_with_partial_output(engine, prompts, expected):
    reqs = _submit(engine, prompts, GREEDY)
    _run_until_output(engine, reqs)
    assert engine.pause_generation("abort")["aborted"] == len(reqs)
    for req, full in zip(reqs, expected["base"]):
        assert req.finished and req.finish_reason == {"type": "abort", "message": PAUSE_ABORT_MESSAGE}
        assert full[:len(req.output_ids)] == req.output_ids
    assert any(0 < len(r.output_ids) < len(full) for r, full in zip(reqs, expected["base"]))
    late = _submit(engine, prompts[:1], GREEDY)
    assert not engine.step() and not late[0].finished
    engine.continue_generation()
    _finish(engine, late)
    assert late[0].output_ids == expected["base"][0]
    with pytest.raises(ValueError, match="mode: must be one of abort, retract, in_place"):
        engine.pause_generation("stop")


# ----------------------------------------------------------------------------------------------
# HTTP (the app starts the engine's loop thread: these tests come last)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from serve import ServerSettings, create_app

    app = create_app(engine, ServerSettings(max_request_bytes=64 << 20), own_engine=False)
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def _generate(client, prompt, params):
    r = client.post("/generate", json={"text": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def test_http_weight_updates(client, engine, prompts, originals, perturbed, expected):
    from dllm_jax.model.weight_update import encode_tensors

    before = compiled_executables()
    r = client.post("/update_weights_from_disk", json={"model_path": perturbed["hf"], "weight_version": "h1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    out = _generate(client, prompts[1], GREEDY)
    assert out["output_ids"] == expected["perturbed"][1] and out["meta_info"]["weight_version"] == "h1"
    assert client.get("/get_weight_version").json() == {"weight_version": "h1"}
    bad = encode_tensors({"layers.0.qkv": originals["layers.0.qkv"], "layers.0.v": np.zeros((3, 3), np.float32)})
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": bad, "weight_version": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "serialized_named_tensors", r.text
    assert "'layers.0.v': shape (3, 3)" in r.json()["error"]["message"]
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": "not base64!"})
    assert r.status_code == 400 and "base64" in r.json()["error"]["message"]
    r = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    assert client.get("/get_weight_version").json() == {"weight_version": "h1"}
    halves = [dict(list(originals.items())[:10]), dict(list(originals.items())[10:])]
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [encode_tensors(h) for h in halves], "weight_version": "h0"})
    assert r.status_code == 200, r.text
    out = _generate(client, prompts[1], GREEDY)
    assert out["output_ids"] == expected["base"][1] and out["meta_info"]["weight_version"] == "h0"
    r = client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 4})
    assert r.json() == originals["final_norm"][:4].tolist()
    r = client.post("/update_weight_version", json={"new_version": "h0-renamed"})
    assert r.status_code == 200 and engine.get_weight_version() == "h0-renamed"
    assert compiled_executables() == before


def _in_background(client, prompt, params):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", _generate(client, prompt, params)), daemon=True)
    thread.start()
    return thread, box


def _await_output(engine):
    deadline = time.monotonic() + 60
    while not any(r.output_ids for r in list(engine.scheduler.running)):
        assert time.monotonic() < deadline
        time.sleep(0.001)


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_http_pause_modes(client, engine, prompts, expected, mode):
    for _ in range(3):  # the request may finish before the pause lands (an HTTP round trip): then again
        try:
            if _pause_over_http(client, engine, prompts, expected, mode):
                return
        finally:  # never leave the engine paused: the app's shutdown would wait on its requests
            engine.continue_generation()
    pytest.fail("the request finished before the pause reached the engine, three times")


def _pause_over_http(client, engine, prompts, expected, mode) -> bool:
    thread, box = _in_background(client, prompts[0], LONG)
    _await_output(engine)
    r = client.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["mode"] == mode, r.text
    caught = r.json()["aborted" if mode == "abort" else "parked" if mode == "in_place" else "queued"]
    if caught == 0:  # it had finished already
        thread.join(60)
        assert box["out"]["output_ids"] == expected["long"]
        return False
    assert caught == 1, r.text
    if mode == "in_place":
        r = client.post("/flush_cache")
        assert r.status_code == 400 and "paused in place" in r.json()["message"]
    queued, late = _in_background(client, prompts[0], LONG)  # a new request while paused: queued
    deadline = time.monotonic() + 60
    while client.get("/internal/load").json()["queued_requests"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert "out" not in late
    assert client.post("/continue_generation").json()["success"]
    thread.join(60)
    queued.join(60)
    assert "out" in box and "out" in late, "a request did not finish within 60 s of continue_generation"
    assert late["out"]["output_ids"] == expected["long"]
    out = box["out"]
    if mode == "abort":
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < len(expected["long"])
        assert out["output_ids"] == expected["long"][:len(out["output_ids"])]
    else:
        assert out["output_ids"] == expected["long"]
        assert (out["meta_info"]["retractions"] >= 1) == (mode == "retract")
    r = client.post("/pause_generation", json={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    return True


def test_release_and_resume_memory_occupation(engine, prompts, client):
    """Weights and the KV pool leave the device and come back without a recompile: the same greedy answers; a
    request sent while released queues and is answered after the resume; updates are refused meanwhile. Over
    HTTP too."""
    want = engine.generate(prompts[0], sampling_params=GREEDY)["output_ids"]
    engine.generate(prompts[1], sampling_params=GREEDY)  # (its shapes compiled before the count)
    compiles = compiled_executables()
    out = engine.release_memory_occupation()
    assert out["released"] == ["kv_cache", "weights"]
    assert out["memory_after"]["live_array_bytes"] < out["memory_before"]["live_array_bytes"]
    with pytest.raises(RuntimeError, match="released"):
        engine.update_weights_from_tensor({"layers.0.q": np.zeros((1,))})
    with pytest.raises(RuntimeError, match="released"):
        engine.continue_generation()
    watcher = FinishWatcher()
    req = engine.make_request(engine.tokenize(prompts[1], "prompt"), GREEDY, on_event=watcher)
    engine.submit(req)
    engine.step()  # queued, not run: the engine is paused while released
    assert not req.finished
    back = engine.resume_memory_occupation(["weights"])
    assert back["released"] == ["kv_cache"]
    engine.resume_memory_occupation("kv_cache")
    while not req.finished:
        engine.step()
    assert engine.generate(prompts[0], sampling_params=GREEDY)["output_ids"] == want
    assert compiled_executables() == compiles
    r = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache"]
    assert client.post("/release_memory_occupation", json={"tags": ["bogus"]}).status_code == 400
    assert client.post("/resume_memory_occupation", json={}).json()["released"] == []
    assert engine.generate(prompts[0], sampling_params=GREEDY)["output_ids"] == want
