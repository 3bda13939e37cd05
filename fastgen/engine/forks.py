"""Parallel sampling in the scheduler: n completions of one prompt, the prompt computed once.

The request's first sequence computes the prompt; the others wait here, by their parent's
seq_id, and fork from it in the step that completes its prompt: each shares the parent's full
blocks by reference count, gets its own copy of the parent's partial last block (the worker
copies it after that step's forward), and samples its first token from the parent's logits. A
child that finds no seat (`max_num_seqs`) or no free block for its copy goes to the queue
instead and is admitted like any request, its prompt's full blocks from the prefix cache. A
forked child is an ordinary sequence from then on: preempted, it is recomputed like any other.
"""

from __future__ import annotations

from fastgen.engine.block_manager import BlockManager
from fastgen.scheduler_output import Fork, SchedulerOutput
from fastgen.sequence import Sequence, SequenceStatus


class PendingForks:
    """Children waiting for their parent's prompt, by the parent's seq_id."""

    def __init__(self):
        self.by_parent: dict[int, list[Sequence]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_parent)

    def add(self, parent: Sequence, children: list[Sequence]) -> None:
        for child in children:
            child.status = SequenceStatus.PENDING_FORK
        self.by_parent[parent.seq_id] = list(children)

    def drop(self, child: Sequence) -> None:
        """A waiting child ended (aborted)."""
        for children in self.by_parent.values():
            if child in children:
                children.remove(child)

    def orphans(self, parent: Sequence) -> list[Sequence]:
        """The children of a parent that ended before forking (aborted, failed): they must start
        on their own."""
        return self.by_parent.pop(parent.seq_id, [])

    def fork(self, out: SchedulerOutput, running: list[Sequence], max_num_seqs: int,
             block_manager: BlockManager) -> tuple[tuple[Fork, ...], list[Sequence]]:
        """Fork the children of every parent in `out` whose prompt completes in this step, while
        seats and blocks allow; forked children join `running`. Returns the forks and the
        children left without room (for the queue)."""
        forks, no_room = [], []
        for i, parent in enumerate(out.seqs):
            if parent.seq_id not in self.by_parent or not out.samples(i):
                continue
            forked, copies = [], []
            for child in self.by_parent.pop(parent.seq_id):
                if len(running) < max_num_seqs and block_manager.can_fork(parent):
                    copy = block_manager.fork(parent, child)
                    copies += [copy] if copy else []
                    child.status = SequenceStatus.RUNNING
                    running.append(child)
                    forked.append(child)
                else:
                    no_room.append(child)
            if forked:
                forks.append(Fork(i, tuple(forked), tuple(copies)))
        return tuple(forks), no_room
