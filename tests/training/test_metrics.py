"""metrics.jsonl writing/truncation and the console reporter (bar on a terminal, lines off)."""

import io
import json

from linear_attention.training.metrics import MetricsWriter, Reporter, read_jsonl


def test_writer_appends_and_truncates_on_resume(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    writer = MetricsWriter(path, resume_step=0)
    for step in (1, 2, 3):
        writer.write({"step": step, "train/loss": 1.0 / step})
    writer.write({"step": 4, "train/loss": float("nan")})
    with open(path) as f:
        assert json.loads(f.readlines()[-1]) == {"step": 4, "train/loss": "nan"}
    # Resuming from the checkpoint at step 2 drops what the interrupted run logged after it.
    MetricsWriter(path, resume_step=2)
    assert read_jsonl(path) == [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.5}]


def test_reporter_log_lines_and_bar():
    out = io.StringIO()
    reporter = Reporter(10, stream=out, tty=False)
    reporter.record({"step": 5, "train/loss": 1.23456, "train/accuracy": 0.5, "lr": 1e-3})
    reporter.record({"step": 10, "eval/loss": 0.5, "eval/accuracy": 0.99})
    assert out.getvalue().splitlines() == [
        "step 5/10 | loss 1.2346 | acc 0.500 | lr 1.00e-03",
        "step 10/10 | eval loss 0.5000 | eval acc 0.9900",
    ]
    out = io.StringIO()
    reporter = Reporter(10, stream=out, tty=True)
    reporter.record({"step": 5, "train/loss": 1.0, "tokens_per_sec": 1234.0})
    reporter.record({"step": 10, "train/loss": 0.5, "eval/loss": 0.25})
    reporter.close()
    text = out.getvalue()
    # The bar is redrawn in place (carriage return); the eval result gets its own line.
    assert text.startswith("\r[###############---------------] 5/10")
    assert "loss 1.0000 | tok/s 1,234" in text
    assert "\neval at step 10: eval loss 0.2500\n" in text
    assert "\r[##############################] 10/10" in text and text.endswith("loss 0.5000\n")
