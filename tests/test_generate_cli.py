"""`turboquant generate` and `turboquant chat` on both installed models, a few tokens each."""
import io
import re

import pytest

from turboquant.cli import main
from turboquant.generate import cache_options, chat, new_cache
from turboquant.models import load


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_generate_streams_and_reports(model, capsys, tmp_path):
    path = tmp_path / "c.safetensors"
    assert main(["generate", "--model", model, "--prompt", "The capital of France is", "--max-tokens", "4",
                 "--save-cache", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and "tok/s" in out and "fp16 would hold" in out
    assert path.is_file()
    held = int(re.search(r"for (\d+) tokens", out).group(1))
    assert main(["generate", "--model", model, "--prompt", " Also", "--max-tokens", "2",
                 "--load-cache", str(path)]) == 0
    assert int(re.search(r"for (\d+) tokens", capsys.readouterr().out).group(1)) > held   # continued
    with pytest.raises(SystemExit):                                        # the file exists
        main(["generate", "--model", model, "--prompt", "x", "--save-cache", str(path)])
    assert "--overwrite" in capsys.readouterr().err


def test_bad_options_are_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--bits", "4", "--key-bits", "3"])
    assert "contradict" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                                    # a usage error, before any work
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert e.value.code == 2 and "argument --model:" in capsys.readouterr().err
    path = tmp_path / "s.safetensors"
    assert main(["generate", "--prompt", "x", "--max-tokens", "1", "--save-cache", str(path)]) == 0
    assert main(["generate", "--model", "gemma3-270m", "--prompt", "x", "--load-cache", str(path)]) == 1
    assert "30 layers, the model has 18" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--load-cache", str(path), "--key-bits", "3"])
    assert "own codecs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="contradict"):
        cache_options(bits=4.25, codec='{"codec": "identity"}')
    for bad in ("4", "[1]", '{"codec": "identity", "x": "' + "y" * 300 + '"}'):
        with pytest.raises((ValueError, TypeError)):
            cache_options(codec=bad)
    # every bad cache option is a usage error (exit 2) named on one line, before or after the model loads
    for opts, said in ((["--codec", '{"codec": "identity", "x": 1}'], "the config has unknown field(s) 'x'"),
                       (["--codec", '{"codec": "turboquant_mse"}'], "the config lacks 'bits'"),
                       (["--codec", '{"codec": "turboquant_mse", "bits": "4"}'], "bits"),
                       (["--key-bits", "9"], "must be <= 8"), (["--key-bits", "0"], "must be >= 1"),
                       (["--bits", "0.5"], "argument --bits: no measured configuration fits 0.5 bits"),
                       (["--bits", "0.5", "--profile"],
                        "argument --profile: the profile of smollm2-135m has no configuration within 0.5"),
                       (["--codec", '{"codec": "centered"}'], "the config lacks 'inner'"),
                       (["--profile", "--max-kv-size", "64"],
                        "argument --profile: the profile's configuration at 4.25 bits codes keys before RoPE, which "
                        "this cache cannot hold: --max-kv-size makes every layer a sliding window")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "x", "--max-tokens", "1", *opts])
        assert e.value.code == 2 and said in capsys.readouterr().err, opts


def test_codec_option_takes_wrappers(capsys):
    """--codec sets the head size where the codec takes it: a Centered wrapper's inner codec."""
    centered = '{"codec": "centered", "inner": {"codec": "turboquant_mse", "bits": 4}}'
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "2", "--codec", centered]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "x larger" in out     # 8 tokens, all held exactly while the mean is fitted
    opts = cache_options(codec=centered)
    assert opts["key_codec"](64).config()["inner"] == {**opts["key_codec"](64).inner.config(), "dim": 64}


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_chat_keeps_one_cache_and_prefills_only_the_new_turn(name):
    model, tok = load(name)
    assert cache_options() == {"max_kv_size": None, "bits": 4.25}      # the CLI's default cache
    cache = new_cache(model, cache_options(key_bits=4))                # plain 4-bit TurboQuant_mse
    turns = iter(["What is the capital of France?", "And of Italy?", ""])
    out = io.StringIO()
    offsets = []

    def read(prompt):
        offsets.append(cache[0].offset)
        return next(turns)

    msgs = chat(model, tok, cache, 8, read=read, out=out)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    first_prompt = len(tok.apply_chat_template(msgs[:1], add_generation_prompt=True))
    (p1, d1), (p2, d2) = [tuple(map(int, m)) for m in
                          re.findall(r"\[prefill (\d+) tokens .*? decode (\d+) tokens", out.getvalue())]
    # every generated token is in the cache once (mlx-lm runs a token before yielding it)
    assert offsets == [0, p1 + d1 + 1, p1 + d1 + 1 + p2 + d2 + 1] and p1 == first_prompt
    assert p2 < offsets[1] + p2                   # only the new turn went through the model
    # the first answer is what mlx-lm's own generation gives through the same cache and the same
    # attention from codes (the 135M model's greedy answer itself flips between "The capital of
    # France is Paris." and "L'Étoile …" with the rotation seed, at 4 and at 5 bits, and with
    # decoded instead of codes attention: one code flipped by rounding — not a property to pin)
    from mlx_lm import generate

    from turboquant.attention import codes_attention
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
    with codes_attention(model):
        alone = generate(model, tok, prompt, max_tokens=8, prompt_cache=new_cache(model, cache_options(key_bits=4)))
    assert msgs[1]["content"].strip() == alone.strip()


def test_a_refused_turned_mean_names_its_flag(monkeypatch, capsys):
    """--turned-mean on a model that does not allow it (here: made to refuse) is a usage error
    naming the flag and the reason; without the flag the same model gets the centred rule."""
    from turboquant import prompt_cache
    monkeypatch.setattr(prompt_cache, "turned_mean_refusal", lambda model, max_kv_size=None: "no nn.RoPE here")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--max-tokens", "1", "--turned-mean"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --turned-mean: the turned key mean needs RoPE positions in order: " \
        "no nn.RoPE here" in err and "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--max-tokens", "1"]) == 0
