"""Measuring tools of the GPU benchmark (`gpu_decode.py`): decode steps timed by wall clock and by
CUDA events, graph replays back to back, copy bandwidth and the weight-streaming floor, kernels
per step from torch.profiler, and transformers' generate on the same workload. Each works on
CPU too (events and profiler counts become None), so the CPU smoke test runs them all."""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import time
from collections import Counter

import torch

from fastgen import LLM, SamplingParams
from fastgen.graphs import padded_size
from fastgen.worker.step_clock import StepClock


def _cuda(device: str) -> bool:
    return device.startswith("cuda")


def summary_ms(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[(len(ordered) * 9) // 10]}


def start_decoding(llm: LLM, batch: int, context: int) -> list[str]:
    """Queue `batch` random prompts of `context` tokens and run them until all decode. Each may
    write up to max_model_len, so none finishes while it is measured (the caller aborts them):
    prompts admitted first decode through the others' prefill, so a budget counted in measured
    steps let them finish early and shrank the batch under measurement."""
    engine = llm.engine
    if batch > engine.config.max_num_seqs:
        # The first max_num_seqs would decode to max_model_len, thousands of steps, before the
        # rest were admitted: the loop below would all but never end.
        raise ValueError(f"batch {batch} is more than the engine's max_num_seqs {engine.config.max_num_seqs}: "
                         f"the sequences admitted first would run to max_model_len before the rest start")
    rng = random.Random(batch * 7919 + context)
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=engine.config.max_model_len - context, ignore_eos=True)
    low, high = (100, vocab - 300) if vocab > 1000 else (0, vocab)  # a real vocabulary's ends hold special tokens
    ids = [engine.add_request([rng.randrange(low, high) for _ in range(context)], params)
           for _ in range(batch)]
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # settle: first decode steps, any lazy allocation
        engine.step()
    return ids


def time_decode_steps(llm: LLM, batch: int, context: int, steps: int, device: str) -> dict:
    """engine.step() for `batch` decoding sequences: wall time (to a synchronize) and the GPU
    timeline between CUDA events recorded at the step's start and end; on graphs, also one
    graph replay's GPU time, replayed back to back (no host work in between). Then as many
    steps back to back, as a server runs them (overlap scheduling queues each step behind the
    previous one): their mean wall time and the device's wait for the host before each step
    (exposed host time, `fastgen.worker.step_clock`)."""
    engine = llm.engine
    ids = start_decoding(llm, batch, context)
    wall, gpu = [], []
    for _ in range(steps):
        if _cuda(device):
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        engine.step()
        if _cuda(device):
            end.record()
            torch.cuda.synchronize()
            gpu.append(begin.elapsed_time(end))
        wall.append((time.perf_counter() - start) * 1e3)
    row = {"batch_size": batch, "context_len": context, "steps": steps, "wall_ms": summary_ms(wall),
           "cuda_event_ms": summary_ms(gpu) if gpu else None}
    clock = engine.runner.step_clock = StepClock(torch.device(device))
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    row["back_to_back_ms"] = (time.perf_counter() - start) * 1e3 / steps
    times = clock.take()
    engine.runner.step_clock = None
    row["exposed_host_ms"] = summary_ms([t * 1e3 for t in times.idle]) if times.idle else None
    row["device_step_ms"] = summary_ms([t * 1e3 for t in times.busy]) if times.busy else None
    row["overlap_scheduling"] = engine.overlap
    still_running = len(engine.scheduler.running)
    graphs = engine.runner.graphs
    if graphs is not None and graphs.can_run(batch):
        size = padded_size(batch, graphs.sizes)
        row["padded_to"] = size
        # Only the graph the last step ran, over that step's inputs: another graph would read
        # what the last upload left at its addresses (another row count's layout).
        last = graphs.last_replayed_shape()
        row["graph_replay_gpu_ms"] = None
        if last != (size, False):
            row["graph_replay_skipped"] = f"the last step's inputs are not the {size}-row graph's (last: {last})"
        elif _cuda(device):
            row["graph_replay_gpu_ms"] = replay_ms(graphs.graphs[last])
    for request_id in ids:
        engine.abort(request_id)
    if still_running != batch:
        raise RuntimeError(f"{still_running} of the {batch} sequences were still running after the measured steps: "
                           "the figures would mix batch sizes")
    return row


def replay_ms(graph, repeats: int = 20) -> float:
    """GPU time of one replay of `graph` over the inputs it last saw (they rewrite the same
    cache slots with the same values)."""
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def copy_bandwidth(device: str, num_bytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if not _cuda(device):
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = begin.elapsed_time(end) / 1e3 / repeats
    del src, dst
    return 2 * num_bytes / seconds


def streaming_floor_ms(llm: LLM, context: int, bandwidth: float | None) -> dict | None:
    """The bs=1 decode step's floor: every weight and the sequence's K/V read once, at the
    measured copy bandwidth."""
    if bandwidth is None:
        return None
    model = llm.engine.runner.model
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # tied once
    kv = context * llm.config.model_config.kv_bytes_per_token(llm.config.dtype_name)
    total = sum(weights.values()) + kv
    return {"weight_bytes": sum(weights.values()), "kv_bytes": kv, "floor_ms": total / bandwidth * 1e3}


def _device_events(llm: LLM, batch: int, context: int, steps: int) -> list:
    """torch.profiler's device events over `steps` engine steps of `batch` decoding sequences."""
    from torch.profiler import ProfilerActivity, profile

    ids = start_decoding(llm, batch, context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    for request_id in ids:
        llm.engine.abort(request_id)
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernels_per_step(llm: LLM, batch: int, device: str, steps: int = 5) -> dict | None:
    """Device kernels one decode step launches (torch.profiler, memory copies excluded), with the
    most frequent names."""
    if not _cuda(device):
        return None
    names = Counter(e.name for e in _device_events(llm, batch, 256, steps) if not e.name.startswith(("Memcpy", "Memset")))
    layers = llm.config.model_config.num_layers
    total = sum(names.values()) / steps
    return {"batch_size": batch, "kernels_per_step": total, "kernels_per_layer": total / layers,
            "top": {name: n / steps for name, n in names.most_common(20)}}


def timeline_shares(spans: list[tuple[str, float, float]]) -> tuple[Counter, Counter]:
    """Per name, of (name, start, end) spans on one device's timeline: how far each span's end
    reaches past every earlier-starting span's (from its own start where that is later), and the
    idle time before its start (none ran). Under programmatic launch a kernel starts before the
    one in front ends and waits for it, so its own duration counts the wait twice over; the first
    counter does not: its values add up to the time some kernel ran, the second's to the time
    none did, so together they are where a step's time goes, kernel by kernel. One timeline for
    the device: the engine runs its steps on one stream (a second stream's spans would take the
    credit by start order). The idle time before a step's first span includes the host's gap
    between steps."""
    extends, idle_before = Counter(), Counter()
    frontier = None
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        if frontier is None:
            frontier = start
        idle_before[name] += max(0.0, start - frontier)
        extends[name] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return extends, idle_before


def kernel_times(llm: LLM, batch: int, context: int, device: str, steps: int = 10) -> dict | None:
    """GPU time per decode step by kernel name (torch.profiler), the largest first: where a step's
    device time goes. `us_per_step` is the kernels' own durations, which overlap under
    programmatic launch; `timeline` splits the steps' timeline between the kernels instead
    (`timeline_shares`): how long each kernel kept the step running past the ones before it, and
    how long the device sat idle before it."""
    if not _cuda(device):
        return None
    totals, counts = Counter(), Counter()
    spans = []
    for e in _device_events(llm, batch, context, steps):
        totals[e.name] += e.device_time_total
        counts[e.name] += 1
        spans.append((e.name, e.time_range.start, e.time_range.end))
    step_us = sum(totals.values()) / steps
    extends, idle_before = timeline_shares(spans)
    busy_us, idle_us = sum(extends.values()) / steps, sum(idle_before.values()) / steps
    return {"batch_size": batch, "context_len": context, "kernel_us_per_step": step_us,
            "top": [{"name": name[:120], "us_per_step": us / steps, "calls_per_step": counts[name] / steps,
                     "share": us / steps / step_us} for name, us in totals.most_common(15)],
            "timeline": {"busy_us_per_step": busy_us, "idle_us_per_step": idle_us,
                         "top": [{"name": name[:120], "extends_us_per_step": us / steps,
                                  "idle_before_us_per_step": idle_before[name] / steps,
                                  "calls_per_step": counts[name] / steps}
                                 for name, us in extends.most_common(15)]}}


def host_profile(llm: LLM, batch: int, context: int, steps: int = 5) -> dict:
    """Python functions by own time over `steps` engine steps (cProfile): where a step's host
    time goes."""
    import cProfile
    import pstats

    ids = start_decoding(llm, batch, context)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    for request_id in ids:
        llm.engine.abort(request_id)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:20]  # (cc, nc, tottime, cumtime, callers)
    return {"batch_size": batch, "context_len": context, "steps": steps,
            "top_own_time": [{"function": f"{path.rsplit('/', 2)[-1]}:{line}:{name}", "calls_per_step": nc / steps,
                              "own_ms_per_step": tt / steps * 1e3, "cum_ms_per_step": ct / steps * 1e3}
                             for (path, line, name), (cc, nc, tt, ct, _) in rows]}


def graph_vs_eager_logits(llm: LLM, batch: int, context: int) -> dict:
    """One decode step of `batch` sequences at `context` tokens: the logits its CUDA graph
    replay gives against an eager forward over the same uploaded inputs (the eager forward
    rewrites the same cache slots with the same values). Greedy disagreements are counted apart
    where the graph's top two logits are further apart than the largest difference seen."""
    runner = llm.engine.runner
    ids = start_decoding(llm, batch, context)
    seen: dict = {}
    execute = runner.execute

    def compare(layout, on_span_logits=None, feed_pending=None):
        def feed_and_keep(layout, inputs):
            if feed_pending is not None:  # the previous step's unread tokens (overlap scheduling)
                feed_pending(layout, inputs)
            seen["fed_ids"] = inputs.input_ids.clone()

        logits, greedy = execute(layout, on_span_logits, feed_and_keep)
        if not layout.is_prefill and greedy is not None and "graph" not in seen:
            rows = len(layout.sample_rows)
            seen["graph"] = logits[:rows].float().clone()
            inputs = runner.inputs.upload(layout)
            # The ids the graph was fed, not feed_pending again: the previous step's sampled ids
            # were the graph's own argmax buffer, which this replay has overwritten.
            inputs.input_ids.copy_(seen["fed_ids"])
            seen["eager"] = runner.forward_logits(inputs)[:rows].float()
        return logits, greedy

    runner.execute = compare
    try:
        llm.engine.step()
    finally:
        del runner.execute
    for request_id in ids:
        llm.engine.abort(request_id)
    if "graph" not in seen:
        return {"batch_size": batch, "context_len": context, "error": "the step ran no graph"}
    graph, eager = seen["graph"], seen["eager"]
    diff = (graph - eager).abs()
    top2 = graph.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    disagree = graph.argmax(-1) != eager.argmax(-1)
    return {"batch_size": batch, "context_len": context, "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(), "logit_std": graph.std().item(),
            "greedy_agreement": 1.0 - disagree.float().mean().item(),
            "clear_margin_disagreements": int((disagree & (margin > diff.max())).sum().item())}


def device_slug(name: str) -> str:
    """A device name as it goes into result file names: "NVIDIA H100 80GB HBM3" ->
    "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def driver_info() -> dict | None:
    """Driver version and clocks as nvidia-smi reports them (None without it)."""
    fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    values = done.stdout.strip().splitlines()[0].split(", ") if done.returncode == 0 and done.stdout.strip() else []
    return dict(zip(fields.split(","), values)) or None


def _sync(device: str) -> None:
    if _cuda(device):
        torch.cuda.synchronize()
