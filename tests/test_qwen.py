"""The third real model, Qwen2.5-Coder-1.5B-Instruct (issue #29): joined from 22 wheels,
converted to float32, checked against a NumPy forward pass computed from the GGUF's own
tensors, and asked to write a function through the fp32 cache and through codes."""
import json

import mlx.core as mx
import numpy as np
import pytest

from turboquant import make_prompt_cache, memory
from turboquant.models import MODELS, load, model_dir, model_gguf

NAME = "qwen2.5-coder-1.5b"
REQUEST = "Write a Python function that returns the square of x."


@pytest.fixture(scope="module")
def qwen():
    return load(NAME)


@pytest.fixture(scope="module")
def reader():
    import gguf
    return gguf.GGUFReader(str(model_gguf(NAME)))


def _tensor(reader, name):
    from gguf.quants import dequantize
    t = next(t for t in reader.tensors if t.name == name)
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    return w.reshape([int(s) for s in reversed(t.shape)])


def _q4k_block(raw: np.ndarray) -> np.ndarray:
    """The 256 weights of one Q4_K super-block (144 bytes), decoded by hand from ggml's
    layout: fp16 d and dmin, twelve bytes of packed 6-bit scales and mins, 128 bytes of
    4-bit codes (two 32-weight halves per 64-weight group)."""
    d, dmin = raw[:4].view(np.float16).astype(np.float32)
    s, q = raw[4:16].astype(np.int32), raw[16:144]

    def scale_min(j):
        if j < 4:
            return s[j] & 63, s[j + 4] & 63
        return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    out = []
    for g in range(4):
        (sc1, m1), (sc2, m2) = scale_min(2 * g), scale_min(2 * g + 1)
        codes = q[32 * g:32 * g + 32]
        out += [d * sc1 * (codes & 15) - dmin * m1, d * sc2 * (codes >> 4) - dmin * m2]
    return np.concatenate(out)


def test_the_joined_gguf_is_the_pinned_file(reader):
    path = model_gguf(NAME)
    assert path.stat().st_size == MODELS[NAME]["bytes"]
    assert reader.fields["general.architecture"].contents() == "qwen2"
    # the dequantizer the conversion uses agrees with a hand decoding of the first block
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type.name == "Q4_K"
    raw = np.asarray(t.data).reshape(-1)[:144]
    np.testing.assert_allclose(_tensor(reader, "blk.0.attn_q.weight").reshape(-1)[:256], _q4k_block(raw),
                               rtol=0, atol=1e-6)


def test_geometry_is_the_papers_head_size_and_the_preset(qwen):
    model, _ = qwen
    a = model.args
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
            a.vocab_size, a.rope_theta, a.tie_word_embeddings) == (28, 1536, 12, 2, 151936, 1e6, False)
    g, preset = memory.geometry_from_model(model), memory.PRESETS[NAME]
    assert (g.layers, g.n_kv_heads, g.head_dim) == (preset.layers, preset.n_kv_heads, preset.head_dim)
    assert (len(g.layers), g.n_kv_heads, g.head_dim) == (28, 2, 128)
    assert model.layers[0].self_attn.k_proj.bias.shape == (256,)


def _numpy_layers(reader, ids, n_layers):
    """Hidden states after ``n_layers`` decoder layers, in NumPy from the GGUF tensors
    (float64): RMSNorm, q/k/v with biases, rotate-half RoPE (base 1e6), 6 query heads per
    kv head, causal softmax, SwiGLU MLP; no mlx-lm code involved."""
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith("qwen2.")}
    heads, kv, eps = f["qwen2.attention.head_count"], f["qwen2.attention.head_count_kv"], \
        f["qwen2.attention.layer_norm_rms_epsilon"]
    x = _tensor(reader, "token_embd.weight")[ids].astype(np.float64)
    T, hidden = x.shape
    D = hidden // heads
    inv = f["qwen2.rope.freq_base"] ** (-np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(z):                               # z (H, T, D): halves rotated as pairs (i, i + D/2)
        a, b = z[..., :D // 2], z[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(z, w):
        return z / np.sqrt(np.mean(z * z, -1, keepdims=True) + eps) * w
    W = lambda n: _tensor(reader, n).astype(np.float64)  # noqa: E731
    for i in range(n_layers):
        p = f"blk.{i}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = (h @ W(p + "attn_q.weight").T + W(p + "attn_q.bias")).reshape(T, heads, D).transpose(1, 0, 2)
        k = (h @ W(p + "attn_k.weight").T + W(p + "attn_k.bias")).reshape(T, kv, D).transpose(1, 0, 2)
        v = (h @ W(p + "attn_v.weight").T + W(p + "attn_v.bias")).reshape(T, kv, D).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv, 0), np.repeat(v, heads // kv, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(1, 0, 2).reshape(T, hidden) @ W(p + "attn_output.weight").T
        h = norm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W(p + "ffn_up.weight").T)) @ W(p + "ffn_down.weight").T
    return x


def test_float32_layers_and_logits_match_a_numpy_forward_from_the_gguf(qwen, reader):
    model, tok = qwen
    ids = tok.encode("def square(x):\n    return")
    ref = _numpy_layers(reader, ids, 2)
    h = model.model.embed_tokens(mx.array(ids)[None])
    for layer in model.model.layers[:2]:
        h = layer(h, "causal", None)
    got = np.array(h[0], dtype=np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-4 * np.max(np.abs(ref)), np.max(np.abs(got - ref))
    # the output head is the file's own (untied) matrix, applied after the final norm
    logits = model(mx.array(ids)[None])[0, -1]
    hid = model.model(mx.array(ids)[None])[0, -1]                  # mlx-lm's final norm included
    mine = np.array(hid, dtype=np.float64) @ _tensor(reader, "output.weight").T.astype(np.float64)
    np.testing.assert_allclose(np.array(logits), mine, rtol=0, atol=1e-4 * np.abs(mine).max())


@pytest.mark.parametrize("bits", [None, 3.25])
def test_greedy_chat_writes_the_square_function(qwen, bits, monkeypatch):
    """What ``turboquant chat --model qwen2.5-coder-1.5b [--bits 3.25]`` runs: the fp32 cache,
    and attention computed from 3.25-bit codes (``attention_from_codes`` is called)."""
    import io

    from mlx_lm.models.cache import make_prompt_cache as fp32_cache

    from turboquant import attention
    from turboquant.generate import cache_options, chat, new_cache
    model, tok = qwen
    from_codes = []
    orig = attention.attention_from_codes
    monkeypatch.setattr(attention, "attention_from_codes", lambda *a, **k: from_codes.append(1) or orig(*a, **k))
    cache = fp32_cache(model) if bits is None else new_cache(model, cache_options(bits=bits))
    turns = iter([REQUEST, ""])
    msgs = chat(model, tok, cache, 64, read=lambda prompt: next(turns), out=io.StringIO(),
                system="Reply with the code only: no docstring, no explanation.")
    out = msgs[-1]["content"]
    assert "def " in out and any(s in out for s in ("x * x", "x ** 2", "x**2", "pow(x, 2)")), out
    assert bool(from_codes) == (bits is not None)


def test_the_tokenizer_round_trips_code_and_keeps_chat_tokens_whole(qwen):
    _, tok = qwen
    text = "class Foo:\n\tdef  bar(self, n=12345):\n        return f'{n:>8}' + \"ü\"\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == 151644
    assert tok.encode("12345") == [tok.encode(d)[0] for d in "12345"]          # digits one by one
    cfg = json.loads((model_dir(NAME) / "config.json").read_text())
    assert cfg["eos_token_id"][0] == 151645                                    # <|im_end|> ends a turn


def test_attention_from_codes_runs_through_the_cpu_kernels_at_d128_with_6_heads_per_kv_head(qwen, monkeypatch):
    """A decode step's attention over Qwen's own keys and values (layer 5, 4-bit codes), 12
    query heads on 2 kv heads of D = 128: the CPU kernels are called and give the mx path's
    output on the same codes. (End to end, logits differ more: the kernels' encode may round
    a coordinate on a threshold the other way, and 27 coded layers amplify it.)"""
    from turboquant import kernels
    from turboquant.attention import attention_from_codes
    from turboquant.codecs import TurboQuantMSE
    from turboquant.codes import CodeBuffer, CodesView
    from turboquant.evaluation import capture_qkv
    model, tok = qwen
    backend = kernels.active()
    if backend is None:
        pytest.skip(f"no kernel back-end here: {kernels.why()}")
    calls = []
    for name in ("attend", "scores", "values"):
        orig = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _f=orig, _n=name, **k: calls.append(_n) or _f(*a, **k))
    layer = capture_qkv(model, tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"))[5]
    q, k, v = layer["q"][:, :, -1:], layer["k"], layer["v"]
    assert q.shape[1] == 6 * k.shape[1] and k.shape[-1] == 128
    kc, vc = TurboQuantMSE(128, 4), TurboQuantMSE(128, 4, seed=1)
    with kernels.use(None):                                                  # the same codes for both
        keys = CodesView(kc, CodeBuffer(kc.encode(k).arrays), mx.float32)
        values = CodesView(vc, CodeBuffer(vc.encode(v).arrays), mx.float32)
    fast = attention_from_codes(q, keys, values, scale=layer["scale"])
    assert calls, "the CPU kernels were not called"
    with kernels.use(None):
        ref = attention_from_codes(q, keys, values, scale=layer["scale"])
    assert mx.abs(fast - ref).max().item() <= 1e-5 * mx.abs(ref).max().item()


def test_the_shipped_profile_is_this_models_calibrated_on_the_mixture_over_its_context(qwen):
    """#29: ``make_prompt_cache(model, bits=b, profile=True)`` finds Qwen's own profile (its
    signature is the converted model's), calibrated on the prose-and-code mixture and fitted
    for every position of the model's 32,768-token context; the text it was chosen on is not
    the text Chapter 12 reports on. (Fitting its coders takes minutes: the recorded runs
    measure them.)"""
    from turboquant.calibration import context_length, find_profile, fitted_positions
    from turboquant.data import CODE_MODULES, MIX_MODULES
    model, _ = qwen
    prof = find_profile(model)
    assert prof is not None and prof["model"] == NAME and prof["calibration"]["corpus"] == "mixture"
    assert fitted_positions(prof) == context_length(model) == 32768
    assert not set(MIX_MODULES) & set(CODE_MODULES)
    assert [e["budget"] for e in prof["budgets"]] == [2.25, 3.25, 4.25]
    assert all(e["bits"] <= e["budget"] for e in prof["budgets"])
