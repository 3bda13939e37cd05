"""A step's host-to-device inputs in one transfer.

Uploading each input buffer on its own costs a copy launch apiece (input ids, positions, slot
mapping, context lengths, block tables; a prefill adds query offsets and logits rows). The
transfers are small, so each is mostly launch latency on the device and an API call on the host.
`PackedUpload` packs a step's pieces back to back into one pinned host buffer, sends that in one
copy, and hands out device views into its twin.

Where a piece lands depends only on the sizes of the pieces before it, so a decode step of R rows
always gets the same device addresses: what a CUDA graph captured at R rows reads. Pieces whose
size varies between steps of one graph (a verify step's sequences' block tables) go last.
"""

from __future__ import annotations

import numpy as np
import torch

# Each piece starts at a multiple of this many bytes (int64 needs 8; 16 keeps vector loads aligned).
ALIGN = 16
# Device views kept for this many distinct layouts (decode and verify steps have a few sizes; a
# prefill's token count varies); past it the memo starts again. A layout's views sit at the same
# addresses either way.
MAX_LAYOUTS = 512


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class PackedUpload:
    """capacity_bytes: room for the largest step's pieces, each rounded up to ALIGN (`room_for`).
    On CUDA the host side is pinned (the copy is asynchronous: the caller must not overwrite it
    before the copy ran, see `StepInputBuilder.wait_for_previous_upload`); elsewhere the 'device'
    side is a second host buffer, which is how CPU tests check the packing."""

    def __init__(self, capacity_bytes: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(capacity_bytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        self.device_bytes = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        # (dtype, shape) of each piece -> (host numpy views, device views, bytes used)
        self._layouts: dict[tuple, tuple[list[np.ndarray], list[torch.Tensor], int]] = {}

    @staticmethod
    def room_for(max_pieces: list[torch.Tensor]) -> int:
        """Bytes for steps whose pieces are at most these tensors (one per piece, largest size)."""
        return sum(_aligned(t.numel() * t.element_size()) for t in max_pieces)

    def _layout(self, pieces: list[np.ndarray]):
        key = tuple((p.dtype.str, p.shape) for p in pieces)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            host_views, device_views, at = [], [], 0
            for piece in pieces:
                nbytes = piece.nbytes
                if at + nbytes > self.host_np.size:
                    raise ValueError(f"a step's inputs need more than the packed upload's {self.host_np.size} bytes")
                host_views.append(self.host_np[at : at + nbytes].view(piece.dtype).reshape(piece.shape))
                dtype = torch.from_numpy(piece[:0]).dtype
                device_views.append(self.device_bytes[at : at + nbytes].view(dtype).view(piece.shape))
                at += _aligned(nbytes)
            layout = self._layouts[key] = (host_views, device_views, at)
        return layout

    def send(self, pieces: list[np.ndarray]) -> list[torch.Tensor]:
        """Pack host arrays (C-contiguous) and copy them to the device in one transfer; their
        device views, in order."""
        host_views, device_views, used = self._layout(pieces)
        for view, piece in zip(host_views, pieces):
            np.copyto(view, piece, casting="no")
        self.device_bytes[:used].copy_(self.host[:used], non_blocking=True)
        return device_views
