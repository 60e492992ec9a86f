"""``turboquant serve`` (issue #31): mlx-lm's server on compressed caches, started on a free
loopback port and stopped by the test; answers equal the same cache run in-process."""
import json
import threading
import urllib.error
import urllib.request

import pytest
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from turboquant import TurboQuantKVCache, TurboQuantRotatingKVCache, make_prompt_cache
from turboquant.attention import codes_attention
from turboquant.cli import main as cli
from turboquant.models import load
from turboquant.prerope import TurnedMeanCache
from turboquant.serve import batchable, install_caches

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Name three prime numbers and explain why they are prime."]
N_TOKENS = 8


@pytest.fixture(scope="module")
def smol():
    return load("smollm2-135m")


def test_install_caches_makes_mlx_lm_build_turboquant_caches(smol):
    model, _ = smol
    try:
        install_caches(model, bits=4.25, turned_mean=False)   # the centred rule
        cache = mlx_make_prompt_cache(model)          # what mlx-lm's generate, batch generator and server call
        assert all(type(c) is TurboQuantKVCache for c in cache) and batchable(cache)
        assert cache[0].sink_tokens == 1
        install_caches(model, bits=3.25, turned_mean=False)   # again: replaces the options, no recursion
        assert mlx_make_prompt_cache(model)[0].key_codec.config()["inner"]["bits"] == 3
        with pytest.raises(ValueError, match="bits"):
            install_caches(model, bits=0.5)           # bad options fail at once, the installed ones stay
        assert mlx_make_prompt_cache(model)[0].key_codec.config()["inner"]["bits"] == 3
        install_caches(model, bits=3.25)              # the default: the key mean before RoPE, batchable too
        cache = mlx_make_prompt_cache(model)
        assert all(type(c) is TurnedMeanCache for c in cache) and batchable(cache)
        assert cache[0].inner.key_codec.config()["bits"] == 3
    finally:
        model.__dict__.pop("make_cache", None)
    assert not any(isinstance(c, TurboQuantKVCache) for c in mlx_make_prompt_cache(model))


def test_install_caches_keeps_the_sliding_layers():
    model, _ = load("gemma3-270m")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cache = install_caches(model, bits=4.25, turned_mean=False)
        kinds = [type(c) for c in cache]
        assert kinds.count(TurboQuantRotatingKVCache) == 15 and kinds.count(TurboQuantKVCache) == 3
        assert all(c.max_size == 512 and c.keep == 0 for c in cache if isinstance(c, TurboQuantRotatingKVCache))
        assert batchable(cache)
        turned = install_caches(model, bits=4.25)     # the default turns the global layers' mean only
        assert [type(c) for c in turned] == [TurnedMeanCache if k is TurboQuantKVCache else k for k in kinds]
        assert batchable(turned)
        # make_prompt_cache still reads the model's own layout: max_kv_size rings (keep=4) are not batched
        capped = make_prompt_cache(model, bits=4.25, max_kv_size=64)
    assert [type(c) for c in capped] == [TurboQuantRotatingKVCache] * 18 and not batchable(capped)


def test_wrong_arguments_are_refused(capsys):
    for argv, said in ((["--max-kv-size", "64"], "--max-kv-size"), (["--bits", "4.25", "--key-bits", "4"], "contradict"),
                       (["--port", "0"], "--port"), (["--mlx-options", "'unclosed"], "--mlx-options")):
        with pytest.raises(SystemExit):
            cli(["serve", *argv])
        assert said in capsys.readouterr().err
    for opt in ("--kv-bits 4", "--kv-b 4", "--mod x", "--draft y"):   # also as abbreviations mlx-lm accepts
        with pytest.raises(SystemExit):
            cli(["serve", "--mlx-options", opt])
        err = capsys.readouterr().err
        assert "is not an option of turboquant serve" in err and "on http://" not in err


def _post(port: int, body, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module", params=[False, None], ids=["centred", "default"])
def server(request):
    """``turboquant serve --bits 4.25`` (the default: the key mean turned with each position) and
    with ``--no-turned-mean`` (the centred rule) on a free loopback port, started and stopped as
    the load test does it (``loadtest.start_server``); yields (port, turned_mean)."""
    from turboquant.loadtest import start_server
    args = ("--bits", "4.25") + (("--no-turned-mean",) if request.param is False else ())
    srv = start_server("smollm2-135m", "turboquant", cache_args=args, max_tokens=N_TOKENS)
    try:
        yield srv.port, request.param
    finally:
        srv.stop()


def _expected(smol, question: str, turned_mean=None) -> str:
    """The answer alone, in-process, through the same cache (the server batches: see
    ``SHORTFALL`` in tests/test_batch.py for when batched and alone text may part)."""
    model, tok = smol
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    with codes_attention(model):                   # as the server computes it (--attention codes)
        return generate(model, tok, prompt, max_tokens=N_TOKENS, prompt_cache=make_prompt_cache(model, bits=4.25, turned_mean=turned_mean))


def test_served_answer_equals_the_same_cache_in_process(server, smol):
    server, turned = server
    status, body = _post(server, {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": N_TOKENS})
    assert status == 200
    answer = json.loads(body)["choices"][0]["message"]["content"]
    assert answer == _expected(smol, QUESTIONS[0], turned)


def test_concurrent_requests_are_batched_and_each_equals_its_own_run(server, smol):
    server, turned = server
    answers = {}

    def ask(q):
        answers[q] = json.loads(_post(server, {"messages": [{"role": "user", "content": q}],
                                               "max_tokens": N_TOKENS})[1])["choices"][0]["message"]["content"]
    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert answers == {q: _expected(smol, q, turned) for q in QUESTIONS}


def test_streaming_and_a_malformed_request(server, smol):
    server, turned = server
    status, body = _post(server, {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": N_TOKENS,
                                  "stream": True})
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert status == 200 and text == _expected(smol, QUESTIONS[1], turned)
    with pytest.raises(urllib.error.HTTPError) as bad:
        _post(server, b"{not json")
    assert bad.value.code == 400
    # the server keeps serving, and the conversation asked before is answered from its cache alike
    status, body = _post(server, {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": N_TOKENS})
    assert json.loads(body)["choices"][0]["message"]["content"] == _expected(smol, QUESTIONS[0], turned)
    assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_sizes_read_as_mlx_lm_reads_them():
    from turboquant.serve import size_in_bytes
    assert [size_in_bytes(t) for t in ("64MB", "1.5G", "123", "2 gb", "1.001G")] == [
        64_000_000, 1_500_000_000, 123, 2_000_000_000, 1_001_000_000]
    for bad in ("2XB", "-1MB", "MB", ""):
        with pytest.raises(ValueError, match="a size is"):
            size_in_bytes(bad)
