"""The bounded load test (issue #31): its pieces, and one small run of the compressed server
on loopback (the recorded comparison with mlx-lm's server is Chapter 7's, via the CLI)."""
import sys

import pytest

from turboquant.cli import main as cli
from turboquant.loadtest import quantile, conversation_texts, run_loadtest


def test_conversation_texts_are_distinct_passages():
    texts = conversation_texts(5, chars=300)
    assert len(set(texts)) == 5 and all(t.endswith("Summarize the text above in one sentence.") for t in texts)
    assert all(len(t) >= 300 for t in texts)
    with pytest.raises(ValueError, match="fewer than"):
        conversation_texts(10_000, chars=5000)


def testquantile_is_a_nearest_rank():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (quantile(xs, 0.5), quantile(xs, 0.95), quantile(xs, 0.0)) == (3.0, 5.0, 1.0)


def test_wrong_arguments(capsys):
    for argv in (["--conversations", "1"], ["--concurrency", "0"], ["--bits", "0"]):
        with pytest.raises(SystemExit):
            cli(["loadtest", *argv])
        assert "error" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kinds"):
        run_loadtest(kinds=("fp16",))


def test_a_small_run_serves_batches_keeps_and_survives_faults():
    r = run_loadtest("smollm2-135m", conversations=2, concurrency=(2,), budgets=("64MB",), max_tokens=2, chars=200,
                     kinds=("turboquant",))
    t = r["servers"]["turboquant"]["throughput"][0]
    assert t["failed"] == 0 and t["completion_tokens"] == 4 and t["requests_per_s"] > 0
    assert t["peak_rss_bytes"] > 0 if sys.platform.startswith("linux") else t["peak_rss_bytes"] is None
    c = r["servers"]["turboquant"]["capacity"][0]
    assert c["kept"] == 2 and c["second_turn_hits"] == 2          # 64 MB holds both short conversations
    f = r["faults"]
    assert f["malformed_status"] == 400 and f["oversize_status"] == 200 and f["still_serving"]
    assert f["disconnect_got_bytes"] > 0          # it left after the first streamed chunk
