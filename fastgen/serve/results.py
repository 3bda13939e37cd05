"""What POST /generate starts and GET /result/{seq_id} reads: each request's status and, once
it has finished, its result.

Retention is bounded both ways: a finished result is kept for at most `ttl_s` seconds, and
at most `max_results` finished results are kept (oldest dropped first). Unfinished requests are
never dropped: their number is bounded by the engine's max_waiting_requests and max_num_seqs.

A result's id is 128 random bits, not the engine's request id: the engine counts its ids up
from 0, and anyone holding the server's key could read other clients' results by counting too.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from fastgen.outputs import RequestOutput


@dataclass
class ResultRecord:
    seq_id: str
    status: str = "waiting"  # waiting -> running (first output) -> finished | aborted
    output: RequestOutput | None = None
    finished_at: float | None = None  # time.monotonic()

    def to_json(self) -> dict:
        doc: dict = {"seq_id": self.seq_id, "status": self.status}
        out = self.output
        if out is None:
            return doc
        doc["num_output_tokens"] = sum(len(c.token_ids) for c in out.outputs)
        if self.finished_at is not None:
            m = out.metrics
            # text / token_ids / finish_reason: the first completion's; `outputs`: all n of them.
            doc.update(text=out.text, token_ids=out.token_ids, prompt_token_ids=out.prompt_token_ids,
                       finish_reason=out.finish_reason, error=out.error,
                       outputs=[{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                                 "finish_reason": c.finish_reason} for c in out.outputs],
                       metrics={"time_to_first_token_s": m.time_to_first_token,
                                "time_per_output_token_s": m.time_per_output_token,
                                "e2e_latency_s": m.e2e_latency, "num_cached_tokens": m.num_cached_tokens})
        return doc


@dataclass
class ResultStore:
    max_results: int = 1024
    ttl_s: float = 600.0
    _records: dict[str, ResultRecord] = field(default_factory=dict)
    _finished: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest first

    def start(self) -> ResultRecord:
        """A new record, under an id no client can guess."""
        self._expire()
        seq_id = "gen-" + secrets.token_hex(16)
        record = self._records[seq_id] = ResultRecord(seq_id)
        return record

    def update(self, record: ResultRecord, output: RequestOutput) -> None:
        record.output = output
        if not output.finished:
            record.status = "running"
            return
        record.status = "aborted" if output.finish_reason == "abort" else "finished"
        record.finished_at = time.monotonic()
        self._finished[record.seq_id] = None
        self._expire()

    def get(self, seq_id: str) -> ResultRecord | None:
        self._expire()
        return self._records.get(seq_id)

    def __len__(self) -> int:
        return len(self._records)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.ttl_s
        while self._finished:
            oldest = next(iter(self._finished))
            if len(self._finished) <= self.max_results and self._records[oldest].finished_at >= deadline:
                return
            del self._finished[oldest]
            del self._records[oldest]
