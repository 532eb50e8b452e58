"""Which grammar engine structured output uses: llguidance, xgrammar and outlines-core measured on one tokenizer.

    python -m bench.grammar_engines [--tokenizer DIR] [--out bench_out/grammar_engines.json]

For each engine and grammar (a JSON schema, a date regex): the compile time, the cost of one next-token bitmask
(the frontier mask the engine computes per constrained row and step), and of checking a decided block of ``k``
tokens (how many of them are a valid continuation: ``validate`` where the engine has it, else a consume loop) plus
the rollback that undoes it. The mask is the figure that is paid per step and row; the block check is paid per
step and row where several tokens of a block commit at once. See ``dllm_jax/engine/grammar.py`` for the choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
SAMPLE_JSON = '{"name": "Alice", "age": 31, "tags": ["red", "blue"], "address": {"city": "Paris", "zip": "75001"}}'
DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SAMPLE_DATE = "2024-02-29"


def _time(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bench_llguidance(tok, vocab: int, eos: int, grammar_kind: str, text: str, sample_ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np

    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(text) if grammar_kind == "json"
               else llguidance.LLMatcher.grammar_from_regex(text))
    compile_s = _time(lambda: llguidance.LLMatcher(lt, grammar), 3)
    m = llguidance.LLMatcher(lt, grammar)
    mask = np.zeros(((vocab + 31) // 32,), np.int32)
    per_mask = []
    for t in sample_ids:
        s = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        per_mask.append(time.perf_counter() - s)
        assert m.consume_token(t), m.get_error()
    m.reset()
    k = min(32, len(sample_ids))
    validate_s = _time(lambda: m.validate_tokens(sample_ids[:k]), 20)

    def consume_rollback():
        n = m.try_consume_tokens(sample_ids[:k])
        m.rollback(n)
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.median(per_mask) * 1e6,
            "mask_max_us": max(per_mask) * 1e6, f"validate_{k}_us": validate_s * 1e6,
            f"consume_rollback_{k}_us": _time(consume_rollback, 20) * 1e6, "checks_block_with_holes": False}


def bench_xgrammar(tok, vocab: int, eos: int, grammar_kind: str, text: str, sample_ids: list[int]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_fn = ((lambda: compiler.compile_json_schema(text)) if grammar_kind == "json"
                  else (lambda: compiler.compile_regex(text)))
    compile_s = _time(compile_fn, 3)
    m = xgr.GrammarMatcher(compile_fn(), max_rollback_tokens=64)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_mask = []
    for t in sample_ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per_mask.append(time.perf_counter() - s)
        assert m.accept_token(t)
    m.reset()
    k = min(32, len(sample_ids))

    def consume_rollback():  # no validate call: accept until the first failure, then roll back
        n = 0
        for t in sample_ids[:k]:
            if not m.accept_token(t):
                break
            n += 1
        m.rollback(n)
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.median(per_mask) * 1e6,
            "mask_max_us": max(per_mask) * 1e6, f"validate_{k}_us": None,
            f"consume_rollback_{k}_us": _time(consume_rollback, 20) * 1e6, "checks_block_with_holes": False}


def bench_outlines(tok, vocab: int, eos: int, grammar_kind: str, text: str, sample_ids: list[int]) -> dict:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder = {v: k for k, v in tok.backend_tokenizer.get_vocab(with_added_tokens=False).items()}
    byte_of = _byte_decoder()
    tokens: dict[bytes, list[int]] = {}
    for i, s in decoder.items():
        if i != eos and i < vocab:
            tokens.setdefault(bytes(byte_of[c] for c in s), []).append(i)
    voc = Vocabulary(eos, tokens)
    regex = build_regex_from_schema(text) if grammar_kind == "json" else text
    compile_s = _time(lambda: Index(regex, voc), 1)
    index = Index(regex, voc)
    state, per_mask = index.get_initial_state(), []
    for t in sample_ids[:-1]:  # (its EOS is allowed in a final state, not a transition)
        s = time.perf_counter()
        index.get_allowed_tokens(state)  # a list of ids (a bitmask is built from it by the caller)
        per_mask.append(time.perf_counter() - s)
        state = index.get_next_state(state, t)
        assert state is not None, t
    assert index.is_final_state(state)
    k = min(32, len(sample_ids))

    def walk():  # a DFA: checking k tokens is k table lookups; no rollback needed (keep the state)
        s = index.get_initial_state()
        for t in sample_ids[:min(k, len(sample_ids) - 1)]:
            s = index.get_next_state(s, t)
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.median(per_mask) * 1e6,
            "mask_max_us": max(per_mask) * 1e6, f"validate_{k}_us": _time(walk, 20) * 1e6,
            f"consume_rollback_{k}_us": None, "checks_block_with_holes": "DFA walk (regular languages only)"}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _trained_tokenizer(size: int):
    """A Qwen2-style byte-level BPE of ``size`` tokens trained on the installed Python sources."""
    import glob
    import os
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))[:3000]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = (open(f, encoding="utf-8", errors="ignore").read() for f in files)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<|mask|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def main(argv=None) -> dict:
    from bench.common import write_json
    from dllm_jax.model.tokenizer import load_tokenizer
    import dllm_jax.assets

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="a model directory (default: the shipped model)")
    p.add_argument("--train-vocab", type=int, default=0,
                   help="instead: a byte-level BPE of this many tokens trained here on the installed Python "
                        "sources (a real-size vocabulary without a download)")
    p.add_argument("--out", default="bench_out/grammar_engines.json")
    args = p.parse_args(argv)
    if args.train_vocab:
        path, tok = f"trained byte-level BPE ({args.train_vocab})", _trained_tokenizer(args.train_vocab)
        vocab = len(tok)
    else:
        path = args.tokenizer or dllm_jax.assets.DEFAULT_MODEL_PATH
        tok = load_tokenizer(path)
        with open(f"{path}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
    eos = tok.eos_token_id
    rows = []
    for kind, text, sample in (("json", json.dumps(SCHEMA), SAMPLE_JSON), ("regex", DATE_REGEX, SAMPLE_DATE)):
        ids = tok.encode(sample, add_special_tokens=False) + [eos]
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                         ("outlines-core", bench_outlines)):
            try:
                r = fn(tok, vocab, eos, kind, text, ids)
            except Exception as e:  # an engine that cannot take this grammar / tokenizer: say so
                r = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append({"engine": name, "grammar": kind, "tokens": len(ids), **r})
    print(f"tokenizer {path} (vocab {vocab})")
    print(f"{'engine':14} {'grammar':7} {'compile ms':>10} {'mask us':>8} {'mask max':>9} {'check k=32 us':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:14} {r['grammar']:7} error: {r['error']}")
            continue
        check = next((v for k, v in r.items() if k.startswith(("validate_", "consume_")) and v is not None), None)
        print(f"{r['engine']:14} {r['grammar']:7} {r['compile_ms']:10.2f} {r['mask_us']:8.1f} "
              f"{r['mask_max_us']:9.1f} {check:14.1f}")
    write_json(args.out, {"tokenizer": path, "vocab": vocab, "rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    main()
