"""POST /generate (answered at once with the request's id) and GET /result/{seq_id} (its status,
and once finished its text, token ids and metrics). The request runs in a task of the server's
own, so it goes on after the POST has been answered."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from fastgen.serve.errors import RequestError
from fastgen.serve.protocol import GenerateRequest
from fastgen.serve.results import ResultRecord
from fastgen.serve.sampling import check_fields, sampling_params
from fastgen.serve.state import ServerState

router = APIRouter()
logger = logging.getLogger(__name__)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> dict:
    state: ServerState = request.app.state.server
    check_fields(body, "/generate")
    stream = await state.submit(body.prompt, sampling_params(body))
    record = state.results.start()

    async def follow() -> None:
        try:
            async for output in state.tracked(stream):
                state.results.update(record, output)
        except Exception:  # noqa: BLE001 - logged; the record keeps its last status
            logger.exception("following request %r failed", record.seq_id)

    task = asyncio.create_task(follow())
    state.background_tasks.add(task)
    task.add_done_callback(state.background_tasks.discard)
    return {"seq_id": record.seq_id}


@router.get("/result/{seq_id}")
async def result(seq_id: str, request: Request) -> dict:
    state: ServerState = request.app.state.server
    record: ResultRecord | None = state.results.get(seq_id)
    if record is None:
        raise RequestError(f"seq_id={seq_id!r} is unknown (never started, or its result has expired)",
                           param="seq_id", status=404, kind="not_found")
    return record.to_json()
