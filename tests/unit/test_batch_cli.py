"""`waferscale batches` output, from batch objects as the API returns them."""

from __future__ import annotations

from waferscale.batches_cli import format_batches, progress


def batch(status: str, total: int, completed: int, failed: int = 0, created_at: int = 1000) -> dict:
    counts = {"total": total, "completed": completed, "failed": failed}
    return {"id": f"batch_{status}", "status": status, "created_at": created_at, "request_counts": counts}


def test_progress_fills_with_finished_requests_failed_included():
    assert progress({"total": 8, "completed": 3, "failed": 1}, width=8) == "[####....]      4/8 (1 failed)"


def test_progress_before_validation_counted_the_lines():
    assert "counting" in progress({"total": 0, "completed": 0, "failed": 0})


def test_running_batches_get_a_bar_and_ended_ones_their_counts():
    text = format_batches([batch("in_progress", 10, 5), batch("completed", 4, 3, 1)], now=1000 + 3700)
    running, ended = text.splitlines()
    assert (
        running.startswith("batch_in_progress")
        and "[" in running
        and "5/10" in running
        and "1h ago" in running
    )
    assert ended.endswith("3 completed, 1 failed of 4") and "[" not in ended


def test_no_batches_says_so():
    assert format_batches([]) == "no batches"
