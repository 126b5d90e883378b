"""Compare grammar libraries for guided decoding (CPU): compile time, per-step mask cost, coverage.

Per step, as the engine does it: advance each of R constrained rows by one token, then fill
the next-token bitmask of all R rows ([R, ceil(V/32)] int32). The token stream of each row is
a valid instance of the schema tokenized by the model's tokenizer (SmolLM2, V=49152), so every
row stays inside its grammar for the whole run; rows are staggered so they sit at different
points of the document. Coverage: which of a set of JSON-schema features each library compiles.

    .venv/bin/python -m bench.studies.grammar_libs [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "W1"}, "active": True}

COVERAGE = {
    "enum/const": {"type": "object", "properties": {"c": {"enum": ["a", "b", 3]}, "k": {"const": "x"}},
                   "required": ["c", "k"]},
    "anyOf/oneOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
                   "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
                       "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "min/max number": {"type": "number", "minimum": 0.5, "maximum": 10},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "type list": {"type": ["string", "null"]},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "uniqueItems (ignored ok)": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
}


def _token_stream(tok) -> list[int]:
    return tok.encode(json.dumps(INSTANCE), add_special_tokens=False)


def bench_xgrammar(tok, vocab: int, rows: int, stream: list[int]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    pos = [i % len(stream) for i in range(rows)]
    for m, p in zip(matchers, pos):
        for t in stream[:p]:
            assert m.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    single, par, steps = [], [], 0
    for step in range(len(stream)):
        live = [(m, p) for m, p in zip(matchers, pos) if p < len(stream)]
        if not live:
            break
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            if pos[i] < len(stream):
                m.fill_next_token_bitmask(bitmask, i)
        t1 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        t2 = time.perf_counter()
        for i, m in enumerate(matchers):
            if pos[i] < len(stream):
                assert m.accept_token(stream[pos[i]])
                pos[i] += 1
        t3 = time.perf_counter()
        single.append(t1 - t0 + t3 - t2)
        par.append(t2 - t1 + t3 - t2)
        steps += 1
    cov = {}
    for name, schema in COVERAGE.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
            cov[name] = True
        except Exception:  # noqa: BLE001
            cov[name] = False
    return {"compile_ms": compile_s * 1e3, "step_ms": np.median(single) * 1e3, "step_ms_par": np.median(par) * 1e3,
            "coverage": cov}


def bench_llguidance(tok, vocab: int, rows: int, stream: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
    compile_s = time.perf_counter() - t0  # lazy: the mask is built on the fly
    pos = [i % len(stream) for i in range(rows)]
    for m, p in zip(matchers, pos):
        for t in stream[:p]:
            assert m.consume_token(t), m.get_error()
    bitmask = lnp.allocate_token_bitmask(rows, vocab)
    ex = llguidance.LLExecutor(num_threads=2)
    single, par = [], []
    for _ in range(len(stream)):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            if pos[i] < len(stream):
                lnp.fill_next_token_bitmask(m, bitmask, i)
        t1 = time.perf_counter()
        lnp.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers) if pos[i] < len(stream)], bitmask)
        t2 = time.perf_counter()
        for i, m in enumerate(matchers):
            if pos[i] < len(stream):
                assert m.consume_token(stream[pos[i]]), m.get_error()
                pos[i] += 1
        t3 = time.perf_counter()
        single.append(t1 - t0 + t3 - t2)
        par.append(t2 - t1 + t3 - t2)
    cov = {}
    for name, schema in COVERAGE.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        cov[name] = not llguidance.LLMatcher(lltok, g).is_error()
    return {"compile_ms": compile_s * 1e3, "step_ms": np.median(single) * 1e3, "step_ms_par": np.median(par) * 1e3,
            "coverage": cov}


def bench_outlines_core(tok, vocab: int, rows: int, stream: list[int]) -> dict:
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # Byte-level BPE: the vocabulary wants token strings as the text they stand for.
    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256, 257, ...
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    dec = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(rest)}
    special = set(tok.all_special_ids)
    eos = tok.eos_token_id
    voc = Vocabulary(eos, {})
    for s, i in tok.get_vocab().items():
        if i in special or i >= vocab:
            continue
        try:
            voc.insert(bytes(dec[c] for c in s).decode("utf-8"), i)
        except (KeyError, UnicodeDecodeError):
            continue
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), voc)
    compile_s = time.perf_counter() - t0
    guides = [Guide(index) for _ in range(rows)]
    pos = [i % len(stream) for i in range(rows)]
    for g, p in zip(guides, pos):
        for t in stream[:p]:
            g.advance(t)
    width = (vocab + 31) // 32
    bitmask = np.zeros((rows, width), dtype=np.int32)
    steps = []
    for _ in range(len(stream)):
        t0 = time.perf_counter()
        for i, g in enumerate(guides):
            if pos[i] < len(stream):
                g.write_mask_into(bitmask[i].ctypes.data, width, 4)
                g.advance(stream[pos[i]])
                pos[i] += 1
        steps.append(time.perf_counter() - t0)
    cov = {}
    for name, schema in COVERAGE.items():
        try:
            Index(build_regex_from_schema(json.dumps(schema)), voc)
            cov[name] = True
        except Exception:  # noqa: BLE001
            cov[name] = False
    del outlines_core
    return {"compile_ms": compile_s * 1e3, "step_ms": np.median(steps) * 1e3, "step_ms_par": float("nan"),
            "coverage": cov}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    from serving.checkpoint.default_model import default_model_path
    from transformers import AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path))
    vocab = json.load(open(path / "config.json"))["vocab_size"]
    stream = _token_stream(tok)
    print(f"rows={args.rows} vocab={vocab} tokens per document={len(stream)}")
    results = {}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                     ("outlines-core", bench_outlines_core)):
        try:
            results[name] = fn(tok, vocab, args.rows, stream)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: failed: {type(exc).__name__}: {exc}")
            continue
        r = results[name]
        covered = sum(r["coverage"].values())
        print(f"{name:14s} compile {r['compile_ms']:8.1f} ms  step (1 thread) {r['step_ms']:6.2f} ms  "
              f"step (2 threads) {r['step_ms_par']:6.2f} ms  coverage {covered}/{len(COVERAGE)}  "
              f"missing: {[k for k, v in r['coverage'].items() if not v]}")


if __name__ == "__main__":
    main()
