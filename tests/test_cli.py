from turboquant import cli


def test_memory_command_prints_the_bit_axon_plan(capsys):
    assert cli.main(["memory", "--preset", "bit-axon", "--context", "65536", "--bits", "16", "4",
                     "--side", "none"]) == 0
    out = capsys.readouterr().out
    assert "335.5" in out and "83.9" in out
