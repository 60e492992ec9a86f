import pytest

from turboquant import cli


def test_memory_command_prints_the_bit_axon_plan(capsys):
    assert cli.main(["memory", "--preset", "bit-axon", "--context", "65536", "--bits", "16", "4",
                     "--side", "none"]) == 0
    out = capsys.readouterr().out
    assert "335.5" in out and "83.9" in out


def test_eval_lists_and_runs_a_small_comparison(tmp_path, capsys):
    import json
    assert cli.main(["eval", "--list"]) == 0
    assert "budget K4/V4" in capsys.readouterr().out
    out = tmp_path / "r.json"
    assert cli.main(["eval", "--configs", "TQ-mse 2", "--tokens", "512", "--agreement-tokens", "4",
                     "--fidelity-tokens", "64", "--needle-contexts", "256", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"fp32", "TQ-mse 2"}
    assert res["TQ-mse 2"]["ppl"] > res["fp32"]["ppl"] and res["TQ-mse 2"]["bits"] == 2.25
    assert len(res["TQ-mse 2"]["fidelity_cos"]) == 30 and "256" in res["TQ-mse 2"]["needle"]
    assert "TQ-mse 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown configuration"):
        cli.main(["eval", "--configs", "nope", "--tokens", "512"])


def test_model_command_checks_paris(capsys):
    assert cli.main(["model"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_kernels_command(capsys):
    from turboquant.kernels import emulate
    assert cli.main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "kernel back-end:" in out and "verified (cuda)" in out
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulation")
    assert cli.main(["kernels", "--emulated", "--bench", "--tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel back-end: cpp" in out and "self-check against the mx path: passed" in out
    assert out.count("turboquant_mse 4.12b") == 1 and "fibquant" in out
