"""Where a denoise step's device time goes: ``python -m bench.step_profile [--smoke]``.

Records a JAX profiler trace of the engine's denoise step (:func:`dllm_jax.decode.step.denoise`, one FDFO step of
greedy LowConfidence, B = 32; the step ``bench.roofline`` times) at batch 1 and 64 (SDAR-1.7B shape, random bf16
weights, Pallas backends, 1k prefix on a GPU; a tiny model on the XLA path with ``--smoke``), and reads the trace
back offline:

* **device ops**: from the ``.xplane.pb`` the profiler writes (read with ``jax._src.profiler.ProfileData``; the
  ``*.trace.json.gz`` as a fallback). On a GPU these are the kernels on the device plane's stream lines, each with
  its HLO instruction (``hlo_op``); on a CPU, the XLA:CPU thunks on the client threads (``hlo_op`` too), a thunk
  that contains others (a conditional) counted through its children. Only the step's module counts.
* **op classes**: each HLO instruction of the compiled step (its ``as_text()``: ``op_name`` = the named-scope path,
  ``stack_frame_id`` = the Python function that emitted it, resolved through the text's FileNames /
  FunctionNames / FileLocations / StackFrames tables) goes to one of: projections (q/k/v/o), attention, MLP,
  norms / RoPE, LM head + confidence, algorithm, K/V write, other (embedding, copies, loop control). A fusion goes
  by its matmul / custom call / scatter if it has one, else by the majority of its instructions. No scope in the
  model code is needed (``dllm_jax/model/qwen3.py`` has ``attention``, ``mlp``, ``kv_write``; the step adds
  ``confidence``, ``algorithm``); the rules also take ``qkv_proj`` / ``o_proj`` / ``norm`` / ``rope`` scopes should
  the model grow them.
* **rooflines per class**: the class's minimal bytes (its weights once, the prefix K/V once, activations in and
  out) and FLOPs from the shapes, over the card's measured copy bandwidth and matmul rate (measured here on a GPU,
  as in ``bench.roofline``): its floor, and the measured time over it.

Prints, per batch, the step time (waited for, and back to back), the trace's device-busy time, the top ops (device
us per step, share of the step, class) and the class table; writes JSON (``--out``) and keeps the trace
(``--trace-dir``). On a GPU the CUDA-graph command buffers are turned off for this process (``XLA_FLAGS``): inside
a graph the kernels carry no HLO names. Needs only jax and numpy.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings

CLASSES = ("projections", "attention", "mlp", "norms_rope", "lm_head_confidence", "algorithm", "kv_write", "other")
CLASS_LABELS = {"projections": "projections (q/k/v/o)", "attention": "attention", "mlp": "MLP (gate/up/down)",
                "norms_rope": "norms / RoPE", "lm_head_confidence": "LM head + confidence",
                "algorithm": "algorithm", "kv_write": "K/V write", "other": "other"}


def _disable_command_buffers() -> None:
    """Kernels launched inside a CUDA graph carry no HLO annotation in the trace: run this process without."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=").strip()


# ----------------------------------------------------------------------------------------------
# The compiled step's HLO: instruction -> (opcode, scope path, emitting function, called computations)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    op_name: str = ""
    func: str = ""  # the Python function that emitted it (innermost user frame)
    file: str = ""
    stack: tuple = ()  # (function, file) from the innermost frame out
    calls: tuple = ()
    target: str = ""  # custom_call_target
    operands: tuple = ()


_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_TABLE_ROW = re.compile(r'^(\d+)\s+(?:"(.*)"|\{(.*)\})\s*$')


def _split_shape(rest: str) -> str:
    """``rest`` after ``name = ``: drop the result shape (a tuple shape is parenthesised), return the remainder."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[i + 1:].lstrip()
        return ""
    cut = rest.find(" ")
    return rest[cut + 1:].lstrip() if cut >= 0 else ""


def _kv(text: str) -> dict:
    return {k: v for k, v in re.findall(r"(\w+)=(\S+)", text)}


def parse_hlo(text: str) -> tuple[dict, dict, str]:
    """``compiled.as_text()`` -> (instructions by name, computations: name -> [instruction names], module name)."""
    module = ""
    tables: dict[str, dict] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    instrs: dict[str, Instr] = {}
    comps: dict[str, list] = {}
    section, comp = None, None
    for line in text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        if line.strip() in tables:
            section = line.strip()
            continue
        if section is not None:
            m = _TABLE_ROW.match(line.strip())
            if m:
                tables[section][int(m.group(1))] = m.group(2) if m.group(2) is not None else _kv(m.group(3))
                continue
            section = None
        m = _COMP.match(line)
        if m:
            comp = m.group(2)
            comps[comp] = []
            continue
        if line.startswith("}"):
            comp = None
            continue
        if comp is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), _split_shape(m.group(2))
        op = re.match(r"([a-z][\w\-]*)\(", rest)
        ins = Instr(name=name, opcode=op.group(1) if op else "")
        if op:
            args = rest[op.end():]
            depth, end = 1, len(args)
            for i, ch in enumerate(args):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    end = i
                    break
            ins.operands = tuple(re.findall(r"%([\w.\-]+)", args[:end]))
        md = re.search(r'op_name="([^"]*)"', rest)
        ins.op_name = md.group(1) if md else ""
        calls = []
        for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
            calls += re.findall(rf"\b{key}=%?([\w.\-]+)", rest)
        for key in ("branch_computations", "calls"):
            for group in re.findall(rf"\b{key}=\{{([^}}]*)\}}", rest):
                calls += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        ins.calls = tuple(dict.fromkeys(calls))
        tgt = re.search(r'custom_call_target="([^"]*)"', rest)
        ins.target = tgt.group(1) if tgt else ""
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        if frame:
            ins.stack = _stack(tables, int(frame.group(1)))
            if ins.stack:
                ins.func, ins.file = ins.stack[0]
        else:
            src = re.search(r'source_file="([^"]*)"', rest)
            ins.file = src.group(1) if src else ""
        instrs[name] = ins
        comps[comp].append(name)
    return instrs, comps, module


def _stack(tables: dict, frame_id: int) -> tuple:
    """The (function, file) chain of a stack frame, innermost first. The StackFrames rows of jaxlib 0.10's text
    print each frame's parent id plus one (a root, parent 0, prints 1; a frame whose parent is row 3 prints 4); a
    text whose roots print 0 gives the parent ids as they are. Both are read."""
    frames = tables["StackFrames"]
    if "_offset" not in tables:
        parents = {i: int(f.get("parent_frame_id", 0)) for i, f in frames.items()}
        tables["_offset"] = 0 if any(p == 0 for p in parents.values()) else 1
    offset = tables["_offset"]
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        f = frames[frame_id]
        loc = tables["FileLocations"].get(int(f.get("file_location_id", -1)), {})
        out.append((tables["FunctionNames"].get(int(loc.get("function_name_id", -1)), ""),
                    tables["FileNames"].get(int(loc.get("file_name_id", -1)), "")))
        frame_id = int(f.get("parent_frame_id", 0)) - offset
    return tuple(out)


def _label(ins: Instr) -> str:
    """The class of one (non-fusion) instruction, from its scope path and the functions on its stack (any of them,
    by rule order: a norm inside the MLP scope is a norm, a matmul inside it MLP)."""
    path = ins.op_name.lower()
    stack = ins.stack or ((ins.func, ins.file),)
    funcs = {f.rsplit(".", 1)[-1] for f, _ in stack} | {f for f, _ in stack}
    files = {os.path.basename(f) for _, f in stack}
    scopes = set(re.split(r"[/()]", path))
    if "kv_write" in scopes or any("to_pages" in f for f in funcs) or "kv_to_storage" in funcs:
        return "kv_write"
    if "algorithm" in scopes or "algorithms.py" in files:
        return "algorithm"
    if ({"confidence", "logprobs"} & scopes or {"confidence.py", "logprobs.py"} & files
            or {"logits_from_hidden", "confidence_stats_from_logits", "first_index_of_max"} & funcs):
        return "lm_head_confidence"
    if ({"paged_block_attention.py", "xla_attention.py"} & files or "paged_block_attention" in path
            or "paged_block_attention" in ins.target):
        return "attention"
    if {"rms_norm", "rope"} & funcs or {"norm", "rope", "rms_norm", "qk_norm"} & scopes:
        return "norms_rope"
    if "mlp" in scopes or {"swiglu", "_mlp", "moe_mlp"} & funcs:
        return "mlp"
    if {"linear", "_qkv", "_out_proj", "contract"} & funcs or {"qkv_proj", "o_proj", "proj"} & scopes:
        return "projections"
    return "other"


_HEAVY = ("dot", "convolution", "custom-call", "scatter")


def classify(name: str, instrs: dict, comps: dict, _seen=None) -> str:
    """The class of HLO instruction ``name``: a fusion (or call) by its heaviest instruction (matmul, custom call,
    scatter), else by the majority of its instructions' classes; any other instruction by its own. One that says
    nothing of itself (no metadata: XLA's wrapped broadcasts, reduce-windows) goes with the operand it reads."""
    ins = instrs.get(name)
    if ins is None:
        return "other"
    cls = _classify(ins, instrs, comps, _seen)
    if cls == "other" and not ins.op_name and not ins.func:
        for operand in ins.operands:
            src = instrs.get(operand)
            if src is not None and src.opcode not in ("constant", "parameter") and (_seen is None or
                                                                                  operand not in _seen):
                seen = set(_seen or ()) | {name}
                if operand in seen:
                    continue
                return classify(operand, instrs, comps, seen)
    return cls


def _classify(ins: Instr, instrs: dict, comps: dict, _seen=None) -> str:
    if ins.opcode not in ("fusion", "call", "async-start") or not ins.calls:
        return _label(ins)
    seen = _seen if _seen is not None else set()
    inner = []
    for comp in ins.calls:
        if comp in seen:
            continue
        seen.add(comp)
        for n in comps.get(comp, ()):
            inner.append(instrs[n])
    for heavy in _HEAVY:
        for i in inner:
            if i.opcode == heavy:
                return _label(i)
    for i in inner:
        if i.opcode in ("fusion", "call"):
            return classify(i.name, instrs, comps, seen)
    votes = collections.Counter(_label(i) for i in inner if i.opcode not in ("parameter", "constant", "tuple",
                                                                             "get-tuple-element", "bitcast"))
    votes.pop("other", None)
    if votes:
        return votes.most_common(1)[0][0]
    return _label(ins)


# ----------------------------------------------------------------------------------------------
# The trace: device op events
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class OpEvent:
    hlo_op: str
    name: str  # the event's own name (GPU: the kernel)
    module: str
    start_us: float
    dur_us: float
    line: str


_NON_KERNEL_LINES = ("xla modules", "xla ops", "steps", "tensorflow", "framework", "source", "launch stats",
                     "host threads", "xla traceme", "memcpy")


def _pick_device_lines(lines: list[tuple[str, list]]) -> list[tuple[str, list]]:
    """Of a device plane's lines: the stream lines (one event per kernel); else the derived "XLA Ops" line."""
    streams = [(n, evs) for n, evs in lines if n.lower().startswith("stream")]
    if streams:
        return streams
    ops = [(n, evs) for n, evs in lines if n.lower() == "xla ops"]
    if ops:
        return ops
    return [(n, evs) for n, evs in lines if not any(n.lower().startswith(x) for x in _NON_KERNEL_LINES)]


def _leaves(events: list[OpEvent]) -> list[OpEvent]:
    """Per line, drop events that contain another op event (a CPU conditional / while thunk around its ops)."""
    out = []
    by_line = collections.defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for evs in by_line.values():
        evs.sort(key=lambda e: (e.start_us, -e.dur_us))
        for i, e in enumerate(evs):
            end = e.start_us + e.dur_us
            j = i + 1
            contains = False
            while j < len(evs) and evs[j].start_us < end:
                if evs[j].start_us + evs[j].dur_us <= end + 1e-6 and evs[j] is not e:
                    contains = True
                    break
                j += 1
            if not contains:
                out.append(e)
    return out


def _profile_data_class():
    for path in ("jax.profiler", "jax._src.profiler", "jax._src.lib._profile_data"):
        try:
            mod = __import__(path, fromlist=["ProfileData"])
            cls = getattr(mod, "ProfileData", None)
            if cls is not None:
                return cls
        except Exception:
            continue
    return None


def _events_from_xplane(path: str) -> tuple[list[OpEvent], bool]:
    cls = _profile_data_class()
    if cls is None:
        raise RuntimeError("no ProfileData in this jax")
    data = cls.from_file(path)
    device, host = [], []
    for plane in data.planes:
        pname = plane.name
        if pname.startswith("/device:"):
            lines = [(line.name, list(line.events)) for line in plane.lines]
            for lname, evs in _pick_device_lines(lines):
                for ev in evs:
                    stats = dict(ev.stats)
                    device.append(OpEvent(str(stats.get("hlo_op", ev.name)), ev.name, str(stats.get("hlo_module", "")),
                                          ev.start_ns / 1e3, ev.duration_ns / 1e3, f"{pname}:{lname}"))
        elif pname.startswith("/host:"):
            for line in plane.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats:
                        host.append(OpEvent(str(stats["hlo_op"]), ev.name, str(stats.get("hlo_module", "")),
                                            ev.start_ns / 1e3, ev.duration_ns / 1e3, f"{pname}:{line.name}"))
    return (device, True) if device else (_leaves(host), False)


def _events_from_json(path: str) -> tuple[list[OpEvent], bool]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    by_line = collections.defaultdict(list)
    host = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or str(e.get("name", "")).startswith("end: "):
            continue
        args = e.get("args") or {}
        pname = procs.get(e.get("pid"), "")
        line = threads.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
        ev = OpEvent(str(args.get("hlo_op", e.get("name", ""))), str(e.get("name", "")),
                     str(args.get("hlo_module", "")), float(e.get("ts", 0.0)), float(e["dur"]), f"{pname}:{line}")
        if pname.startswith("/device:"):
            by_line[(pname, line)].append(ev)
        elif "hlo_op" in args:
            host.append(ev)
    device = []
    planes = collections.defaultdict(list)
    for (pname, line), evs in by_line.items():
        planes[pname].append((line, evs))
    for pname, lines in planes.items():
        for _, evs in _pick_device_lines(lines):
            device += evs
    return (device, True) if device else (_leaves(host), False)


def find_profile_files(trace_dir: str) -> dict:
    runs = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*")), key=os.path.getmtime)
    if not runs:
        return {}
    run = runs[-1]
    xplanes = glob.glob(os.path.join(run, "*.xplane.pb"))
    jsons = [p for p in glob.glob(os.path.join(run, "*.json.gz"))]
    jsons.sort(key=lambda p: "perfetto" in os.path.basename(p))  # <host>.trace.json.gz first
    return {"xplane": xplanes[0] if xplanes else None, "json": jsons[0] if jsons else None, "dir": run}


def device_op_events(trace_dir: str, module: str | None = None) -> dict:
    """The trace's device op events (``on_device``: from a device plane, else the CPU client's thunks), only the
    events of ``module`` when the trace names modules. Tries the xplane, then the JSON trace."""
    files = find_profile_files(trace_dir)
    errors = []
    for kind, reader in (("xplane", _events_from_xplane), ("json", _events_from_json)):
        path = files.get(kind)
        if not path:
            continue
        try:
            events, on_device = reader(path)
        except Exception as e:  # noqa: BLE001 -- report and try the other file
            errors.append(f"{kind}: {type(e).__name__}: {e}")
            continue
        if module and any(e.module for e in events):
            events = [e for e in events if e.module == module or not e.module]
        return dict(events=events, on_device=on_device, source=path, errors=errors)
    return dict(events=[], on_device=False, source=None, errors=errors or ["no trace files"])


# ----------------------------------------------------------------------------------------------
# Rooflines per class
# ----------------------------------------------------------------------------------------------

def class_floors(cfg, rows: int, prefix: int, block: int, itemsize: int) -> dict:
    """Minimal bytes and FLOPs of one denoise step per class: its weights read once, the prefix K/V read once, the
    class's input activations read once and its outputs written once (intermediates inside a class, such as the
    MLP's gate/up outputs, are left out: a fused implementation keeps them on chip). Dense models only."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = rows * block
    s = itemsize
    qkv_w = H * (hq + 2 * hkv) * d
    o_w = hq * d * H
    mlp_w = 3 * H * I
    io = lambda n: T * n * s  # noqa: E731 -- one [T, n] activation read or written once
    return {
        "projections": dict(bytes=L * ((qkv_w + o_w) * s + io(H) + io((hq + 2 * hkv) * d) + io(hq * d) + io(H)),
                            flops=2 * T * L * (qkv_w + o_w)),
        "attention": dict(bytes=L * (rows * prefix * 2 * hkv * d * s + io((hq + 2 * hkv) * d) + io(hq * d)),
                          flops=4 * T * hq * d * (prefix + block) * L),
        "mlp": dict(bytes=L * (mlp_w * s + 2 * io(H)), flops=2 * T * L * mlp_w + 4 * T * L * I),
        "norms_rope": dict(bytes=L * (4 * io(H) + 2 * io((hq + hkv) * d)) + 2 * io(H),
                           flops=L * T * (8 * H + 12 * (hq + hkv) * d)),
        "lm_head_confidence": dict(bytes=V * H * s + io(H) + 12 * T, flops=2 * T * H * V + 4 * T * V),
        "algorithm": dict(bytes=T * 16, flops=T * 8),
        "kv_write": dict(bytes=L * io(2 * hkv * d), flops=0),
        "other": dict(bytes=2 * io(H), flops=0),  # the embedding rows, gathered and written
    }


# ----------------------------------------------------------------------------------------------
# Profile one step
# ----------------------------------------------------------------------------------------------

def summarize(events: list[OpEvent], steps: int, instrs: dict, comps: dict, *, step_ms: float | None,
              floors: dict | None, ceilings: dict, top: int = 15) -> dict:
    """Per-op and per-class device time per step from ``events`` (``steps`` steps traced)."""
    per_op: dict[str, dict] = {}
    by_kernel_name = {n.replace(".", "_"): n for n in instrs}
    for e in events:
        key = e.hlo_op
        if key not in instrs:  # a kernel name (inside a graph: no hlo_op stat); XLA names kernels by the fusion
            key = by_kernel_name.get(key.replace(".", "_"), key)
        r = per_op.setdefault(key, dict(hlo_op=key, kernels=collections.Counter(), count=0, total_us=0.0))
        r["count"] += 1
        r["total_us"] += e.dur_us
        r["kernels"][e.name] += 1
    busy_us = sum(r["total_us"] for r in per_op.values()) / steps
    ref_us = 1e3 * step_ms if step_ms else busy_us
    classes = {c: dict(us=0.0, ops=0) for c in CLASSES}
    ops = []
    for r in per_op.values():
        cls = classify(r["hlo_op"], instrs, comps)
        us = r["total_us"] / steps
        ins = instrs.get(r["hlo_op"])
        ops.append(dict(hlo_op=r["hlo_op"], cls=cls, us_per_step=us, calls_per_step=r["count"] / steps,
                        share=us / ref_us if ref_us else float("nan"),
                        kernels=[k for k, _ in r["kernels"].most_common(3)],
                        op_name=ins.op_name if ins else "", func=ins.func if ins else ""))
        classes[cls]["us"] += us
        classes[cls]["ops"] += 1
    ops.sort(key=lambda r: -r["us_per_step"])
    bw = ceilings.get("copy_bytes_per_s") or 4.8e12
    peak = ceilings.get("matmul_flops") or 990e12
    table = []
    for c in CLASSES:
        row = dict(cls=c, us_per_step=classes[c]["us"], ops=classes[c]["ops"],
                   share=classes[c]["us"] / ref_us if ref_us else float("nan"))
        if floors:
            f = floors[c]
            t_mem, t_cmp = f["bytes"] / bw * 1e6, f["flops"] / peak * 1e6
            row.update(bytes=f["bytes"], flops=f["flops"], memory_floor_us=t_mem, compute_floor_us=t_cmp,
                       floor_us=max(t_mem, t_cmp), bound="memory" if t_mem >= t_cmp else "compute",
                       x_floor=classes[c]["us"] / max(t_mem, t_cmp) if max(t_mem, t_cmp) > 0 else float("nan"))
        table.append(row)
    return dict(busy_us_per_step=busy_us, step_us=ref_us, ops=ops[:top], all_ops=len(ops), classes=table,
                unattributed_us=sum(o["us_per_step"] for o in ops if o["hlo_op"] not in instrs))


def profile_batch(bench, batch: int, prefix: int, backend: str, *, steps: int, trace_dir: str,
                  ceilings: dict, log=print) -> dict:
    """Trace ``steps`` back-to-back denoise steps of ``batch`` rows (compiled ahead, so the trace holds only them),
    and summarise the device time."""
    import jax

    from bench.roofline import BLOCK, _batch, _init_state
    from dllm_jax.decode.algorithms import make_algorithm
    from dllm_jax.decode.step import denoise

    cfg = bench.cfg
    spec = bench.spec(backend)
    b = _batch(cfg, batch, prefix, max(1, prefix // BLOCK), bench.rng, bench.num_pages)
    state = _init_state(make_algorithm("LowConfidence", {}, model_config=cfg), batch)
    t0 = time.perf_counter()
    compiled = denoise.lower(bench.params, bench.pool, b, state, spec=spec).compile()
    compile_s = time.perf_counter() - t0
    instrs, comps, module = parse_hlo(compiled.as_text())

    def step():
        bench.pool, out = compiled(bench.params, bench.pool, b, state)
        return out

    jax.block_until_ready(step())
    synced = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - t0) / steps
    run_dir = os.path.join(trace_dir, f"batch{batch}")
    jax.profiler.start_trace(run_dir, create_perfetto_trace=True)
    try:
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
    finally:
        jax.profiler.stop_trace()
    got = device_op_events(run_dir, module)
    step_ms = 1e3 * statistics.median(synced)
    floors = class_floors(cfg, batch, prefix, BLOCK, jax.numpy.dtype(bench.dtype).itemsize)
    res = dict(batch=batch, prefix=prefix, backend=backend, module=module, compile_s=compile_s, steps=steps,
               step_ms=step_ms, pipelined_ms=1e3 * pipelined, trace_source=got["source"], on_device=got["on_device"],
               trace_errors=got["errors"], events=len(got["events"]), hlo_instructions=len(instrs))
    if got["events"]:
        res.update(summarize(got["events"], steps, instrs, comps, step_ms=1e3 * pipelined, floors=floors,
                             ceilings=ceilings))
    else:
        log(f"  batch {batch}: no op events in the trace ({got['errors']})")
    return res


def format_profile(r: dict, top: int = 12) -> str:
    from bench.common import table

    head = (f"batch {r['batch']}, prefix {r['prefix']}, {r['backend']}: step {r['step_ms']:.3f} ms waited for, "
            f"{r['pipelined_ms']:.3f} ms back to back; trace: {r.get('busy_us_per_step', 0) / 1e3:.3f} ms of device "
            f"ops per step ({'device plane' if r['on_device'] else 'CPU client threads'}, {r['events']} events)")
    if "ops" not in r:
        return head + "\n(no op events)"
    ops = table(f"top ops, {head}", ["op", "class", "us / step", "share", "calls", "kernel / scope"],
                [[o["hlo_op"][:40], o["cls"], o["us_per_step"], f"{100 * o['share']:.1f}%", o["calls_per_step"],
                  (o["kernels"][0] if o["kernels"] and o["kernels"][0] != o["hlo_op"] else o["op_name"])[-60:]]
                 for o in r["ops"][:top]])
    cls = table(f"op classes vs their own roofline (batch {r['batch']}; share of the back-to-back step)",
                ["class", "us / step", "share", "ops", "MB", "GFLOP", "floor us", "bound", "x floor"],
                [[CLASS_LABELS[c["cls"]], c["us_per_step"], f"{100 * c['share']:.1f}%", c["ops"],
                  c.get("bytes", 0) / 1e6, c.get("flops", 0) / 1e9, c.get("floor_us", float("nan")),
                  c.get("bound", "-"), c.get("x_floor", float("nan"))] for c in r["classes"]])
    return ops + "\n" + cls


def run(*, smoke: bool = False, batches=(1, 64), prefix: int = 1024, backend: str | None = None, steps: int = 10,
        trace_dir: str | None = None, out_path: str | None = None, measure_ceilings: bool = True, log=print) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.roofline import SDAR_1_7B, SMOKE, StepBench, count_params, model_config

    on_gpu = jax.default_backend() == "gpu"
    if smoke:
        shape, dtype, prefix, steps = SMOKE, jnp.float32, 64, min(steps, 3)
        batches = tuple(min(b, 2) for b in batches)
    else:
        shape, dtype = SDAR_1_7B, jnp.bfloat16
    backend = backend or ("pallas" if on_gpu else "xla")
    cfg = model_config(shape)
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="dllm-step-profile-")
    result = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  smoke=smoke, dtype=jnp.dtype(dtype).name, shape=shape, attention_confidence_backend=backend,
                  trace_dir=trace_dir, xla_flags=os.environ.get("XLA_FLAGS", ""), profiles=[])
    log(f"step_profile: jax {jax.__version__} on {result['device']}; {count_params(cfg) / 1e9:.3f}B params; "
        f"backend {backend}; traces in {trace_dir}")
    ceilings = {}
    if on_gpu and not smoke and measure_ceilings:
        from bench.roofline import ceilings as measure

        try:
            ceilings = measure(dtype)
        except Exception as e:  # noqa: BLE001
            log(f"ceilings: FAILED {type(e).__name__}: {e}")
    result["ceilings"] = ceilings
    if ceilings:
        log(f"measured ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
            f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s (class floors use them)")
    bench = StepBench(cfg, max_batch=max(batches), max_prefix=prefix, dtype=dtype)
    for batch in batches:
        try:
            r = profile_batch(bench, batch, prefix, backend, steps=steps, trace_dir=trace_dir, ceilings=ceilings,
                              log=log)
        except Exception as e:  # noqa: BLE001 -- one failing batch must not hide the other
            log(f"batch {batch}: FAILED {type(e).__name__}: {str(e)[:500]}")
            result["profiles"].append(dict(batch=batch, error=f"{type(e).__name__}: {e}"))
            continue
        result["profiles"].append(r)
        log(format_profile(r))
        if out_path:
            from bench.common import write_json

            write_json(out_path, result)
    if out_path:
        from bench.common import write_json

        write_json(out_path, result)
    return result


def main(argv=None) -> int:
    from bench.common import GpuScript

    cli = GpuScript("step_profile", __doc__, what="profile", batches=[1, 64],
                    smoke_help="tiny model, any backend (checks the script)")
    ap = cli.parser
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--backend", default=None, help="attention and confidence backend (default: pallas on a GPU, "
                                                    "else xla)")
    ap.add_argument("--steps", type=int, default=10, help="steps traced per batch")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--keep-command-buffers", action="store_true",
                    help="leave XLA's CUDA graphs on (kernels inside them lose their HLO names in the trace)")
    args = cli.parse(argv)
    if not args.keep_command_buffers and "jax" not in sys.modules:
        _disable_command_buffers()
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
    if cli.no_gpu(args.smoke):
        return 0
    run(smoke=args.smoke, batches=tuple(args.batches), prefix=args.prefix, backend=args.backend, steps=args.steps,
        trace_dir=args.trace_dir, out_path=args.out)
    return cli.wrote()


if __name__ == "__main__":
    sys.exit(main())
