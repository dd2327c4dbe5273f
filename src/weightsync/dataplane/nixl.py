"""The data plane over NIXL (UCX backend): one-sided READs, host memory on CPU, device memory on GPU.

Each party runs one NIXL agent. At construction every party puts its agent's metadata (bytes from
NIXL) on the sync group's store (sealed with it when a secret is set) and loads every peer's
(``add_remote_agent``): no collective group, no port of its own beyond UCX's.

A two-sided ``post(sends, recvs)`` is realised as a pull:

- a sender registers the storage of each tensor it sends (once per storage, cached: the shards,
  staging and live parameters are registered at the first sync and reused by every later one), and
  tells each receiver, in one NIXL notification per peer per ``post``, where each message is
  (``(tag, n)``: the n-th message with that tag from this party to that peer, counted alike at both
  ends) together with the partial agent metadata of any registration that peer has not seen yet;
- the receiver registers its recv tensors likewise and, whenever it is inside the plane (``post``,
  ``wait_all``), READs every announced message it has posted a receive for, one transfer request per
  peer per look (many messages each), with a notification that tells the sender they were read;
- a send's work completes when that notification arrives, a receive's when its READ is done.

Completion and buffer reuse, as NIXL defines them (nixl 1.5.1; ai-dynamo/nixl docs/BackendGuide.md,
"Transfer Operations" and "Notification Handling"; the UCX plugin's ``postXfer``/``checkXfer`` in
src/plugins/ucx/ucx_backend.cpp; the wheel's ``nixl_agent.transfer``/``check_xfer_state`` docstrings):

- a READ's ``DONE`` on the reader's side means every descriptor of the request completed: the bytes
  are in the reader's memory (a UCX get completes at its initiator when its data arrived);
- the owner of the read memory gets no completion of its own (one-sided): it learns that its bytes
  were taken only from a notification, and NIXL sends a request's ``notif_msg`` only "after all the
  descriptors within a transfer request are sent" (the UCX plugin posts it from ``checkXfer`` once the
  request's operations completed, and reports ``DONE`` only after that);
- NIXL locks no memory: "the user is in charge of not corrupting the memory"; a standalone
  ``send_notif`` has no ordering guarantee.

So a sender's work completes only on the READ-bound notification, and the executor reuses a staging
span, or lets a shard or a freed storage go, only after that work completed (``wait_all``): an owner
never overwrites or frees a region a READ may still be reading. Announcements carry ``(tag, n)`` keys,
so their order does not matter. After a failure the owner's ``abort`` deregisters while a READ may be
in flight: that READ fails (``ERR``) and the reader's sync fails with it, as it does anyway.

Descriptors travel as plain integers (address, length, device) in JSON, metadata as NIXL's own bytes
(base64 in the JSON): never NIXL's ``get_serialized_descs``, which pickles. Every wait is bounded by
``timeout_s`` and raises :class:`~weightsync.errors.DataPlaneError` at once when the control plane
reports a failure; ``abort`` releases every transfer handle, registration and remote agent and drops
the agent (its UCX workers and progress thread) so nothing is left behind. A registration whose
storage was freed is released before the next one is made. NIXL is imported on construction only.

A peer never forgets a descriptor it was told: partial metadata only adds to what an agent knows of
its peer, and NIXL removes a peer's descriptors only all at once (``remove_remote_agent``, which also
drops the connection). Its lookup assumes a peer's descriptors do not overlap: once a storage that
was announced is freed and memory overlapping it is registered (a sync's fresh tensors: cast shards,
delta payloads, FP8 blocks), a READ resolves against the stale descriptor, or against none
(``createXferReq``: NIXL_ERR_NOT_FOUND). So a sender remembers, per peer, the ranges it released after
announcing them, and sends a message whose storage overlaps one of them from a bounce buffer of its
own (registered once, kept while the plane lives, reused once its sends completed) instead.
"""

from __future__ import annotations

import base64
import bisect
import importlib
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch._C._distributed_c10d import PrefixStore, Store

from ..errors import DataPlaneError
from .base import Op, Work

__all__ = ["NixlPlane", "new_agent", "nixl_module"]

_CHECK_S = 0.005  # the longest pause between two looks at the control plane while waiting
_ANNOUNCE = b"S"  # a sender's notification: where its messages are
_READ = b"D"  # a receiver's notification: these messages were read
_BROADCAST_TAG = -1


class _DList(Protocol):
    """A NIXL descriptor list (opaque here)."""


class _Handle(Protocol):
    def release(self) -> None: ...


class _Agent(Protocol):
    """The part of ``nixl_agent``'s (untyped) API this module uses."""

    def get_agent_metadata(self) -> bytes: ...
    def get_partial_agent_metadata(self, descs: _DList, inc_conn_info: bool) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> _DList: ...
    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> _DList: ...
    def register_memory(self, descs: _DList) -> _DList: ...
    def deregister_memory(self, descs: _DList) -> None: ...
    def initialize_xfer(self, operation: str, local: _DList, remote: _DList, remote_agent: str,
                        notif_msg: bytes) -> _Handle: ...
    def transfer(self, handle: _Handle) -> str: ...
    def check_xfer_state(self, handle: _Handle) -> str: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...
    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None: ...


def nixl_module() -> str:
    """The NIXL wheel's module for this torch: ``nixl_cu13`` under a CUDA 13 torch when installed, else
    ``nixl_cu12`` (either runs on CPU); ``ImportError`` naming the extra when neither is installed."""
    cuda = torch.version.cuda or ""
    order = ["nixl_cu13", "nixl_cu12"] if cuda.startswith("13") else ["nixl_cu12", "nixl_cu13"]
    for name in order:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ImportError("the NIXL data plane needs the 'nixl' extra: pip install 'weightsync[nixl]' "
                      "(nixl-cu12, or nixl-cu13 under a CUDA 13 torch)")


def new_agent(name: str) -> _Agent:
    """A NIXL agent as this plane makes them (UCX, no progress thread); the benchmarks' raw transfers too."""
    mod = importlib.import_module(nixl_module())
    # No progress thread: NIXL's spins without pause (a whole core per agent, also while idle). This plane
    # drives progress itself, in every wait (``_progress``: notifications, READ states).
    agent: _Agent = mod.nixl_agent(name, mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    return agent


class _Weak:
    """A weak reference to a storage (torch's own, as ``torch.multiprocessing`` uses): it tells when the
    storage was freed without keeping it alive."""

    __slots__ = ("cdata", "_free")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata: int = storage._weak_ref()  # type: ignore[assignment]  # (an int at run time)
        self._free = torch.UntypedStorage._free_weak_ref  # kept: torch may be torn down first at exit

    def expired(self) -> bool:
        return bool(torch.UntypedStorage._expired(self.cdata))

    def __del__(self) -> None:
        self._free(self.cdata)  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class _Reg:
    """One registered storage: a weak reference to it (freed: released before registering anew), its
    registration list, its partial metadata, and the peers that were sent that metadata."""

    storage: _Weak
    descs: _DList
    metadata: bytes
    told: set[int] = field(default_factory=set)


class _Ranges:
    """Address ranges, merged: where a peer still holds descriptors this party released."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)  # the first range that ends at or after start
        j = bisect.bisect_right(self.starts, end)  # past the last range that starts at or before end
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.ends, start)  # the first range that ends after start
        return i < len(self.starts) and self.starts[i] < end


@dataclass(slots=True)
class _Chunk:
    """One bounce buffer: bytes handed out since its sends last all completed, and those in flight."""

    buf: torch.Tensor
    used: int = 0
    pending: int = 0


@dataclass(slots=True, eq=False)
class _Msg:
    """One posted message (a work): a send completes when its peer says it was read, a receive when
    its READ is done."""

    tensor: torch.Tensor
    peer: int
    key: tuple[int, int]  # (tag, n)
    send: bool
    done: bool = False
    chunk: _Chunk | None = None  # the bounce buffer it is sent from, if any

    def complete(self) -> None:
        self.done = True
        if self.chunk is not None:
            self.chunk.pending -= 1
            self.chunk = None


def _where(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def _encode(kind: bytes, body: object) -> bytes:
    return kind + json.dumps(body, separators=(",", ":")).encode()


class NixlPlane:
    """One party's end of a NIXL data plane (see the module docstring)."""

    def __init__(self, store: Store, rank: int, world_size: int, *, device: torch.device, name: str,
                 timeout_s: float, peer_error: Callable[[], str | None], group_name: str = "weightsync") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.name, self.timeout_s, self._peer_error = name, timeout_s, peer_error
        self._store = PrefixStore(f"{group_name}/nixl/", store)
        self._agent: _Agent | None = new_agent(f"{group_name}/{rank}/{uuid.uuid4().hex}")
        self._regs: dict[tuple[str, int, int, int], _Reg] = {}
        self._counts: defaultdict[tuple[int, int, bool], int] = defaultdict(int)  # (peer, tag, send) -> n
        self._announced: dict[tuple[int, int, int], tuple[int, int, int, str]] = {}  # (peer, tag, n) -> desc
        self._sends: dict[tuple[int, int, int], _Msg] = {}
        self._recvs: defaultdict[int, list[_Msg]] = defaultdict(list)  # peer -> receives not started
        self._reads: list[tuple[_Handle, list[_Msg]]] = []
        self._barriers = 0
        self._stale: defaultdict[int, _Ranges] = defaultdict(_Ranges)  # peer -> ranges it holds, released here
        self._chunks: list[_Chunk] = []
        self.registrations_made = 0
        """Storages registered so far (a test can see that later syncs reuse them)."""
        try:
            self._peers = self._exchange_metadata()
        except BaseException:
            self.abort()
            raise
        self._rank_of = {agent: r for r, agent in self._peers.items()}

    @property
    def ordered(self) -> bool:
        """Each message progresses on its own (no stream order)."""
        return False

    # ---- setup ---------------------------------------------------------------------------
    def _live(self) -> _Agent:
        if self._agent is None:
            raise DataPlaneError(f"{self.name}: the data plane was dropped after a failure (re-initialize)")
        return self._agent

    def _exchange_metadata(self) -> dict[int, str]:
        """Put this agent's metadata on the store, load every peer's: rank -> agent name."""
        agent = self._live()
        self._store.set(f"md/{self.rank}", base64.b64encode(agent.get_agent_metadata()).decode())
        peers: dict[int, str] = {}
        for r in range(self.world_size):
            if r != self.rank:
                md = base64.b64decode(self._take(f"md/{r}", "the agents' metadata exchange"), validate=True)
                loaded = agent.add_remote_agent(md)
                peers[r] = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        return peers

    def _take(self, key: str, what: str) -> bytes:
        """The store's value under ``key``, once set (bounded; raises at once on a reported failure)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not self._store.check([key]):
            self._check(deadline, what)
            time.sleep(pause)
            pause = min(2 * pause, _CHECK_S)
        return self._store.get(key)

    def _check(self, deadline: float, what: str) -> None:
        if (err := self._peer_error()) is not None:
            raise DataPlaneError(f"{what} failed on {self.name}: a party failed: {err}")
        if self._agent is None:
            raise DataPlaneError(f"{what} failed on {self.name}: the data plane was dropped")
        if time.monotonic() > deadline:
            raise DataPlaneError(f"{what} timed out after {self.timeout_s}s on {self.name}")

    # ---- registrations -------------------------------------------------------------------
    def _registered(self, t: torch.Tensor) -> _Reg:
        """The registration of ``t``'s storage, made on first use (a freed storage's are released first)."""
        storage = t.untyped_storage()
        mem, dev = _where(t)
        key = (mem, dev, storage.data_ptr(), storage.nbytes())
        reg = self._regs.get(key)
        if reg is not None and not reg.storage.expired():
            return reg
        agent = self._release_freed()
        descs = agent.get_reg_descs([(storage.data_ptr(), storage.nbytes(), dev, "")], mem)
        agent.register_memory(descs)
        reg = self._regs[key] = _Reg(_Weak(storage), descs, agent.get_partial_agent_metadata(descs, False))
        self.registrations_made += 1
        return reg

    def _release_freed(self) -> _Agent:
        """Release the registrations whose storage was freed; the peers told of one keep its range."""
        agent = self._live()
        for k in [k for k, r in self._regs.items() if r.storage.expired()]:
            reg = self._regs.pop(k)
            agent.deregister_memory(reg.descs)
            for peer in reg.told:
                self._stale[peer].add(k[2], k[2] + k[3])
        return agent

    def _bounced(self, t: torch.Tensor, peer: int) -> tuple[torch.Tensor, _Chunk | None]:
        """``t``, or a copy of its bytes in a bounce buffer where ``peer`` holds a stale descriptor
        overlapping ``t``'s storage (see the module docstring)."""
        storage = t.untyped_storage()
        reg = self._regs.get((*_where(t), storage.data_ptr(), storage.nbytes()))
        if reg is None or reg.storage.expired():  # a new storage: a freed one it may overlap is released first
            self._release_freed()
        if not t.nbytes or not self._stale[peer].overlaps(storage.data_ptr(), storage.data_ptr() + storage.nbytes()):
            return t, None
        need = -(-t.nbytes // 64) * 64
        for c in self._chunks:
            if c.pending == 0:
                c.used = 0
            if c.buf.nbytes - c.used >= need:
                break
        else:
            largest = max((k.buf.nbytes for k in self._chunks), default=0)
            c = self._new_chunk(max(need, 2 * largest, 1 << 20), t.device)
        out = c.buf[c.used : c.used + t.nbytes]
        out.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        c.used += need
        c.pending += 1
        return out, c

    def _new_chunk(self, size: int, device: torch.device) -> _Chunk:
        """A bounce buffer overlapping no range a peer holds stale (those tried meanwhile are held, so
        each try gets other memory)."""
        tried = []
        for _ in range(64):
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            start = buf.data_ptr()
            if not any(r.overlaps(start, start + size) for r in self._stale.values()):
                self._chunks.append(_Chunk(buf))
                return self._chunks[-1]
            tried.append(buf)
        raise DataPlaneError(f"{self.name}: no bounce buffer of {size} bytes clear of released registrations")

    def _next(self, peer: int, tag: int, send: bool) -> int:
        n = self._counts[peer, tag, send]
        self._counts[peer, tag, send] = n + 1
        return n

    # ---- posting ---------------------------------------------------------------------------
    def post(self, sends: Sequence[Op], recvs: Sequence[Op]) -> list[Work]:
        agent = self._live()
        works: list[Work] = []
        bounced = False
        by_peer: defaultdict[int, tuple[list[str], list[list[int | str]]]] = defaultdict(lambda: ([], []))
        for t, peer, tag in sends:
            self._peer_rank(peer, "send")
            t, chunk = self._bounced(t, peer)
            bounced |= chunk is not None
            msg = _Msg(t, peer, (tag, self._next(peer, tag, True)), True, chunk=chunk)
            reg = self._registered(t)
            mds, ops = by_peer[peer]
            if peer not in reg.told:
                reg.told.add(peer)
                mds.append(base64.b64encode(reg.metadata).decode())
            mem, dev = _where(t)
            ops.append([tag, msg.key[1], t.data_ptr(), t.nbytes, dev, mem])
            self._sends[(peer, *msg.key)] = msg
            works.append(msg)
        if bounced and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies land before a peer reads them
        for peer, (mds, ops) in by_peer.items():
            agent.send_notif(self._peers[peer], _encode(_ANNOUNCE, {"md": mds, "ops": ops}))
        for t, peer, tag in recvs:
            self._peer_rank(peer, "receive")
            msg = _Msg(t, peer, (tag, self._next(peer, tag, False)), False)
            self._registered(t)
            self._recvs[peer].append(msg)
            works.append(msg)
        if recvs:
            self._progress()
        return works

    def _peer_rank(self, peer: int, what: str) -> None:
        if peer == self.rank or peer not in self._peers:
            raise ValueError(f"{what} peer must be another rank in [0, {self.world_size}), got {peer}")

    # ---- progress ----------------------------------------------------------------------------
    def _progress(self) -> None:
        """Read the notifications, start a READ per peer for every announced receive, finish READs."""
        agent = self._live()
        for sender, messages in agent.get_new_notifs().items():
            peer = self._rank_of.get(sender)
            if peer is None:
                raise DataPlaneError(f"{self.name}: a notification from an agent not in this group ({sender!r})")
            for raw in messages:
                self._notified(agent, peer, raw)
        for peer, waiting in self._recvs.items():
            ready = [m for m in waiting if (peer, *m.key) in self._announced]
            if ready:
                self._recvs[peer] = [m for m in waiting if (peer, *m.key) not in self._announced]
                self._read(agent, peer, ready)
        still = []
        for handle, msgs in self._reads:
            state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise DataPlaneError(f"{self.name}: a READ from {self._peers[msgs[0].peer]} failed "
                                     f"(messages {[m.key for m in msgs][:8]})")
            if state == "DONE":
                handle.release()
                for m in msgs:
                    m.done = True
            else:
                still.append((handle, msgs))
        self._reads = still

    def _notified(self, agent: _Agent, peer: int, raw: bytes) -> None:
        kind, body = raw[:1], raw[1:]
        try:
            parsed = json.loads(body)
            if kind == _ANNOUNCE:
                for md in parsed["md"]:
                    agent.add_remote_agent(base64.b64decode(md, validate=True))
                for tag, n, addr, nbytes, dev, mem in parsed["ops"]:
                    if mem not in ("DRAM", "VRAM"):
                        raise ValueError(f"memory type {mem!r}")
                    self._announced[peer, int(tag), int(n)] = (int(addr), int(nbytes), int(dev), str(mem))
            elif kind == _READ:
                for tag, n in parsed:
                    if (msg := self._sends.pop((peer, int(tag), int(n)), None)) is not None:
                        msg.complete()
            else:
                raise ValueError(f"kind {kind!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise DataPlaneError(f"{self.name}: a malformed notification from rank {peer}: {e}") from None

    def _read(self, agent: _Agent, peer: int, msgs: list[_Msg]) -> None:
        """READ ``msgs`` (all from ``peer``): one request per pair of memory types (one, in practice),
        whose notification tells the peer they were read."""
        groups: defaultdict[tuple[str, str], tuple[list[_Msg], list[tuple[int, int, int]], list[tuple[int, int, int]]]]
        groups = defaultdict(lambda: ([], [], []))
        for m in msgs:
            addr, nbytes, dev, rmem = self._announced.pop((m.peer, *m.key))
            if nbytes != m.tensor.nbytes:
                raise DataPlaneError(f"{self.name}: message (tag {m.key[0]}, #{m.key[1]}) from rank {peer} has "
                                     f"{nbytes} bytes, the receive posted for it {m.tensor.nbytes}")
            lmem, ldev = _where(m.tensor)
            group, local, remote = groups[lmem, rmem if nbytes else lmem]
            group.append(m)
            if nbytes:
                local.append((m.tensor.data_ptr(), nbytes, ldev))
                remote.append((addr, nbytes, dev))
        for (lmem, rmem), (group, local, remote) in groups.items():
            notif = _encode(_READ, [list(m.key) for m in group])
            if not local:  # nothing to move: done
                agent.send_notif(self._peers[peer], notif)
                for m in group:
                    m.done = True
                continue
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, lmem),
                                           agent.get_xfer_descs(remote, rmem), self._peers[peer], notif)
            self._reads.append((handle, group))
            if agent.transfer(handle) == "ERR":
                raise DataPlaneError(f"{self.name}: a READ from rank {peer} could not be posted")

    # ---- waiting -------------------------------------------------------------------------------
    def wait_all(self, works: Sequence[Work], what: str = "point-to-point round") -> None:
        msgs: list[_Msg] = []
        for w in works:
            if isinstance(w, _Group):
                msgs += w.msgs
            elif isinstance(w, _Msg):
                msgs.append(w)
            else:
                raise TypeError(f"works must come from this plane's post or broadcast, got {type(w).__name__}")
        deadline = time.monotonic() + self.timeout_s
        next_check, pause = 0.0, 2e-5
        while True:
            try:
                self._progress()
            except DataPlaneError as e:
                raise DataPlaneError(f"{what} failed on {self.name}: {e}") from None
            if all(m.done for m in msgs):
                return
            if (now := time.monotonic()) >= next_check:
                self._check(deadline, what)
                next_check = now + _CHECK_S
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def exchange(self, sends: Sequence[Op], recvs: Sequence[Op], what: str = "point-to-point round") -> None:
        self.wait_all(self.post(sends, recvs), what)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        if self.rank == src:
            works = self.post([(tensor, p, _BROADCAST_TAG) for p in self._peers], [])
        else:
            works = self.post([], [(tensor, src, _BROADCAST_TAG)])
        return _Group([w for w in works if isinstance(w, _Msg)])

    def barrier(self) -> None:
        """Every rank adds to this barrier's counter on the store, then waits for ``world_size``."""
        key = f"barrier/{self._barriers}"
        self._barriers += 1
        self._store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while self._store.add(key, 0) < self.world_size:
            self._check(deadline, "barrier")
            self._progress()
            time.sleep(pause)
            pause = min(2 * pause, _CHECK_S)

    def abort(self) -> None:
        """Release every transfer handle, registration and remote agent, then drop the agent."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for handle, _ in self._reads:
            try:
                handle.release()
            except Exception:  # noqa: BLE001,S110 - a transfer NIXL cannot cancel: freed with the agent
                pass
        self._reads.clear()
        for reg in self._regs.values():
            try:
                agent.deregister_memory(reg.descs)
            except Exception:  # noqa: BLE001,S110 - best effort: the agent's teardown frees the rest
                pass
        self._regs.clear()
        for peer in getattr(self, "_peers", {}).values():
            try:
                agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001,S110 - never connected
                pass
        self._recvs.clear()
        self._sends.clear()
        self._announced.clear()
        self._chunks.clear()
        del agent


@dataclass(slots=True, eq=False)
class _Group:
    """A broadcast's messages, as one work."""

    msgs: list[_Msg]
