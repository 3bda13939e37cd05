"""Where the ranks of a tensor-parallel engine come from, and the process groups that join them.

Two ways to have N processes:

* spawn (one machine; the default): rank 0 is the process that builds the engine. It hosts a
  TCPStore on 127.0.0.1 (a free port the OS picks), spawns ranks 1..N-1 with
  torch.multiprocessing's spawn context (`fastgen.distributed.worker`) and hands them the port.
* torchrun (several machines): every process was started by torchrun, or by anything that sets
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and builds the same engine; rank 0
  keeps it, ranks > 0 serve as workers. The store is torch's own env:// store (hosted by the
  torchrun agent, or by rank 0).

Every rank then joins two groups: the device group (NCCL on CUDA, gloo on CPU; the default
group) that the model's all-reduces and all-gathers run on, with `distributed_timeout_s` for
start-up and `distributed_step_timeout_s` once it is done (`bound_step_collectives`); and the
step group (gloo, CPU tensors) that carries rank 0's step broadcasts: rank 0's sends wait at
most `distributed_step_timeout_s` for a worker to take them, while a worker's wait for the next
step has no practical deadline, since an engine may sit idle for any time between steps (a
worker watches rank 0 through the store instead: `watch_rank0`). The store also carries a
failing rank's error report (`report_failure` / `failure_report`) and, for spawned ranks, the
sign that each is up (`mark_joined` / `has_joined`), so that rank 0 never waits in a rendezvous
for a process that already died.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from fastgen.parallel.sharding import check_tensor_parallel

if TYPE_CHECKING:
    from fastgen.config import EngineConfig
    from fastgen.parallel.group import TensorParallelGroup

# A worker waits this long for the next step: in effect for ever (gloo needs a finite value).
STEP_WAIT = timedelta(days=365)
_PREFIX = "fastgen/tp/"


@dataclass(frozen=True)
class TorchrunEnv:
    """The environment torchrun gives each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun-style variables of this process, or None when RANK / WORLD_SIZE are unset."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    env = os.environ
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))


def check_world(config: EngineConfig) -> None:
    """ValueError when tensor_parallel_size cannot split this model or exceeds the devices."""
    n = config.tensor_parallel_size
    check_tensor_parallel(config.model_config, n)
    env = torchrun_env()
    if env is not None and env.world_size != n:
        raise ValueError(f"tensor_parallel_size={n} but WORLD_SIZE={env.world_size}: under torchrun, "
                         "start one process per rank")
    if not config.device.startswith("cuda"):
        return  # gloo on CPU: any number of ranks
    import torch

    count = torch.cuda.device_count()
    if env is not None:
        if env.local_rank >= count:
            raise ValueError(f"LOCAL_RANK={env.local_rank} but this machine has {count} CUDA device(s)")
        return
    first = int(config.device.split(":")[1])
    if first + n > count:
        raise ValueError(f"tensor_parallel_size={n} from device={config.device!r} needs CUDA devices "
                         f"{first}..{first + n - 1}, but this machine has {count}")


def config_for_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine's config with `device` set to rank `rank`'s own device."""
    if not config.device.startswith("cuda"):
        return config
    env = torchrun_env()
    index = env.local_rank if env is not None else int(config.device.split(":")[1]) + rank
    ranked = copy.copy(config)
    ranked.device = f"cuda:{index}"
    return ranked


def host_store(config: EngineConfig):
    """Rank 0's TCPStore for spawned workers, on a free local port (`store.port`)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, config.tensor_parallel_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=config.distributed_timeout_s))


def connect_store(config: EngineConfig, host: str, port: int, rank: int):
    """A client of the store at host:port; under torchrun, torch's env:// store, which rank 0
    hosts unless the torchrun agent does (TORCHELASTIC_USE_AGENT_STORE)."""
    import torch.distributed as dist

    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = rank == 0 and not agent_hosts and torchrun_env() is not None
    return dist.TCPStore(host, port, config.tensor_parallel_size, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=config.distributed_timeout_s))


@dataclass(frozen=True)
class ProcessGroups:
    """What one rank holds once joined: its TensorParallelGroup (the device group) and the step
    group."""

    tp: TensorParallelGroup
    step_group: object


def join_groups(config: EngineConfig, store, rank: int) -> ProcessGroups:
    """Initialise torch.distributed for this rank (every rank calls it with the same config)."""
    import torch.distributed as dist

    from fastgen.parallel.group import TensorParallelGroup

    check_no_process_group()
    size = config.tensor_parallel_size
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=_prefixed(store, "groups/"), rank=rank, world_size=size,
                            timeout=timedelta(seconds=config.distributed_timeout_s))
    global _own_group
    _own_group = True
    step_group = dist.new_group(backend="gloo", timeout=STEP_WAIT)
    return ProcessGroups(TensorParallelGroup(rank, size), step_group)


def check_no_process_group() -> None:
    """RuntimeError where torch.distributed is already initialized in this process (another
    tensor-parallel engine, or the application's own group): checked before any worker starts,
    and nothing of the group there is touched."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; a tensor-parallel "
                           "engine sets up its own process group (one such engine per process at a time)")


def bound_step_collectives(config: EngineConfig, step_group=None) -> None:
    """Once start-up is done: a step's collectives on the device group wait at most
    distributed_step_timeout_s for another rank, so a partition fails the engine in seconds
    rather than after start-up's allowance (gloo, on CPU; see below).

    Rank 0 passes its step group too. A gloo send is a rendezvous: its bytes leave only once the
    receiver has asked for them, so a step's payload (asked for after the header arrived) or a
    header the worker has not yet asked for waits on the far end. Unbounded, a host lost at that
    moment (or a stopped worker) hung rank 0 for good. Workers keep the step group's own wait
    (STEP_WAIT): an engine may sit idle for any time between steps, and a worker watches rank 0
    through the store instead (`watch_rank0`)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    bound = timedelta(seconds=config.distributed_step_timeout_s)
    if step_group is not None:
        _set_pg_timeout(bound, group=step_group)
    if not config.device.startswith("cuda"):
        # gloo raises when a collective waits too long. NCCL's watchdog would kill the process
        # instead, and a collective replayed inside a CUDA graph is not watched at all: on CUDA
        # the device group keeps start-up's timeout.
        _set_pg_timeout(bound)


# Whether this process's default group is the engine's (join_groups made it): only that one is
# destroyed when the engine stops, never a group the application set up.
_own_group = False


def leave_groups() -> None:
    import torch.distributed as dist

    global _own_group
    if _own_group and dist.is_initialized():
        dist.destroy_process_group()
    _own_group = False


def _prefixed(store, name: str = ""):
    """fastgen's own keys in a store that torch (or torchrun's agent) shares."""
    import torch.distributed as dist

    return dist.PrefixStore(_PREFIX + name, store)


def mark_joined(store, rank: int) -> None:
    """A spawned rank is up and about to join the groups (see `has_joined`)."""
    _prefixed(store).set(f"joined/{rank}", "1")


def has_joined(store, rank: int) -> bool:
    return _prefixed(store).check([f"joined/{rank}"])


def report_failure(store, rank: int, message: str) -> None:
    """Leave a rank's error where rank 0 looks for it (best effort: the store may be gone)."""
    try:
        _prefixed(store).set(f"failed/{rank}", message)
    except Exception:
        pass


def failure_report(store, rank: int) -> str | None:
    """The error rank `rank` reported, if any."""
    key, store = f"failed/{rank}", _prefixed(store)
    try:
        return store.get(key).decode(errors="replace") if store.check([key]) else None
    except Exception:
        return None


def watch_rank0(config: EngineConfig, host: str, port: int, rank: int, interval_s: float = 1.0) -> None:
    """A worker's watch on rank 0 through the store: when rank 0's store has not answered for
    distributed_step_timeout_s (rank 0's host is gone, or the network between them), the worker
    says so on stderr and exits, rather than wait for a step that will never come.

    Two daemon threads: one asks the store whether it is there, again and again, and notes when
    a request started and when requests began to fail; the other only reads those times. The
    deadline cannot live in the asking thread: a store request on a connection whose link went
    down blocks far longer than the store's timeout (the client waits on TCP's retransmissions),
    so a thread that asks and judges in turn never gets to judge. Only a request that has waited
    the whole timeout, or requests failing for that long, end the worker: a healthy worker
    between two requests never looks silent, however short the timeout."""
    import threading
    import time

    import torch.distributed as dist

    timeout = config.distributed_step_timeout_s
    interval_s = min(interval_s, timeout / 4)
    # Written by the asking thread, read by the judging one (single assignments: no lock needed).
    asking_since: list[float | None] = [None]  # when the request in flight started
    failing_since: list[float | None] = [None]  # the first failure since the last answer
    last_error: list[BaseException | None] = [None]

    def ask():
        store = None
        while True:
            asking_since[0] = time.monotonic()
            try:
                if store is None:
                    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                          timeout=timedelta(seconds=timeout))
                _prefixed(store).check(["alive"])
                failing_since[0] = last_error[0] = None
            except Exception as exc:  # noqa: BLE001 - unreachable, for whatever reason
                store, last_error[0] = None, exc
                if failing_since[0] is None:
                    failing_since[0] = asking_since[0]
            asking_since[0] = None
            time.sleep(interval_s)

    def judge():
        while True:
            now = time.monotonic()
            asking, failing = asking_since[0], failing_since[0]
            waited = max(now - asking if asking is not None else 0.0, now - failing if failing is not None else 0.0)
            if waited >= timeout:
                error = last_error[0]
                reason = f"the requests fail: {error}" if failing is not None and error is not None else \
                    "a request has had no answer"
                print(f"fastgen: tensor-parallel rank {rank} has had no answer from rank 0's store at "
                      f"{host}:{port} for {waited:.0f} s ({reason}); exiting", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(interval_s)

    threading.Thread(target=ask, name="fastgen-rank0-ask", daemon=True).start()
    threading.Thread(target=judge, name="fastgen-rank0-watch", daemon=True).start()
