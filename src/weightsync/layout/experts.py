"""Where a fused mixture-of-experts tensor lands on one worker (pure: shapes and ids in, pieces out).

Trainers (transformers 5) hold each MoE layer's experts as two 3-D tensors: ``gate_up_proj``
[E, 2I, H] (gate rows first, then up) and ``down_proj`` [E, H, I]. vLLM's fused-MoE layer holds
``w13_weight`` [E_local, 2 I/tp, H] (this TP rank's gate slice, then its up slice) and
``w2_weight`` [E_local, H, I/tp]. Without expert parallelism every worker holds a TP slice of every
expert; with it (``enable_expert_parallel``) a worker holds some experts whole (tp 1 inside the
layer). Each run of experts that are consecutive on both sides is one block copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from .records import DestPiece
from .regions import Region

__all__ = ["W13", "W2", "expert_runs", "fused_expert_pieces", "fused_expert_shape"]

W13 = "w13"
"""``gate_up_proj`` [E, 2I, H] -> ``w13_weight``: two TP slices (gate, up) of dim 1."""
W2 = "w2"
"""``down_proj`` [E, H, I] -> ``w2_weight``: one TP slice of dim 2."""


def expert_runs(local_of: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(global start, local start, count)`` runs of ``(global id, local id)`` pairs that are
    consecutive on both sides (a linear expert placement is one run, round-robin one per expert)."""
    runs: list[tuple[int, int, int]] = []
    for g, l in sorted(local_of):
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == l:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, l, 1))
    return runs


def fused_expert_shape(kind: str, *, num_experts: int, param_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """The trainer tensor's global shape that a ``kind`` parameter of ``param_shape`` (one TP rank's,
    checkpoint layout) implies."""
    _, a, b = (int(n) for n in param_shape)
    return (num_experts, a * tp_size, b) if kind == W13 else (num_experts, a, b * tp_size)


def fused_expert_pieces(name: str, shape: Sequence[int], kind: str, param: str, param_shape: Sequence[int], *,
                        local_of: Sequence[tuple[int, int]], tp_rank: int, tp_size: int) -> list[DestPiece]:
    """The pieces of trainer tensor ``name`` (global ``shape``) this worker's ``param`` receives.

    ``local_of``: ``(global expert id, local slot)`` of every expert this worker holds. Raises
    ``ValueError`` naming ``name`` when the shapes do not fit (never truncates)."""
    if kind not in (W13, W2):
        raise ValueError(f"kind must be {W13!r} or {W2!r}, got {kind!r}")
    shape, pshape = tuple(int(n) for n in shape), tuple(int(n) for n in param_shape)
    if len(shape) != 3 or len(pshape) != 3:
        raise ValueError(f"parameter {name!r}: fused experts are 3-D [experts, rows, cols]; the trainer's "
                         f"shape is {shape}, vLLM's {param} {pshape}")
    expected = fused_expert_shape(kind, num_experts=shape[0], param_shape=pshape, tp_size=tp_size)
    local_ids = [l for _, l in local_of]
    if shape != expected or any(not 0 <= g < shape[0] for g, _ in local_of) or any(
            not 0 <= l < pshape[0] for l in local_ids) or len(set(local_ids)) != len(local_ids):
        raise ValueError(f"parameter {name!r}: the trainer's shape {shape} does not match vLLM's {param} "
                         f"{pshape} on this TP rank ({tp_rank} of {tp_size}, experts {sorted(local_of)}): "
                         f"vLLM's model expects {expected}")
    pieces = []
    for g, l, n in expert_runs(local_of):
        if kind == W13:
            half = pshape[1] // 2
            for k in range(2):  # gate rows, then up rows
                region = Region((g, k * shape[1] // 2 + tp_rank * half, 0), (n, half, shape[2]))
                pieces.append(DestPiece(name, region, param, (l, k * half, 0)))
        else:
            cols = pshape[2]
            pieces.append(DestPiece(name, Region((g, 0, tp_rank * cols), (n, shape[1], cols)), param, (l, 0, 0)))
    return pieces
