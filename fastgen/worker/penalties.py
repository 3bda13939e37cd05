"""Presence, frequency and repetition penalties over token counts that live on the device.

A request with a penalty gets a slot: one row of `output_counts` (how often each token has been
generated) and one of `prompt_mask` (whether it is in the prompt). The row is filled from the
sequence's tokens when it first samples, then kept current by `count`, an in-place scatter of
each step's sampled tokens on the device: no per-step upload of the history, no host sync. A
slot is given back when its sequence finishes or is preempted (recomputed later, it is simply
filled again from its tokens), so at most one slot per running sequence is held.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from fastgen.sequence import Sequence


class TokenCounts:
    """output_counts: int32 [capacity, vocab]; prompt_mask: bool [capacity, vocab]; capacity
    grows (doubling, on the device) as more sequences hold a slot at once."""

    def __init__(self, vocab_size: int, device: torch.device, initial_capacity: int = 8):
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(initial_capacity, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(initial_capacity, vocab_size, dtype=torch.bool, device=device)
        self.slot_of: dict[int, int] = {}
        self.free_slots = list(range(initial_capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    def slots(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """The slots of `seqs` (int64 [len(seqs)] on the device), filling any they lack from
        their tokens (one upload for all of them)."""
        new = [seq for seq in seqs if seq.seq_id not in self.slot_of]
        if new:
            self._fill(new)
        slots = [self.slot_of[seq.seq_id] for seq in seqs]
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add one sampled token per slot (int64 [P] each, on the device), in place."""
        ones = torch.ones(slots.shape[0], dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            slot = self.slot_of.pop(seq_id, None)
            if slot is not None:
                self.free_slots.append(slot)

    def _fill(self, seqs: list[Sequence]) -> None:
        while len(self.free_slots) < len(seqs):
            self._grow()
        slots = [self.free_slots.pop() for _ in seqs]
        for seq, slot in zip(seqs, slots):
            self.slot_of[seq.seq_id] = slot
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for seq, slot in zip(seqs, slots):
            n = seq.num_prompt_tokens
            prompt_rows += [slot] * n
            prompt_ids += seq.token_ids[:n]
            output_rows += [slot] * (len(seq.token_ids) - n)
            output_ids += seq.token_ids[n:]
        rows = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.output_counts.index_fill_(0, rows, 0)
        self.prompt_mask.index_fill_(0, rows, False)
        index = torch.tensor([prompt_rows, prompt_ids], dtype=torch.int64).to(self.device, non_blocking=True)
        self.prompt_mask.index_put_((index[0], index[1]), torch.ones((), dtype=torch.bool, device=self.device))
        if output_ids:
            index = torch.tensor([output_rows, output_ids], dtype=torch.int64).to(self.device, non_blocking=True)
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.capacity
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.free_slots.extend(range(2 * old - 1, old - 1, -1))
