"""Generated bad input for a real server (tests/test_serve_hardening.py throws it while long requests stream;
issue 34: one bad request must never hurt another).

At least 300 generated inputs across the endpoints (a valid body with one or two fields set to an extreme value
of another kind, width or encoding; malformed, truncated, nested or oversized bodies; bad paths and methods),
sent while long greedy requests stream on ``/generate`` and ``/v1/chat/completions``. Every answer must be a
4xx with a JSON error naming a field (or a 2xx where the generated value happened to be valid); no 5xx, no
hang; the long requests finish token for token as they do alone; nothing is left running or locked.
"""

from __future__ import annotations

import base64
import json
import random

import httpx
LONG = {"max_new_tokens": 192, "ignore_eos": True, "temperature": 0}
LONG_PROMPTS = ["Count up 40 steps from 7.", "Repeat 30 times: blue fox"]
TIMEOUT = 60.0

INTS = [-2 ** 63, -2 ** 31 - 1, -1, 0, 2 ** 31, 2 ** 32, 2 ** 63, 10 ** 30, 10 ** 400]
FLOATS = [-1e308, -2.5, -0.0, 1e-320, 1e-45, 3.5e38, 1e308]
STRINGS = ["", "\ud800", "a\udfffb", "\x00", "a\x00b", "x" * 100_000, "\U0001f600", "1", "null"]
OTHERS = [None, True, False, [], {}, [None], [[[]]], {"": None}, [2 ** 40], ["\ud800"], [-1], {"\ud800": 1}]
POOL = INTS + FLOATS + STRINGS + OTHERS

GENERATE_FIELDS = ["text", "input_ids", "rid", "stream", "n", "return_logprob", "top_logprobs_num",
                   "return_text_in_logprobs", "stream_provisional", "sampling_params"]
SAMPLING_FIELDS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "n", "return_logprob", "top_logprobs_num"]
OPENAI_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
                 "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "user", "metadata", "ignore_eos",
                 "stop_token_ids", "response_format", "tools", "echo", "suffix", "best_of"]


def _blob(header: dict | bytes, data: bytes = b"", length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return base64.b64encode(n.to_bytes(8, "little") + raw + data).decode()


def _entry(**changes) -> dict:
    return {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **changes}}


def bad_tensor_blobs() -> list[tuple[str, str]]:
    """(what, base64) safetensors blobs ``/update_weights_from_tensor`` must refuse with a 400 (issue 49: a shape of
    ``[Infinity]`` was a 500)."""
    four = b"\0" * 4
    return [
        ("shape [Infinity]", _blob(b'{"w": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', four)),
        ("shape [NaN]", _blob(b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', four)),
        ("shape [-1]", _blob(_entry(shape=[-1]), four)),
        ("shape [2^64]", _blob(_entry(shape=[2 ** 64]), four)),
        ("shape [1.0]", _blob(_entry(shape=[1.0]), four)),
        ("shape [true]", _blob(_entry(shape=[True]), four)),
        ("shape 'x'", _blob(_entry(shape="x"), four)),
        ("shape of 65 dims", _blob(_entry(shape=[1] * 65), four)),
        ("shape wrapping int64", _blob(_entry(shape=[2 ** 32, 2 ** 32], data_offsets=[0, 0]))),
        ("dtype I32", _blob(_entry(dtype="I32"), four)),
        ("dtype 5", _blob(_entry(dtype=5), four)),
        ("no dtype", _blob({"w": {"shape": [1], "data_offsets": [0, 4]}}, four)),
        ("offsets past the data", _blob(_entry(data_offsets=[0, 8]), four)),
        ("offsets huge", _blob(_entry(data_offsets=[0, 2 ** 70]), four)),
        ("offsets negative", _blob(_entry(data_offsets=[-4, 0]), four)),
        ("offsets reversed", _blob(_entry(data_offsets=[4, 0]), four)),
        ("offsets not a pair", _blob(_entry(data_offsets=[0]), four)),
        ("offsets a string", _blob(_entry(data_offsets="0-4"), four)),
        ("offsets floats", _blob(_entry(data_offsets=[0.0, 4.0]), four)),
        ("entry not an object", _blob({"w": 5})),
        ("only metadata", _blob({"__metadata__": {"format": "pt"}})),
        ("header a list", _blob(b"[]")),
        ("header nested 100k deep", _blob(b"[" * 100_000 + b"]" * 100_000)),
        ("header not UTF-8", _blob(b"\xff\xfe{}")),
        ("header length 2^63", _blob(_entry(), four, length=2 ** 63)),
        ("header length 2^64 - 1", _blob(_entry(), four, length=2 ** 64 - 1)),
        ("header length 0", _blob(_entry(), four, length=0)),
        ("header length past the blob", _blob(_entry(), four, length=1000)),
        ("a foreign file's first bytes", base64.b64encode(b"SECRET!!" + b"x" * 64).decode()),
        ("3 bytes", base64.b64encode(b"abc").decode()),
        ("empty", ""),
        ("not base64", "!!!"),
    ]


def hostile_bodies() -> list[tuple[str, bytes]]:
    """(path, body) JSON bodies under the byte limit whose shape is over the server's limits (issue 49: one of
    them held every other request for 8 s)."""
    wide = {f"{i:x}": 1 for i in range(150_000)}
    return [
        ("/generate", json.dumps({"text": "hi", "sampling_params": wide}, separators=(",", ":")).encode()),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 60_000}).encode()),
        ("/generate", json.dumps({"text": "hi", "sampling_params": {str(i): 1 for i in range(2000)}}).encode()),
        ("/generate", json.dumps({"input_ids": [5] * 1_100_000}, separators=(",", ":")).encode()),
        ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"),
        ("/update_weights_from_tensor", json.dumps({"serialized_named_tensors": ["x"] * 1_100_000},
                                                   separators=(",", ":")).encode()),
    ]


def _bodies(rng: random.Random, model: str) -> list[tuple[str, str, bytes | None, dict]]:
    """(method, path, raw body, headers) cases."""
    def value():
        v = rng.choice(POOL)
        if rng.random() < 0.15:  # a container of the value
            v = rng.choice([[v], {"0": v}, [v] * rng.randint(2, 400)])
        return v

    cases = []
    for _ in range(80):  # /generate
        body = {"text": "Count up 3 steps from 5.", "sampling_params": {"max_new_tokens": 8}}
        for _ in range(rng.randint(1, 2)):
            if rng.random() < 0.6:
                body["sampling_params"][rng.choice(SAMPLING_FIELDS)] = value()
            else:
                body[rng.choice(GENERATE_FIELDS)] = value()
        cases.append(("POST", "/generate", json.dumps(body).encode(), {}))
    for path in ("/v1/completions", "/v1/chat/completions"):
        for _ in range(60):
            if path == "/v1/completions":
                body = {"model": model, "prompt": "Count up 3 steps from 5.", "max_tokens": 8}
            else:
                body = {"model": model, "messages": [{"role": "user", "content": "Count up 3 steps from 5."}],
                        "max_tokens": 8}
            for _ in range(rng.randint(1, 2)):
                r = rng.random()
                if r < 0.7:
                    body[rng.choice(OPENAI_FIELDS)] = value()
                elif path.endswith("chat/completions"):
                    body["messages"] = rng.choice([value(), [{"role": value(), "content": "x"}],
                                                   [{"role": "user", "content": value()}],
                                                   [{"role": "user", "content": [{"type": "text", "text": value()}]}],
                                                   [{"role": "user", "content": [{"type": "image_url",
                                                                                  "image_url": {"url": "x"}}]}]])
                else:
                    body["prompt"] = value()
            cases.append(("POST", path, json.dumps(body).encode(), {}))
    raw = [b"", b"{", b"[", b"null", b"1", b'"x"', b"{\"text\": }", b"\xff\xfe", b"{\"text\": \"\\ud800\"}",
           b"[" * 100_000 + b"]" * 100_000, b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000, b"1e999999",
           b"{\"text\": \"x\", \"sampling_params\": {\"max_new_tokens\": 1e999}}", b"\x00" * 64,
           json.dumps({"text": "x", "text": "y"}).encode(), b"{\"text\": \"x\"}" + b" " * 10 + b"garbage"]
    for body in raw:
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request", "/start_profile"):
            cases.append(("POST", path, body, {}))
    for _ in range(20):
        cases.append(("POST", rng.choice(["/abort_request", "/start_profile"]),
                      json.dumps({rng.choice(["rid", "abort_all", "output_dir", "num_steps"]): value()}).encode(),
                      {}))
    for path in ("/v1/models/\ud800".encode("utf-8", "surrogatepass").decode("latin-1"), "/v1/models/%00",
                 "/v1/models/" + "x" * 5000, "/../../etc/passwd", "/generate/%2e%2e", "/nope"):
        cases.append(("GET", path, None, {}))
    # issue 49: bodies over the shape limits, malformed tensor blobs, /score, state-changing requests from other
    # origins (a 403: were one let through, /pause_generation would end the long streams)
    for path, body in hostile_bodies():
        cases.append(("POST", path, body, {}))
    for _, blob in bad_tensor_blobs():
        cases.append(("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": blob}).encode(),
                      {}))
    for body in ({"completions": ["a"]}, {"text": "hi", "input_ids": [1], "completions": ["a"]},
                 {"text": ["hi", 5], "completions": ["a"]}, {"input_ids": [[1], [10 ** 9]], "completions": ["a"]},
                 {"text": "hi", "completions": []}, {"text": "hi", "completions": [[-1]]},
                 {"text": "hi", "completions": ["a"], "num_samples": 10 ** 9}):
        cases.append(("POST", "/score", json.dumps(body).encode(), {}))
    for path in ("/pause_generation", "/flush_cache", "/continue_generation", "/abort_request", "/stop_profile",
                 "/release_memory_occupation", "/update_weight_version"):
        for headers in ({"Origin": "http://localhost:9999"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                        {"Sec-Fetch-Site": "same-site"}):
            body = b'{"abort_all": true}' if path == "/abort_request" else b""
            cases.append(("POST", path, body, headers))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        cases.append(("POST", "/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": 4}}',
                      {"Content-Type": ctype}))
    return cases


def _long(base: str, prompt: str, chat: bool) -> dict:
    """One long greedy request, streamed; its output ids (or text, for chat) and how it ended."""
    with httpx.Client(base_url=base, timeout=TIMEOUT * 4) as c:
        if chat:
            body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 192,
                    "temperature": 0, "ignore_eos": True}
            path = "/v1/chat/completions"
        else:
            body = {"text": prompt, "sampling_params": LONG, "stream": True}
            path = "/generate"
        frames = []
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    frames.append(json.loads(line[6:]))
        if chat:
            text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices"))
            return {"text": text, "finish": frames[-1]["choices"][0].get("finish_reason") if frames else None}
        return {"ids": frames[-1]["output_ids"], "finish": frames[-1]["meta_info"]["finish_reason"]}
