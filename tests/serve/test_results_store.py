"""/generate results are kept for a bounded time and count; unfinished ones are never dropped."""

from __future__ import annotations

from fastgen.outputs import RequestMetrics, RequestOutput
from fastgen.serve.results import ResultStore


def output(seq_id: str, finished: bool, reason: str | None = None) -> RequestOutput:
    return RequestOutput(seq_id, None, [1], "", [2], "", [2], finished, reason, RequestMetrics(0.0))


def test_only_the_newest_max_results_finished_results_are_kept():
    store = ResultStore(max_results=2, ttl_s=100)
    records = [store.start(str(i)) for i in range(4)]
    for record in records[:3]:
        store.update(record, output(record.seq_id, True, "length"))
    assert [store.get(str(i)) is not None for i in range(4)] == [False, True, True, True]  # 3 is unfinished


def test_finished_results_expire_after_the_ttl_and_aborts_say_so(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("fastgen.serve.results.time.monotonic", lambda: clock[0])
    store = ResultStore(max_results=10, ttl_s=5)
    record = store.start("a")
    store.update(record, output("a", False))
    assert store.get("a").status == "running"
    store.update(record, output("a", True, "abort"))
    assert store.get("a").status == "aborted"
    clock[0] += 6
    assert store.get("a") is None
