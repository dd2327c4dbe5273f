"""The speculative-decoding drafter (MTP layers, an EAGLE head) as destinations of the same sync.

vLLM keeps the drafter as a model of its own beside the target (``model_runner.drafter.model``), built
from the draft model's config, with the target's embedding / lm_head modules put in where it shares them
(``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` of vLLM's proposer). A sync that wrote only the
target would leave the drafter stale, and nothing would say so. So a worker engine whose vLLM engine has a
drafter syncs :class:`WithDrafter`: one module whose parameters are the target's, under their own
names, and the drafter's **own** ones under ``drafter.`` (a parameter vLLM shares with the target is the
target's: it is written once, under the target's name). Every transport then places, checks, applies,
rolls back and counts the drafter exactly as the target (same placers, same layerwise reload, same
coverage check), since each of them works on the engine's ``model``.

Names: the trainer sends the drafter's tensors under the names its checkpoint uses (DeepSeek's MTP layers
``model.layers.{N}.*`` with N >= the target's layer count, EAGLE's ``fc.weight``, ``layers.0.*``, ...), or
any of them as ``drafter.<checkpoint name>`` where it would clash with a target name. Which drafter
parameter each reaches, and as which shard of a fused layer, is read from the drafter's own
``load_weights`` (:meth:`WithDrafter.aliases`: it runs on meta tensors, one name at a time, with every
drafter parameter's loader swapped for a recorder, put back after; no data is read or written), not from
a per-model table; a name it hands to a loader transformed goes whole through that loader (a counted
fallback), one it hands to none is refused like any unknown name.

A trainer that trains no drafter declares it (``drafter="frozen"`` in its init info): the engine then
syncs the target alone and keeps the drafter as it is, on purpose. Without that declaration a sync that
writes none of the drafter's parameters is refused at init (:func:`require_drafter`), naming the drafter
and its parameters, on every trainer rank (``Refused``).

How the engine finds the drafter: vLLM 0.33 hands a weight-transfer engine the target model only (its
worker builds it in ``load_model``, after the drafter is loaded, and calls it from its own methods), so
:func:`find_drafter` asks the vLLM worker on the call stack (``get_draft_model()``); a process that builds
models itself (the CPU harness) says it with :func:`attach_drafter`. An engine whose vLLM config has a
draft model that cannot be found is refused at init, never synced silently without it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DRAFTER", "DRAFTER_MODES", "WithDrafter", "Alias", "attach_drafter", "find_drafter", "require_drafter",
           "NOT_FOUND", "drafter_bytes"]

DRAFTER = "drafter"
"""The prefix of the drafter's own parameters in :class:`WithDrafter` (and of a trainer name that says
"the drafter's" where it would clash with a target name)."""
DRAFTER_MODES = ("synced", "frozen")
"""``TrainerInitInfo.drafter``: ``"synced"`` (the default: the sync writes the drafter too) or ``"frozen"``."""
NOT_FOUND = "not found"
"""What :func:`find_drafter` returns for an engine configured with a draft model it cannot reach."""

_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def attach_drafter(target: torch.nn.Module, drafter: torch.nn.Module) -> None:
    """Say that ``drafter`` is the speculative-decoding drafter beside vLLM model ``target`` in this
    process (for code that builds vLLM's models itself; a vLLM worker is asked directly)."""
    _ATTACHED[target] = drafter


def find_drafter(target: torch.nn.Module, vllm_config: Any) -> torch.nn.Module | str | None:
    """The drafter beside ``target``: attached, or the one the vLLM worker calling this holds; None when
    the engine has none (no speculative config, or a method without a draft model, e.g. n-gram);
    :data:`NOT_FOUND` when its config has a draft model this cannot reach."""
    if target in _ATTACHED:
        return _ATTACHED[target]
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        get_draft = getattr(owner, "get_draft_model", None)
        if callable(get_draft) and getattr(owner, "get_model", lambda: None)() is target:
            drafter = get_draft()
            return drafter if isinstance(drafter, torch.nn.Module) else NOT_FOUND
        frame = frame.f_back  # type: ignore[assignment]
    return NOT_FOUND


@dataclass(frozen=True)
class Alias:
    """Where the drafter's ``load_weights`` hands one trainer tensor."""

    param: str  # the drafter parameter in WithDrafter's names (``drafter.<name>``), or the target's if shared
    shard: Any  # the shard id it passes the loader (``"q"``, ``0``, ...), None for a whole parameter
    whole: str | None = None  # why it cannot be placed as a block copy (handed over transformed), else None
    shared: bool = False  # the parameter is the target's (vLLM shares it): written once, under the target's name


class WithDrafter(torch.nn.Module):
    """The target model and its drafter as one module: the target's submodules and parameters under
    their own names, the drafter under ``drafter.``; ``named_parameters()`` lists a parameter the two
    share once, as the target's. ``load_weights`` hands each tensor to the model it belongs to."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", target)  # not a child: its children are ours
        self._parameters.update(target._parameters)
        self._buffers.update(target._buffers)
        self._modules.update(target._modules)
        self._modules[DRAFTER] = drafter
        self.packed_modules_mapping = dict(getattr(target, "packed_modules_mapping", {}) or {})
        self._aliases: dict[str, Alias | str] = {}  # trainer name -> its alias, or why the drafter takes none

    @property
    def drafter(self) -> torch.nn.Module:
        return self._modules[DRAFTER]  # type: ignore[return-value]

    @property
    def drafter_name(self) -> str:
        return type(self.drafter).__name__

    def own_parameters(self) -> list[str]:
        """The drafter's parameters that are its own (not shared with the target), by name here."""
        shared = {id(p) for p in self.target.parameters()}
        return [f"{DRAFTER}.{n}" for n, p in self.drafter.named_parameters() if id(p) not in shared]

    def aliases(self, metas: Sequence[tuple[str, str, Sequence[int]]]) -> dict[str, Alias | str]:
        """For each trainer tensor ``(name, dtype name, shape)`` the target has no place for: the drafter
        parameter its ``load_weights`` hands it to, or why none (probed once per name, then kept)."""
        todo = {n: (d, tuple(int(x) for x in s)) for n, d, s in metas if n not in self._aliases}
        if todo:
            self._aliases.update(_probe(self, todo))
        return {n: self._aliases[n] for n, _, _ in metas}

    def takes(self, name: str) -> bool:
        """Whether trainer tensor ``name`` was probed into one of the drafter's own parameters."""
        alias = self._aliases.get(name)
        return isinstance(alias, Alias) and not alias.shared

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each tensor to the drafter's ``load_weights`` (a name probed into it, without a ``drafter.``
        prefix) or the target's, in runs of consecutive tensors for the same model."""
        loaded: set[str] = set()
        run: list[tuple[str, torch.Tensor]] = []
        to_drafter = False
        for name, tensor in weights:
            alias = self._aliases.get(name)
            if isinstance(alias, Alias) and alias.shared:
                continue  # the drafter's copy of a target parameter: the target's own tensor writes it, once
            mine = isinstance(alias, Alias)
            if run and mine != to_drafter:
                loaded |= self._load(run, to_drafter)
                run = []
            to_drafter = mine
            run.append((name, tensor))
        if run:
            loaded |= self._load(run, to_drafter)
        return loaded

    def _load(self, run: list[tuple[str, torch.Tensor]], to_drafter: bool) -> set[str]:
        if not to_drafter:
            return set(self.target.load_weights(iter(run)) or ())  # type: ignore[operator]
        got = self.drafter.load_weights(iter((_checkpoint_name(n), t) for n, t in run))  # type: ignore[operator]
        return {f"{DRAFTER}.{n}" for n in (got or ())}


def _checkpoint_name(name: str) -> str:
    """A trainer name as the drafter's checkpoint has it (a ``drafter.`` prefix only disambiguates)."""
    return name[len(DRAFTER) + 1:] if name.startswith(DRAFTER + ".") else name


def require_drafter(model: torch.nn.Module, metas: Sequence[tuple[str, str, Sequence[int]]]) -> None:
    """At init, before any data moves: a sync to an engine with a drafter must write some of the drafter's
    own parameters (trainer tensors ``metas`` that reach them), or the trainer must declare the drafter
    frozen; ``ValueError`` naming the drafter and its parameters otherwise."""
    if not isinstance(model, WithDrafter):
        return
    target = _target_names(model)
    aliases = model.aliases([m for m in metas if m[0] not in target])
    own = set(model.own_parameters())
    if any(isinstance(a, Alias) and a.param in own for a in aliases.values()):
        return
    params = model.own_parameters()
    more = f" and {len(params) - 6} more" if len(params) > 6 else ""
    raise ValueError(f"vLLM's engine has a speculative-decoding drafter ({model.drafter_name}) whose parameters "
                     f"no tensor of this sync writes: {params[:6]}{more}"
                     "; a sync that leaves them would leave the drafter stale: send its tensors (under its "
                     "checkpoint's names, e.g. with DTensorModuleSource(..., drafter=module)), or declare "
                     "drafter='frozen' in the trainer's init info to keep the drafter as it is, on purpose")


def drafter_bytes(model: WithDrafter, dests: Any, metas: Sequence[tuple[str, str, Sequence[int]]]) -> int:
    """Bytes of the drafter's own parameters that destinations ``dests`` (``WorkerDestinations``) write on
    this worker: its placed shard regions, and the whole tensors that reach it through its loader."""
    dtypes = {n: getattr(torch, d) for n, d, _ in metas}
    mine = f"{DRAFTER}."
    placed = sum(dtypes[p.name].itemsize * _numel(p.region.sizes) for p in dests.pieces if p.param.startswith(mine))
    return placed + sum(f.nbytes for f in dests.fallbacks if model.takes(f.name))


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _target_names(model: WithDrafter) -> set[str]:
    """Names the target's parameters answer to, and the checkpoint names of its fused layers' parts."""
    names = {n for n, _ in model.target.named_parameters()}
    for fused, parts in model.packed_modules_mapping.items():
        for n in list(names):
            path, _, attr = n.rpartition(".")
            prefix, _, leaf = path.rpartition(".")
            if leaf == fused:
                names.update(f"{prefix}.{p}.{attr}" if prefix else f"{p}.{attr}" for p in parts)
    return names


# --- the probe: what the drafter's own load_weights does with each name -------------------------------

def _probe(model: WithDrafter, metas: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Alias | str]:
    """Each name to the drafter's ``load_weights`` alone, on a meta tensor, every drafter parameter's
    loader a recorder; the drafter's plain attributes (e.g. EAGLE's ``has_own_lm_head``) put back after."""
    by_id = {id(p): f"{DRAFTER}.{n}" for n, p in model.drafter.named_parameters()}  # first name: as WithDrafter's
    shared = {id(p): n for n, p in model.target.named_parameters()}
    calls: list[tuple[int, torch.Tensor, Any]] = []
    out: dict[str, Alias | str] = {}
    with _recorders(model.drafter, calls), _attributes_kept(model.drafter), _no_completeness_check():
        for name, (dtype, shape) in metas.items():
            calls.clear()
            probe = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            out[name] = _probe_one(model.drafter, name, probe, calls, by_id, shared)
    return out


def _probe_one(drafter: torch.nn.Module, name: str, probe: torch.Tensor, calls: list[tuple[int, torch.Tensor, Any]],
               by_id: dict[int, str], shared: dict[int, str]) -> Alias | str:
    try:
        drafter.load_weights(iter([(_checkpoint_name(name), probe)]))  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - a name its loader does not know (KeyError, ...)
        if not calls:
            return f"the drafter's load_weights refuses it ({type(e).__name__}: {e})"
    if not calls:
        return "the drafter's load_weights hands it to no parameter"
    pid, tensor, shard = calls[0]
    if pid in shared:
        return Alias(shared[pid], shard, shared=True)
    param = by_id[pid]
    if len(calls) > 1 or tensor is not probe:
        return Alias(param, shard, "the drafter's load_weights hands its loader another tensor than the trainer's, "
                                   "or a fused-MoE expert's (it goes whole, through that loader)")
    return Alias(param, shard)


@contextmanager
def _recorders(drafter: torch.nn.Module, calls: list[tuple[int, torch.Tensor, Any]]) -> Iterator[None]:
    saved = []
    for p in {id(p): p for _, p in drafter.named_parameters(remove_duplicate=False)}.values():
        saved.append((p, {k: p.__dict__[k] for k in ("weight_loader", "_weight_loader") if k in p.__dict__}))

        def record(param: torch.Tensor, weight: torch.Tensor, *args: Any, _id: int = id(p), **kw: Any) -> None:
            if "expert_id" in kw or len(args) > 1:  # a fused-MoE loader (name, shard, expert): whole, via the loader
                calls.extend([(_id, weight, None), (_id, weight, None)])
                return
            shard = next((x for x in (*args, kw.get("loaded_shard_id"), kw.get("shard_id")) if x is not None), None)
            calls.append((_id, weight, shard))
        p.weight_loader = record  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for p, attrs in saved:
            for k in ("weight_loader", "_weight_loader"):
                p.__dict__.pop(k, None)
            p.__dict__.update(attrs)


@contextmanager
def _attributes_kept(drafter: torch.nn.Module) -> Iterator[None]:
    kept = [(m, {k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str)) and not k.startswith("__")})
            for m in drafter.modules()]
    try:
        yield
    finally:
        for m, attrs in kept:
            m.__dict__.update(attrs)


@contextmanager
def _no_completeness_check() -> Iterator[None]:
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - a vLLM without MTP validation
        yield
        return
    with disable_mtp_completeness_check():
        yield
