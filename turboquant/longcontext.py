"""Long context over real code (Chapter 12, ``turboquant longctx``): a whole Python
package's source fills the context, then questions whose answers lie far back in it.

The source is this package's own (``package_source``): code no model was trained on, so an
answer must come from the context, not from memory — the standard library, which code
models have seen many times, would not test retrieval. A question names a function
defined in the context and asks for its signature, copied exactly
(``signature_questions``); the answer is right when the parameters the model writes,
whitespace aside, are the source's (``answer_matches``). The prompt ends with the name, not
with ``def name(``: a byte-pair tokenizer writes ``(x`` or ``(model`` as one token in the
source, so a prompt cut after ``(`` would ask the model to continue from a token boundary
the source never has (Qwen2.5-Coder then got the first parameter wrong in 19 of 20
questions through the exact cache, and the rest of the signature right). The context is prefilled once per
cache configuration and deep-copied for each question (``run_config``), which also
measures the cache's bytes, prefill and decode tokens/s and the process's peak memory
(``long_context_run`` runs each configuration in a process of its own, so that one
configuration's peak is not another's)."""
from __future__ import annotations

import ast
import copy
import hashlib
import platform
import re
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["package_source", "whole_files", "signature_questions", "answer_matches", "run_config",
           "long_context_run", "QUESTION", "HEADER"]

HEADER = "# file: {path}\n"
QUESTION = "\n\n# The signature of `{name}`, copied exactly from the code above:\ndef {name}"
_HEADER_RE = re.compile(r"(?m)^# file: (\S+)\n")


def package_source(root: Optional[Path] = None) -> tuple[str, list[dict]]:
    """This package's Python files (``root``: default the installed ``turboquant`` folder),
    sorted by path, without the ``__init__.py`` files (re-exports and package docstrings,
    few functions), each preceded by a ``# file: <path>`` line, joined by blank lines →
    (text, manifest [{"path", "sha256"}]), the manifest naming exactly what a run read."""
    root = Path(__file__).parent if root is None else Path(root)
    parts, manifest = [], []
    for path in sorted(p for p in root.rglob("*.py") if p.name != "__init__.py"):
        rel = path.relative_to(root.parent).as_posix()
        body = path.read_text()
        manifest.append({"path": rel, "sha256": hashlib.sha256(body.encode()).hexdigest()})
        parts.append(HEADER.format(path=rel) + body)
    return "\n\n".join(parts), manifest


def whole_files(text: str, tokenizer, context_tokens: int) -> str:
    """The longest prefix of ``text`` that fits in ``context_tokens`` tokens and ends just
    before a top-level statement (a ``def``, ``class``, decorator or ``# file:`` line at
    the start of a line): every file in it is whole or cut between top-level statements,
    so each still parses."""
    from .evaluation import encode_text
    ids = encode_text(tokenizer, text)
    if len(ids) < context_tokens:
        raise ValueError(f"the source has {len(ids):,} tokens, fewer than the {context_tokens:,} asked for")
    cut = tokenizer.decode(ids[:context_tokens])
    ends = [m.start() for m in re.finditer(r"\n+(?=def |class |async def |@|# file: )", cut)]
    if not ends:
        raise ValueError(f"{context_tokens:,} tokens do not hold one top-level statement")
    return cut[:ends[-1]]


def _params(body: str, node) -> Optional[str]:
    """The text between ``def name(`` and its matching ``)``."""
    seg = ast.get_source_segment(body, node)
    if seg is None:
        return None
    head, depth = seg[seg.index("(") + 1:], 1
    for i, ch in enumerate(head):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return head[:i]
    return None


def signature_questions(context: str, tokenizer, n: int, min_back: int, max_tokens: int = 32) -> list[dict]:
    """``n`` questions about functions defined in ``context`` (files with ``# file:``
    lines, ``whole_files``) at least ``min_back`` tokens before its end, spread evenly over
    that range, farthest first. A function qualifies when its name is defined once in the
    context, it takes a parameter besides ``self``/``cls`` (something to copy beyond the
    name) and its answer — the parameters and ``)`` — fits in ``max_tokens - 2`` tokens
    (the greedy answer's length). → [{"name", "params", "tokens_back", "file"}],
    deterministic."""
    from .evaluation import encode_text
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of questions must be an int >= 1, got {n!r}")
    heads = list(_HEADER_RE.finditer(context))
    if not heads:
        raise ValueError("the context has no '# file:' lines (use whole_files)")
    names = re.findall(r"(?m)^\s*(?:async\s+)?def\s+(\w+)\s*\(", context)
    defs = []
    for i, h in enumerate(heads):
        end = heads[i + 1].start() - 2 if i + 1 < len(heads) else len(context)
        body = context[h.end():end]
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue
        starts = [0]
        for line in body.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or names.count(node.name) != 1:
                continue
            a = node.args
            params = _params(body, node)
            named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if params is not None and (named or a.vararg or a.kwarg):
                defs.append({"name": node.name, "params": params, "file": h.group(1),
                             "offset": h.end() + starts[node.lineno - 1]})
    defs = [d for d in defs if len(encode_text(tokenizer, "(" + d["params"] + ")")) <= max_tokens - 2]
    for d in defs:
        d["tokens_back"] = len(encode_text(tokenizer, context[d["offset"]:]))
    far = sorted((d for d in defs if d["tokens_back"] >= min_back), key=lambda d: -d["tokens_back"])
    if len(far) < n:
        total = len(encode_text(tokenizer, context))
        raise ValueError(f"only {len(far)} functions qualify at least {min_back:,} tokens back in a context of "
                         f"{total:,} tokens; ask fewer questions, fewer tokens back or a longer context")
    pick = [far[round(i * (len(far) - 1) / (n - 1))] for i in range(n)] if n > 1 else far[:1]
    return [{k: d[k] for k in ("name", "params", "tokens_back", "file")} for d in pick]


def answer_matches(answer: str, params: str) -> bool:
    """Whether ``answer`` (what the model wrote after ``def name``) begins with ``(``, the
    parameters ``params`` and their closing parenthesis, whitespace aside."""
    want = "(" + re.sub(r"\s+", "", params)
    got = re.sub(r"\s+", "", answer)
    return got.startswith(want + ")") or (not want.endswith(",") and got.startswith(want + ",)"))


def _peak_rss() -> int:
    """The process's peak resident memory in bytes (Linux: ru_maxrss is in KiB)."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def run_config(model, tokenizer, name: str, context_ids: Sequence[int], questions: list[dict],
               max_tokens: int = 32, chunk: int = 512, decode_steps: int = 16, stats=None,
               progress: bool = False) -> dict:
    """One cache configuration (``suite.CONFIGS[name]``): prefill the context once, then each
    question from a deep copy of the filled cache (greedy, ``max_tokens``). → {"bits",
    "family", "prefill_tok_s", "decode_tok_s" (``decode_steps`` single-token steps after
    the context), "cache_nbytes" (the caches' bytes, allocation steps included),
    "fp16_nbytes" (an fp16 cache of the same tokens), "measured_bits" (per coordinate,
    ``memory.measured_bits``), "cache_tokens",
    "correct", "n", "answers": [{"name", "tokens_back", "answer", "ok"}], "peak_rss"}."""
    import mlx.core as mx

    from .attention import codes_attention
    from .evaluation import encode_text, fill_cache, fresh_cache, greedy
    from .memory import fp16_cache_bytes, geometry_from_model, measured_bits
    from .progress import progress as bar
    from .suite import CONFIGS
    cfg = CONFIGS[name]
    make = cfg.make_cache(model, stats)
    cache = fresh_cache(model, make)
    x = mx.array(list(context_ids))[None]
    with codes_attention(model):                  # as `turboquant generate` runs: attention from codes
        t0 = time.perf_counter()
        fill_cache(model, x, cache, chunk)
        prefill_s = time.perf_counter() - t0
        nbytes, fp16 = sum(c.nbytes for c in cache), fp16_cache_bytes(model, cache)
        bits = measured_bits(model, cache)
        probe = copy.deepcopy(cache)
        t0 = time.perf_counter()
        for t in range(decode_steps):
            mx.eval(model(mx.array([[int(context_ids[-1 - t])]]), cache=probe))
        decode_s = time.perf_counter() - t0
        del probe
        answers = []
        for q in bar(questions, len(questions), f"{name}: questions", progress):
            ids = encode_text(tokenizer, QUESTION.format(name=q["name"]))
            out = tokenizer.decode(greedy(model, mx.array(ids)[None], copy.deepcopy(cache), max_tokens, chunk))
            answers.append({"name": q["name"], "tokens_back": q["tokens_back"], "answer": out,
                            "ok": answer_matches(out, q["params"])})
    return {"family": cfg.family, "bits": cfg.bits(geometry_from_model(model).head_dim),
            "prefill_tok_s": len(context_ids) / prefill_s, "decode_tok_s": decode_steps / decode_s,
            "cache_nbytes": nbytes, "fp16_nbytes": fp16, "measured_bits": bits, "cache_tokens": len(context_ids),
            "correct": sum(a["ok"] for a in answers),
            "n": len(answers), "answers": answers, "peak_rss": _peak_rss()}


def _orphan_watch(parent: int) -> None:
    """Exit this process when its parent is gone (killed by a signal that skipped its
    cleanup): a 7 GB child must not run on alone."""
    import os
    while os.getppid() == parent:
        time.sleep(5)
    os._exit(1)


def _child(conn, model_name, name, context_ids, questions, kw):
    import os
    import threading

    import turboquant  # noqa: F401  (the fast BLAS before mlx)
    from .models import load
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    try:
        model, tok = load(model_name)
        conn.send(("ok", run_config(model, tok, name, context_ids, questions, **kw)))
    except BaseException as e:                              # reported to the parent, by name
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def long_context_run(model_name: str, names: Sequence[str], context_tokens: int = 8192, questions: int = 20,
                     min_back: int = 2048, out: Optional[Path] = None, max_tokens: int = 32,
                     progress: bool = True) -> dict:
    """Every configuration of ``names`` on the same context (this package's source, the
    first ``context_tokens`` tokens in whole files) and questions (``signature_questions``),
    each in a fresh process (``multiprocessing`` spawn: its own peak memory). With ``out``,
    the JSON is written after every configuration and a second call keeps the rows it
    holds (same setup, else ``ValueError``); the setup names the source files and their
    SHA-256, so a run is never continued on changed code. → {"setup", "results": {name:
    run_config's row}}."""
    import multiprocessing as mp

    from .models import load_tokenizer
    from .records import read_record, write_record
    from .suite import CONFIGS
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"unknown configuration(s) {unknown or list(names)}; known: {sorted(CONFIGS)}")
    if any(CONFIGS[n].needs_calibration or getattr(CONFIGS[n], "needs_profile", False) for n in names):
        bad = [n for n in names if CONFIGS[n].needs_calibration or getattr(CONFIGS[n], "needs_profile", False)]
        raise ValueError(f"{', '.join(map(repr, bad))}: calibrated configurations are not run by longctx (no "
                         "calibration text is set up for it); uncalibrated ones are: fp32, budget, KIVI, TQ-mse, …")
    text, manifest = package_source()
    tok = load_tokenizer(model_name)                      # the weights load in each configuration's process
    context = whole_files(text, tok, context_tokens)
    from .evaluation import encode_text
    ids = encode_text(tok, context)
    qs = signature_questions(context, tok, questions, min_back, max_tokens)
    setup = {"model": model_name, "context_tokens": len(ids), "asked_tokens": context_tokens, "questions": qs,
             "max_tokens": max_tokens, "files": [m for m in manifest if f"# file: {m['path']}\n" in context]}
    record = {"setup": setup, "results": {}}
    old = read_record(out, "long-context run")
    if old is not None:
        if {k: v for k, v in old["setup"].items() if k in setup} != setup:
            raise ValueError(f"{out} holds a run with another setup (model, context, questions or source files "
                             "differ); remove it or choose another --out")
        record = old
    for name in names:
        if name in record["results"]:
            continue
        if progress:
            print(f"longctx: {name} on {len(ids):,} tokens, {len(qs)} questions", flush=True)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(child, model_name, name, ids, qs,
                                             {"max_tokens": max_tokens, "progress": progress}))
        p.start()
        child.close()
        try:
            status, row = "error", "its process ended without a result"
            while p.is_alive() or parent.poll():
                if parent.poll(5):
                    status, row = parent.recv()
                    break
        except EOFError:                                  # the process died without a word (e.g. killed for memory)
            pass
        finally:                                          # never leave a 7 GB process behind (e.g. on Ctrl-C)
            parent.close()
            if p.is_alive():
                p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(10)
        if status != "ok" and p.exitcode:
            row = f"{row} (exit code {p.exitcode})"
        if status != "ok":
            raise RuntimeError(f"longctx: {name} failed: {row}")
        record["results"][name] = row
        record["setup"].update(machine=platform.machine())
        if out is not None:
            write_record(out, record)
        if progress:
            print(f"longctx: {name}: {row['correct']}/{row['n']} right, {row['prefill_tok_s']:.1f} tok/s prefill, "
                  f"{row['decode_tok_s']:.2f} tok/s decode, cache {row['cache_nbytes'] / 1e6:,.1f} MB, "
                  f"peak {row['peak_rss'] / 1e9:.2f} GB", flush=True)
    return record
