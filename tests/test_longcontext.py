"""The long-context run over this package's own source (issue #29, ``turboquant longctx``):
questions, the answer check, and a resumable run whose setup names the files it read."""
import json

import pytest

from turboquant.longcontext import (QUESTION, answer_matches, long_context_run, package_source,
                                    signature_questions, whole_files)
from turboquant.models import load


@pytest.fixture(scope="module")
def smol():
    return load("smollm2-135m")


def test_answers_match_the_parameters_whitespace_aside():
    assert answer_matches("( a,\n   b: int = 2) -> None:", "a, b: int = 2")
    assert answer_matches("(a, b=2,) ->", "a, b=2")                       # a trailing comma is allowed
    assert not answer_matches("(a, b=3)", "a, b=2")
    assert not answer_matches("(a, b=2, c)", "a, b=2")                    # more parameters is wrong
    assert not answer_matches("(a, b=2", "a, b=2")                        # never closed
    assert not answer_matches("a, b=2)", "a, b=2")                        # the answer opens the parenthesis


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b"])
def test_the_question_ends_on_a_token_boundary_the_source_has(name):
    """Qwen's tokenizer writes the source's ``def f(x`` with the token ``(x``: a prompt ending
    in ``(`` would start the answer mid-token. The prompt ends with the name, where both
    tokenizers have a boundary in the source too."""
    from turboquant.models import load_tokenizer
    tok = load_tokenizer(name)
    src, q = tok.encode("def repeat_kv(x: int)"), tok.encode(QUESTION.format(name="repeat_kv"))
    k = next(k for k in range(len(src)) if tok.decode(src[:k]) == "def repeat_kv")   # a boundary after the name
    assert q[-(k - 1):] == src[1:k]
    assert name != "qwen2.5-coder-1.5b" or tok.decode([src[k]]) == "(x"               # the reason


def test_the_context_is_cut_between_statements_and_the_questions_are_far_back(smol):
    import ast
    import re
    _, tok = smol
    text, manifest = package_source()
    assert all(len(m["sha256"]) == 64 and not m["path"].endswith("__init__.py") for m in manifest)
    ctx = whole_files(text, tok, 2048)
    bodies = re.split(r"(?m)^# file: \S+\n", ctx)[1:]
    for body in bodies:
        ast.parse(body)                                                    # every file, whole or cut, parses
    qs = signature_questions(ctx, tok, 3, 512)
    assert qs == signature_questions(ctx, tok, 3, 512)                    # deterministic
    assert [q["tokens_back"] for q in qs] == sorted((q["tokens_back"] for q in qs), reverse=True)
    assert all(q["tokens_back"] >= 512 for q in qs)
    for q in qs:                                                           # the source really says so
        assert f"def {q['name']}({q['params']})" in ctx and ctx.count(f"def {q['name']}(") == 1
        assert QUESTION.format(name=q["name"]).endswith(f"def {q['name']}")
    with pytest.raises(ValueError, match="ask fewer"):
        signature_questions(ctx, tok, 1000, 512)
    with pytest.raises(ValueError, match="fewer than"):
        whole_files("def f(a, b):\n    return a\n", tok, 2048)
    from turboquant.evaluation import encode_text
    short = signature_questions(ctx, tok, 1, 512, max_tokens=16)          # answers must fit the greedy budget
    assert all(len(encode_text(tok, "(" + q["params"] + ")")) <= 14 for q in short)


def test_a_run_records_each_configuration_resumes_and_refuses_another_setup(tmp_path, monkeypatch, smol):
    out = tmp_path / "lc.json"
    kw = dict(context_tokens=512, questions=1, min_back=64, out=out, max_tokens=16, progress=False)
    first = long_context_run("smollm2-135m", ["fp32"], **kw)
    row = first["results"]["fp32"]
    assert json.loads(out.read_text()) == first
    assert row["n"] == 1 and row["cache_tokens"] == first["setup"]["context_tokens"] <= 512
    assert row["cache_nbytes"] > 0 and row["prefill_tok_s"] > 0 and row["peak_rss"] > 0
    assert row["measured_bits"] >= 32 and row["fp16_nbytes"] < row["cache_nbytes"]      # fp32, steps of 256
    assert first["setup"]["files"] and all("sha256" in f for f in first["setup"]["files"])
    import multiprocessing
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("a recorded row was run again"))
    assert long_context_run("smollm2-135m", ["fp32"], **kw)["results"] == first["results"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="another setup"):
        long_context_run("smollm2-135m", ["fp32"], **{**kw, "max_tokens": 17})
    with pytest.raises(ValueError, match="unknown configuration"):
        long_context_run("smollm2-135m", ["nope"], **kw)


def test_load_tokenizer_is_the_tokenizer_load_returns(smol):
    from turboquant.models import load_tokenizer
    _, tok = smol
    alone = load_tokenizer("smollm2-135m")
    text = "def f(x):\n    return x ** 2  # 12345 <|im_end|>"
    assert alone.encode(text) == tok.encode(text) and alone.eos_token_ids == tok.eos_token_ids


def test_a_file_that_is_not_a_record_is_refused_and_kept(tmp_path):
    from turboquant.records import read_record, write_record
    f = tmp_path / "mine.json"
    f.write_text('{"my": "notes"}')
    with pytest.raises(ValueError, match="is not a long-context run record"):
        read_record(f, "long-context run")
    assert f.read_text() == '{"my": "notes"}'
    assert read_record(tmp_path / "absent.json", "x") is None
    write_record(tmp_path / "sub" / "r.json", {"setup": {}, "results": {"a": 1}})
    assert read_record(tmp_path / "sub" / "r.json", "x") == {"setup": {}, "results": {"a": 1}}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["r.json"]      # no temporary file left
    probe = tmp_path / "probe"
    probe.write_text("")                                  # the mode a plain open gives here
    assert (tmp_path / "sub" / "r.json").stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    (tmp_path / "odd.json").write_text('{"setup": [], "results": 1}')
    with pytest.raises(ValueError, match="not objects"):
        read_record(tmp_path / "odd.json", "x")
    (tmp_path / "sub" / "r.tmp").write_text("the user's own notes")
    write_record(tmp_path / "sub" / "r.json", {"setup": {}, "results": {}})
    assert (tmp_path / "sub" / "r.tmp").read_text() == "the user's own notes"


def test_a_configuration_whose_process_fails_is_reported_by_name(tmp_path):
    """The child loads the weights; a model folder whose weights are corrupt fails there, and
    the parent says which configuration failed and why (it does not hang or crash)."""
    import shutil

    from turboquant.models import load_tokenizer, model_dir
    load_tokenizer("smollm2-135m")                                          # converted once
    src, broken = model_dir("smollm2-135m"), tmp_path / "broken"
    broken.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="fp32 failed"):
        long_context_run(str(broken), ["fp32"], context_tokens=512, questions=1, min_back=64,
                         out=tmp_path / "lc.json", max_tokens=16, progress=False)
    assert not (tmp_path / "lc.json").exists()                             # nothing recorded for it
