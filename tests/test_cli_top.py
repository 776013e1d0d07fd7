"""`moeray top --once` over a static metrics text (file and a local HTTP server; no cluster needed)."""
from __future__ import annotations

import http.server
import math
import threading

import pytest
from prometheus_client import generate_latest

from moeray.cli import main
from moeray.cli_top import histogram_quantile, metrics_url, parse_metrics
from router_service.metrics import Metrics
from tests.router_service.test_metrics import synthetic_stats


@pytest.fixture(scope="module")
def metrics_text() -> str:
    m = Metrics()
    m.refresh(synthetic_stats())
    obs = m.observer([0.0])
    obs.clock = iter([0.04, 0.06, 0.08, 0.5]).__next__
    obs.observe(0, [1], None)      # TTFT 40 ms
    obs.observe(0, [2], None)      # ITL 20 ms
    obs.observe(0, [3], None)      # ITL 20 ms
    obs.observe(0, [], "length")   # E2E 500 ms
    m.generated_tokens.labels("grpc").inc(2)  # the other front door's tokens count too
    return generate_latest(m.registry).decode()


def test_histogram_quantile():
    b = [(0.1, 2.0), (0.2, 4.0), (float("inf"), 4.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.1)
    assert histogram_quantile(0.75, b) == pytest.approx(0.15)
    assert histogram_quantile(0.25, b) == pytest.approx(0.05)
    assert histogram_quantile(1.0, [(0.1, 0.0), (float("inf"), 3.0)]) == 0.1  # falls into +Inf: the last bound
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]))
    with pytest.raises(ValueError, match="q=1.5"):
        histogram_quantile(1.5, b)


def test_parse_metrics(metrics_text):
    s = parse_metrics(metrics_text)
    assert sorted(s.layers) == [0, 2]
    assert s.layers[0] == {"tokens": 10, "expert_balancedness": 0.625, "rank_balancedness": pytest.approx(5 / 7),
                           "thrash_rate": 0.4, "expert_cache_hit_rate": 0.75, "prefetch_recall": 0.5}
    assert s.cluster["queue_depth"] == 2 and s.cluster["kv_blocks_used"] == 5 and s.cluster["kv_blocks_free"] == 15
    assert s.latency["TTFT"]["count"] == 1 and s.latency["ITL"]["count"] == 2 and s.latency["E2E"]["count"] == 1
    assert s.latency["ITL"]["mean"] == pytest.approx(0.02)
    assert 0.01 < s.latency["ITL"][0.5] <= 0.025  # inside the (10 ms, 25 ms] bucket
    assert s.generated_tokens == 5  # summed over the front doors


def check_screen(out: str) -> None:
    lines = out.splitlines()
    assert "queue 2 | running 2 | waiting 1 | in flight 4 | KV blocks used 5 free 15 / 20 | failed ranks 1" in out
    row0 = next(ln for ln in lines if ln.startswith("    0 |"))
    assert [c.strip() for c in row0.split("|")] == ["0", "10", "0.625", "0.714", "0.400", "0.750", "0.500"]
    row2 = next(ln for ln in lines if ln.startswith("    2 |"))
    assert [c.strip() for c in row2.split("|")] == ["2", "20", "1.000", "1.000", "0.200", "-", "0.250"]
    ttft = next(ln for ln in lines if ln.startswith("TTFT"))
    assert [c.strip() for c in ttft.split("|")][1:3] == ["1", "40.0"]  # count, mean ms
    assert next(ln for ln in lines if ln.startswith("E2E")).split("|")[2].strip() == "500.0"


def test_top_once_from_file(tmp_path, metrics_text, capsys):
    p = tmp_path / "metrics.txt"
    p.write_text(metrics_text)
    assert main(["top", "--file", str(p), "--once"]) == 0
    check_screen(capsys.readouterr().out)


def test_top_once_from_url(metrics_text, capsys):
    body = metrics_text.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            code = 200 if self.path == "/metrics" else 404
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            if code == 200:
                self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert main(["top", "--url", f"http://127.0.0.1:{srv.server_address[1]}", "--once"]) == 0
        check_screen(capsys.readouterr().out)
    finally:
        srv.shutdown()
        srv.server_close()


def test_top_once_unreachable(capsys):
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics" and metrics_url("http://h/metrics") == "http://h/metrics"
    assert main(["top", "--url", "http://127.0.0.1:9", "--once", "--timeout", "2"]) == 1
    assert "cannot read http://127.0.0.1:9/metrics" in capsys.readouterr().err
    assert main(["top", "--file", "x", "--once", "--interval", "0"]) == 2
