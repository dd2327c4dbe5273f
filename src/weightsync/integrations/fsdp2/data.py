"""Rollout samples, padding-free packing, and the data-parallel / micro-batch schedule.

A micro-batch is one row holding several samples back to back, with ``position_ids`` restarting at 0
for each; Hugging Face attention (sdpa, eager, flash) keeps the samples apart from those restarts.
Position ``t`` of the row predicts token ``t + 1``; the positions that predict a response token
carry the loss.

Every FSDP2 forward/backward is collective, so the schedule gives every rank the same number of
micro-batches (a rank short of samples runs a one-token row that carries no loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Sample", "PackedRow", "pack", "dp_schedule"]


@dataclass(frozen=True)
class Sample:
    """One rollout: a prompt, the sampled response, its reward and its GRPO group."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids (at least one)."""
    response_ids: tuple[int, ...]
    """Sampled response token ids (at least one); every one of them is trained on."""
    reward: float
    """Scalar reward of the response."""
    group: int
    """GRPO group: samples answering the same prompt share it; advantages are normalized within a group."""
    rollout_log_probs: tuple[float, ...] | None = None
    """The inference engine's log-prob of each response token (needed for ``old_log_probs="rollout"``)."""

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "response_ids"):
            ids = tuple(getattr(self, name))
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"Sample.{name} must be a non-empty sequence of token ids >= 0, got {ids[:8]!r}")
            object.__setattr__(self, name, ids)
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
            raise ValueError(f"Sample.reward must be a number, got {self.reward!r}")
        object.__setattr__(self, "reward", float(self.reward))
        if isinstance(self.group, bool) or not isinstance(self.group, int):
            raise ValueError(f"Sample.group must be an int, got {self.group!r}")
        if self.rollout_log_probs is not None:
            lps = tuple(float(x) for x in self.rollout_log_probs)
            if len(lps) != len(self.response_ids):
                raise ValueError(f"Sample.rollout_log_probs has {len(lps)} values for "
                                 f"{len(self.response_ids)} response tokens")
            object.__setattr__(self, "rollout_log_probs", lps)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PackedRow:
    """One padding-free micro-batch row."""

    input_ids: torch.Tensor
    """``[1, T]`` token ids of the samples back to back."""
    position_ids: torch.Tensor
    """``[1, T]`` positions, restarting at 0 for every sample."""
    targets: torch.Tensor
    """``[N]`` the response tokens, in row order (N = sum of response lengths)."""
    loss_positions: torch.Tensor
    """``[N]`` row positions whose logits predict ``targets``."""
    samples: tuple[int, ...]
    """Batch indices of the samples in the row, in order; empty for a filler row."""
    response_lengths: tuple[int, ...]
    """Response length of each sample in ``samples``."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(batch: Sequence[Sample], indices: Sequence[int], device: torch.device | str = "cpu") -> PackedRow:
    """Pack ``batch[i] for i in indices`` into one row; no indices = a one-token filler row without loss."""
    ids: list[int] = []
    pos: list[int] = []
    loss_pos: list[int] = []
    targets: list[int] = []
    for i in indices:
        s = batch[i]
        start, p = len(ids), len(s.prompt_ids)
        ids += s.prompt_ids + s.response_ids
        pos += range(len(s))
        loss_pos += range(start + p - 1, start + len(s) - 1)  # position t predicts token t + 1
        targets += s.response_ids
    if not ids:
        ids, pos = [0], [0]

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return PackedRow(input_ids=t(ids)[None], position_ids=t(pos)[None], targets=t(targets),
                     loss_positions=t(loss_pos), samples=tuple(indices),
                     response_lengths=tuple(len(batch[i].response_ids) for i in indices))


def _bins(indices: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing into rows of at most ``max_tokens``; each bin keeps batch order."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, u in enumerate(used):
            if u + lengths[i] <= max_tokens:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return [sorted(b) for b in bins]


def dp_schedule(lengths: Sequence[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Split a batch of samples (their token ``lengths``) over ``dp_size`` ranks and into packed rows.

    Returns ``schedule[rank][micro_batch] -> batch indices``. Samples go to the rank with the fewest
    tokens so far (longest first); each rank packs its samples first-fit into rows of at most
    ``max_tokens`` (a longer sample gets a row alone). Every rank gets the same number of rows: a rank
    with fewer splits its fullest multi-sample rows, then pads with empty rows (filler rows in
    ``pack``). Pure and deterministic, so every rank computes the same schedule.
    """
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if not lengths:
        raise ValueError("the batch is empty: there is nothing to schedule")
    load = [0] * dp_size
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        per_rank[r].append(i)
        load[r] += lengths[i]
    rows = [_bins(mine, lengths, max_tokens) for mine in per_rank]
    target = max(len(r) for r in rows)
    for mine in rows:
        while len(mine) < target:
            splittable = [b for b in mine if len(b) > 1]
            if not splittable:
                mine.append([])
                continue
            fullest = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -b[0]))
            at = mine.index(fullest)
            half = len(fullest) // 2
            mine[at: at + 1] = [fullest[:half], fullest[half:]]
    return rows
