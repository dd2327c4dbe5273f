"""Data planes: how the bytes of a sync move, behind one typed seam (:class:`~.base.DataPlane`).

One file per implementation: :mod:`.torch_group` (torch process groups: gloo on CPU, NCCL on CUDA).
An engine class names the plane its parties join (``data_plane``, a :class:`~.base.PlaneFactory`).
The control plane (the store: agreement, verdicts, failures) never shares a data plane's channel.
"""

from .base import DataPlane, Op, PlaneFactory, Work

__all__ = ["DataPlane", "Op", "PlaneFactory", "Work"]
