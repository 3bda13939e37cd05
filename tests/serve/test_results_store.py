"""/generate results are kept for a bounded time and count; unfinished ones are never dropped."""

from __future__ import annotations

from fastgen.outputs import RequestMetrics, RequestOutput
from fastgen.serve.results import ResultStore


def output(seq_id: str, finished: bool, reason: str | None = None) -> RequestOutput:
    return RequestOutput(seq_id, None, [1], "", [2], "", [2], finished, reason, RequestMetrics(0.0))


def test_only_the_newest_max_results_finished_results_are_kept():
    store = ResultStore(max_results=2, ttl_s=100)
    records = [store.start() for _ in range(4)]
    for record in records[:3]:
        store.update(record, output(record.seq_id, True, "length"))
    assert [store.get(r.seq_id) is not None for r in records] == [False, True, True, True]  # 3 is unfinished


def test_finished_results_expire_after_the_ttl_and_aborts_say_so(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("fastgen.serve.results.time.monotonic", lambda: clock[0])
    store = ResultStore(max_results=10, ttl_s=5)
    record = store.start()
    store.update(record, output("0", False))
    assert store.get(record.seq_id).status == "running"
    store.update(record, output("0", True, "abort"))
    assert store.get(record.seq_id).status == "aborted"
    clock[0] += 6
    assert store.get(record.seq_id) is None


def test_result_ids_are_random_not_the_engines_counted_request_ids():
    """Whoever holds the server's key must not read other clients' results by counting."""
    store = ResultStore()
    ids = [store.start().seq_id for _ in range(3)]
    assert len(set(ids)) == 3
    assert all(i.startswith("gen-") and len(i) == 4 + 32 and int(i[4:], 16) >= 0 for i in ids)
    assert store.get("0") is None and store.get("1") is None
