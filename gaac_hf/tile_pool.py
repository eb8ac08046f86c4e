"""`TilePool`: the storage of one GAAC layer of a `GAACCache`, apart from the block table that points into it.

Two storage classes (docs/format.md): the slot pool, uint8 `[n_slots, slot_bytes]`, and the raw pool, BF16
`[n_raw, 16, C]`, each with the per-tile group-mode counts (for `stats()`). Both grow by 1/128 of what they need
(at least 1 row; amortized, and what is allocated stays within about 1% of what is live, so the allocated saving
stays close to the resident one) and keep one scratch row past the high-water mark (tiles of the other storage class are scattered there). Tiles no
table entry references any more are found by a mark-and-sweep over the live entries and reused.
"""

from __future__ import annotations

import torch

from .format import BLOCK_TOKENS

# Growth headroom: a pool that must hold `n` rows gets `n + max(n // GROWTH_DIVISOR, MIN_GROWTH)`.
GROWTH_DIVISOR = 128
MIN_GROWTH = 1


def grow(t: torch.Tensor, needed: int, dim: int = 0, fill=0) -> torch.Tensor:
    """Return `t` with at least `needed` entries along `dim` (headroom of 1/128, at least 1; new entries = `fill`)."""
    have = t.shape[dim]
    if needed <= have:
        return t
    cap = needed + max(needed // GROWTH_DIVISOR, MIN_GROWTH)
    shape = list(t.shape)
    shape[dim] = cap
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, have).copy_(t)
    return out


class TilePool:
    """Slots and raw tiles of one layer: storage, mode counts, free lists, high-water marks, growth."""

    def __init__(self, slot_bytes: int, channels: int):
        self.slot_bytes, self.channels = slot_bytes, channels
        self.device = None
        self.slot_pool = self.raw_pool = self.slot_modes = self.raw_modes = None
        self.clear()

    def clear(self) -> None:
        """Forget every tile (capacity is kept for reuse)."""
        self.slot_high = self.raw_high = 0
        self.free_slots = self.free_raws = None
        self.dirty = False

    @property
    def high(self) -> int:
        return self.slot_high + self.raw_high

    def on(self, device) -> None:
        """Allocate (empty) on `device` unless already there; start with no tiles taken."""
        if self.slot_pool is None or self.slot_pool.device != torch.device(device):
            self.slot_pool = torch.zeros(0, self.slot_bytes, dtype=torch.uint8, device=device)
            self.slot_modes = torch.zeros(0, 3, dtype=torch.int32, device=device)
            self.raw_pool = torch.zeros(0, BLOCK_TOKENS, self.channels, dtype=torch.bfloat16, device=device)
            self.raw_modes = torch.zeros(0, 3, dtype=torch.int32, device=device)
        self.device = torch.device(device)
        self.clear()
        self.free_slots = torch.zeros(0, dtype=torch.long, device=device)
        self.free_raws = torch.zeros(0, dtype=torch.long, device=device)

    def collect(self, live: torch.Tensor) -> None:
        """Mark and sweep: every slot / raw tile below the high-water marks not in `live` (entries) is free."""
        live = live.reshape(-1).long()
        slot_live = torch.zeros(self.slot_high, dtype=torch.bool, device=self.device)
        slot_live[live[live >= 0]] = True
        raw_live = torch.zeros(self.raw_high, dtype=torch.bool, device=self.device)
        raw_live[-1 - live[live < 0]] = True
        self.free_slots = (~slot_live).nonzero().reshape(-1)
        self.free_raws = (~raw_live).nonzero().reshape(-1)
        self.dirty = False

    def take(self, kind: str, n: int, live) -> torch.Tensor:
        """Indices of `n` free entries of the slot (`kind="slot"`) or raw pool, growing it if needed; `live()`
        gives the live table entries if a sweep is due."""
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        free = self.free_slots if kind == "slot" else self.free_raws
        if free.numel() < n and self.dirty:
            self.collect(live())
            free = self.free_slots if kind == "slot" else self.free_raws
        reused, free = free[:n], free[n:]
        rest = n - reused.numel()
        high = self.slot_high if kind == "slot" else self.raw_high
        fresh = torch.arange(high, high + rest, dtype=torch.long, device=self.device)
        if kind == "slot":
            self.free_slots, self.slot_high = free, high + rest
            self.slot_pool = grow(self.slot_pool, self.slot_high + 1)  # + a scratch row
            self.slot_modes = grow(self.slot_modes, self.slot_high + 1)
        else:
            self.free_raws, self.raw_high = free, high + rest
            self.raw_pool = grow(self.raw_pool, self.raw_high + 1)
            self.raw_modes = grow(self.raw_modes, self.raw_high + 1)
        return torch.cat([reused, fresh])

    def store(self, slots: torch.Tensor, tiles: torch.Tensor, fits: torch.Tensor, counts: torch.Tensor,
              live) -> torch.Tensor:
        """Store encoded tiles (`slots` `[n, slot_bytes]`, BF16 `tiles` `[n, 16, C]`, `fits` `[n]`, mode counts
        `[n, 3]`): slots where they fit, raw tiles elsewhere. Returns their table entries, int32 `[n]`."""
        n = fits.numel()
        n_fit = int(fits.sum())  # the one host synchronization: it sizes the allocations
        entries = torch.empty(n, dtype=torch.int32, device=self.device)
        # every tile is scattered; the ones of the other storage class go to the scratch row past the high mark
        if n_fit:
            taken = self.take("slot", n_fit, live)
            dest = torch.where(fits, taken[(torch.cumsum(fits, 0) - 1).clamp(min=0)], self.slot_pool.shape[0] - 1)
            self.slot_pool.index_copy_(0, dest, slots)
            self.slot_modes.index_copy_(0, dest, counts)
            entries = torch.where(fits, dest.to(torch.int32), entries)
        if n_fit < n:
            taken = self.take("raw", n - n_fit, live)
            dest = torch.where(fits, self.raw_pool.shape[0] - 1, taken[(torch.cumsum(~fits, 0) - 1).clamp(min=0)])
            self.raw_pool.index_copy_(0, dest, tiles)
            self.raw_modes.index_copy_(0, dest, counts)
            entries = torch.where(fits, entries, (-1 - dest).to(torch.int32))
        return entries

    def to(self, device, non_blocking: bool = True) -> None:
        for name in ("slot_pool", "raw_pool", "slot_modes", "raw_modes", "free_slots", "free_raws"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=non_blocking))

    def allocated_bytes(self) -> dict:
        """Bytes the pools hold as allocated (capacity, not only the live tiles)."""
        if self.slot_pool is None:
            return {"slot_pool": 0, "raw_pool": 0}
        return {"slot_pool": self.slot_pool.numel() + self.slot_modes.numel() * 4,
                "raw_pool": self.raw_pool.numel() * 2 + self.raw_modes.numel() * 4}
