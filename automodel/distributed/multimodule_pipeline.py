"""Multi-module pipeline communicator: encoders, an LLM and a generator on different rank groups.

A multimodal model is a DAG of modules (``topology``: ``{module: [downstream modules]}``), each on its
own ranks with its own ``pp`` / ``dp`` / ``cp`` / ``tp`` sizes (one ``DeviceMesh`` per module, created
on every rank). :class:`MultiModulePipelineCommunicator` knows the topology, counts global pipeline
stages, and moves activation and gradient dicts keyed by module name:

* between the pipeline stages of one module: the same dp/cp/tp coordinates, stage to stage;
* across a module edge (a **bridge**): the sender's dp/cp/tp shards are redistributed into the
  receiver's layout (:mod:`automodel.distributed.pipeline.bridge`), including a different cp size
  and cp sequence layout (``"head_tail"`` for ring CP, ``"contiguous"`` for Ulysses), so a cp=1
  encoder can feed a cp=2 LLM;
* fan-in (two encoders into one LLM: ``recv_forward`` returns both, ``send_backward`` takes both)
  and fan-out (``send_forward`` copies to every downstream module; ``recv_backward`` sums their
  gradients).

Every message carries a shape header that the receiver validates before the payload moves, and
every wait has a timeout (:mod:`automodel.distributed.pipeline.p2p`). The P2P ops are
``batch_isend_irecv`` on the default group: gloo for CPU tensors, NCCL for CUDA tensors.

Megatron's ``MultiModulePipelineCommunicator`` is the model for the names; its bridge requires
cp=1 on both sides, this one does not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from automodel.distributed.pipeline.bridge import CP_LAYOUTS, StageLayout, peer_pairs, plan_transfers
from automodel.distributed.pipeline.p2p import Incoming, Outgoing, decode_header, encode_header, exchange
from automodel.distributed.pipeline.schedule import run_gpipe
from automodel.distributed.pipeline.topology import (
    ModuleGrid,
    compute_total_pipeline_stages,
    rank_modules,
    topological_order,
    upstream_modules,
    validate_topology,
)

__all__ = [
    "ModuleGrid",
    "MultiModulePipelineCommunicator",
    "RankModuleInfo",
    "compute_total_pipeline_stages",
    "run_gpipe",
]


@dataclass(frozen=True)
class RankModuleInfo:
    """Where this rank sits in one module it holds.

    ``is_source_stage``: first stage of a module with no upstream module (it receives nothing).
    ``is_terminal_stage``: last stage of a module with no downstream module (it computes the loss).
    """

    name: str
    pp_rank: int
    pp_size: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    upstream: tuple[str, ...]
    downstream: tuple[str, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_source_stage(self) -> bool:
        return self.is_first_stage and not self.upstream

    @property
    def is_terminal_stage(self) -> bool:
        return self.is_last_stage and not self.downstream


def _whole(rows: tuple[int, int], pos: torch.Tensor, n_rows: int, n_pos: int) -> bool:
    """True when a piece is all ``n_rows`` rows and all ``n_pos`` positions in order."""
    return rows == (0, n_rows) and len(pos) == n_pos and bool((pos == torch.arange(n_pos)).all())


@dataclass(frozen=True)
class _Edge:
    """One hop of a tensor: from (module, pp stage) to (module, pp stage), forward direction."""

    src: str
    src_pp: int
    dst: str
    dst_pp: int

    def label(self, backward: bool) -> str:
        a, b = f"{self.src}[pp {self.src_pp}]", f"{self.dst}[pp {self.dst_pp}]"
        return f"gradient {b} -> {a}" if backward else f"activation {a} -> {b}"


class MultiModulePipelineCommunicator:
    """Moves activations forward and gradients backward through a DAG of modules on rank groups.

    Args:
        module_to_grid_map: module name -> ``DeviceMesh`` over its ranks (dims named ``pp``, ``dp``,
            ``cp``, ``tp``, or renamed with ``dim_mapping``) or a :class:`ModuleGrid`. Build every mesh on
            every rank, in the same order.
        topology: ``{module: [downstream modules]}``; a DAG with at least one sink.
        dim_mapping: logical dim -> mesh dim name(s), see :meth:`ModuleGrid.from_mesh`.
        module_output_ndim: module -> 3 (``[B, S, H...]``, default) or 2 (``[B*S, H]``, viewed as one packed
            row ``[1, N, H]`` per rank).
        cp_layout: module -> ``"head_tail"`` (ring CP, default) or ``"contiguous"`` (Ulysses): how that
            module's cp ranks hold the sequence.
        timeout: seconds any receive may wait before ``TimeoutError``.
        device: where received tensors and headers live; default ``cuda`` (current device) with NCCL,
            else ``cpu``.
        rank: this process's global rank (default ``torch.distributed.get_rank()``); passing it allows
            inspecting the plan without processes.
        group: the process group that carries the P2P messages (default: the default group; it must
            contain every rank of every module). A dedicated group keeps pipeline traffic, and a
            timeout's closed connections, apart from other collectives.

    Raises:
        ValueError: an invalid topology, an unknown module name in any argument, a bad ndim or
            layout, overlapping or missing ranks, or this rank in no module.

    Call pattern (one module per rank): ``x = recv_forward()``, compute, ``send_forward({name: y})``;
    backward: ``g = recv_backward()``, backprop, ``send_backward({upstream: x.grad, ...})``. Both sides
    of a pair must make matching calls (``send_forward`` <-> ``recv_forward``,
    ``send_forward_recv_backward`` <-> ``send_backward_recv_forward``). A rank holding colocated modules
    passes dicts with all of them, or ``module_name=``.
    """

    def __init__(
        self,
        module_to_grid_map: Mapping[str, Any],
        topology: Mapping[str, Sequence[str]],
        dim_mapping: Mapping[str, str | Sequence[str]] | None = None,
        module_output_ndim: Mapping[str, int] | None = None,
        *,
        cp_layout: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        device: torch.device | str | None = None,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.grids: dict[str, ModuleGrid] = {}
        for name, grid in module_to_grid_map.items():
            if isinstance(grid, ModuleGrid):
                self.grids[name] = grid
            elif hasattr(grid, "mesh") and hasattr(grid, "mesh_dim_names"):
                self.grids[name] = ModuleGrid.from_mesh(grid, dim_mapping)
            else:
                raise TypeError(
                    f"module {name!r}: the communicator needs a DeviceMesh or ModuleGrid, got {type(grid).__name__}"
                )
        self.topology = validate_topology(topology, list(self.grids))
        self.order = topological_order(self.topology)
        self.upstream = upstream_modules(self.topology)
        self.module_output_ndim = {m: 3 for m in self.grids}
        for m, nd in (module_output_ndim or {}).items():
            self._known(m, "module_output_ndim")
            if nd not in (2, 3):
                raise ValueError(f"module_output_ndim[{m!r}]={nd!r}: must be 3 ([B, S, H]) or 2 ([B*S, H])")
            self.module_output_ndim[m] = nd
        self.cp_layout = {m: "head_tail" for m in self.grids}
        for m, lay in (cp_layout or {}).items():
            self._known(m, "cp_layout")
            if lay not in CP_LAYOUTS:
                raise ValueError(f"cp_layout[{m!r}]={lay!r}: must be one of {CP_LAYOUTS}")
            self.cp_layout[m] = lay
        self.rank = dist.get_rank() if rank is None else int(rank)
        held = rank_modules(self.grids, self.rank)
        if not held:
            where = ", ".join(f"{n}: {g.rank_list()}" for n, g in self.grids.items())
            raise ValueError(
                f"rank {self.rank} is in no module's grid ({where}); every launched rank must hold a module: "
                "cover it with a mesh or launch fewer processes"
            )
        self.modules: dict[str, RankModuleInfo] = {}
        for m in self.order:
            if m in held:
                _, d, c, t = self.grids[m].coordinate(self.rank)  # type: ignore[misc]
                self.modules[m] = RankModuleInfo(
                    m, held[m], self.grids[m].pp, d, c, t, tuple(self.upstream[m]), tuple(self.topology[m])
                )
        self.timeout = float(timeout)
        self.group = group
        self._plans: dict[tuple, tuple] = {}
        if device is None:
            nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._edges = self._all_edges()
        self._sent: dict[_Edge, deque] = {e: deque() for e in self._edges}  # forward shapes, FIFO per edge
        self._received: dict[_Edge, deque] = {e: deque() for e in self._edges}
        self._mailbox: dict[tuple[int], deque] = {}
        self._known_out: dict[int, list[int]] = {}  # message key -> header the receiver accepted
        self._known_in: dict[int, tuple[list[int], tuple]] = {}  # message key -> (header, payload spec)  # messages from this rank to itself, by message key

    # ------------------------------------------------------------------------------------------------
    # topology queries

    def _known(self, name: str, what: str) -> None:
        if name not in self.grids:
            raise ValueError(f"{what}: unknown module {name!r}; the modules are {sorted(self.grids)}")

    def _all_edges(self) -> list[_Edge]:
        edges = []
        for m in self.order:
            edges += [_Edge(m, p, m, p + 1) for p in range(self.grids[m].pp - 1)]
            edges += [_Edge(m, self.grids[m].pp - 1, d, 0) for d in self.topology[m]]
        return edges

    @property
    def total_stages(self) -> int:
        """Global pipeline stages: the longest path through the DAG, weighted by pp size."""
        return compute_total_pipeline_stages(self.topology, self.grids)

    def stage_of(self, module_name: str | None = None) -> int:
        """Global stages up to and including this rank's stage of ``module_name`` (1-based)."""
        return compute_total_pipeline_stages(self.topology, self.grids, self.rank, self._one(module_name))

    @property
    def current_stage(self) -> int:
        """This rank's global stage, 1-based (the latest one when it holds colocated modules)."""
        return max(self.stage_of(m) for m in self.modules)

    @property
    def is_pp_first_stage(self) -> bool:
        """True when this rank holds a first stage of a module with no upstream (it reads the data)."""
        return any(i.is_source_stage for i in self.modules.values())

    @property
    def is_pp_last_stage(self) -> bool:
        """True when this rank holds the last stage of a sink module (it computes the loss)."""
        return any(i.is_terminal_stage for i in self.modules.values())

    def _one(self, module_name: str | None) -> str:
        if module_name is None:
            if len(self.modules) > 1:
                raise ValueError(
                    f"rank {self.rank} holds colocated modules {list(self.modules)}; pass module_name= to choose"
                )
            return next(iter(self.modules))
        self._known(module_name, "module_name")
        if module_name not in self.modules:
            raise ValueError(f"rank {self.rank} does not hold module {module_name!r}; it holds {list(self.modules)}")
        return module_name

    def _many(self, module_name: str | Sequence[str] | None) -> list[str]:
        if module_name is None:
            return list(self.modules)
        names = [module_name] if isinstance(module_name, str) else list(module_name)
        return [self._one(n) for n in names]

    def _layout(self, module: str, pp_rank: int) -> StageLayout:
        return StageLayout(self.grids[module].stage(pp_rank), self.cp_layout[module])

    def _in_edges(self, module: str) -> list[_Edge]:
        """Edges into this rank's stage of ``module`` (forward direction)."""
        p = self.modules[module].pp_rank
        return [e for e in self._edges if e.dst == module and e.dst_pp == p]

    def _out_edges(self, module: str) -> list[_Edge]:
        p = self.modules[module].pp_rank
        return [e for e in self._edges if e.src == module and e.src_pp == p]

    # ------------------------------------------------------------------------------------------------
    # message building

    def _ends(self, edge: _Edge, backward: bool) -> tuple[StageLayout, StageLayout, int]:
        """(sending layout, receiving layout, ndim of the tensor) for ``edge`` in a direction."""
        a, b = self._layout(edge.src, edge.src_pp), self._layout(edge.dst, edge.dst_pp)
        return (b, a, self.module_output_ndim[edge.src]) if backward else (a, b, self.module_output_ndim[edge.src])

    def _plan(self, edge: _Edge, backward: bool, rows: int, seq: int) -> list:
        """``plan_transfers`` for ``edge`` at ``[rows, seq]`` (cached; ``ValueError`` if it does not fit)."""
        key = (edge, backward, rows, seq)
        if key not in self._plans:
            src, dst, _ = self._ends(edge, backward)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan_transfers(src, dst, rows, seq)
        return self._plans[key]

    def _pairs(self, edge: _Edge, backward: bool) -> list[tuple[int, int]]:
        """``peer_pairs`` for ``edge`` (cached)."""
        key = (edge, backward)
        if key not in self._plans:
            src, dst, _ = self._ends(edge, backward)
            self._plans[key] = peer_pairs(src, dst)
        return self._plans[key]

    def _key(self, edge: _Edge, backward: bool) -> int:
        return self._edges.index(edge) * 2 + int(backward)

    def _build_send(
        self, edge: _Edge, backward: bool, x: torch.Tensor, commits: list
    ) -> list[tuple[int, Outgoing]]:
        """This rank's messages of ``x`` on ``edge``; appends to ``commits`` what to record once it is sent."""
        src, dst, ndim = self._ends(edge, backward)
        what = edge.label(backward)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rank {self.rank}: the {what} must be a tensor, got {type(x).__name__}")
        view = x.unsqueeze(0) if x.dim() == 2 else x
        if backward:
            if not self._received[edge]:
                raise ValueError(f"rank {self.rank}: send of the {what} without a matching forward receive")
            _, local3, _, out_shape = self._received[edge][0]
            commits.append(("always", self._received[edge].popleft))  # this micro-batch is done either way
            if tuple(x.shape) == out_shape:
                view = x.reshape(local3)  # else the header carries the wrong shape and the receiver rejects it
        if view.dim() < 2:
            view = view.reshape(1, -1)
        rows, seq = src.global_shape(view.size(0), view.size(1))
        gshape = (rows, seq, *view.shape[2:])
        header = encode_header(gshape, x.dtype, x.dim())
        me = self.rank
        pairs = [(i, s, d) for i, (s, d) in enumerate(self._pairs(edge, backward)) if s == me]
        try:
            plan = self._plan(edge, backward, rows, seq)
        except ValueError:
            plan = None  # the receivers reject the header with the reason; see exchange's acks
        key = self._key(edge, backward)
        out = []
        for i, _, d in pairs:
            payload = None
            if plan is not None:
                t = plan[i]
                if _whole(t.src_rows, t.src_pos, view.size(0), view.size(1)):
                    payload = view.detach().to(self.device)  # the whole tensor, in order: no gather copy
                else:
                    payload = view[t.src_rows[0] : t.src_rows[1]].index_select(1, t.src_pos.to(view.device))
                    payload = payload.detach().to(self.device)
            out.append((key * 100000 + i, Outgoing(d, header, payload, what)))
        if not backward and plan is not None:
            commits.append(("success", lambda: self._sent[edge].append((gshape, x.dtype))))
        return out

    def _build_recv(self, edge: _Edge, backward: bool) -> tuple[list[tuple[int, Incoming]], Any, Any]:
        """Messages this rank receives on ``edge``, a resolver for their headers, and an assembler."""
        src, dst, ndim = self._ends(edge, backward)
        what = edge.label(backward)
        me = self.rank
        pairs = [(i, s) for i, (s, d) in enumerate(self._pairs(edge, backward)) if d == me]
        key = self._key(edge, backward)
        msgs = [(key * 100000 + i, Incoming(s, what)) for i, s in pairs]
        state: dict[str, Any] = {}

        def resolve(incoming: list[Incoming]) -> tuple[list[str], list]:
            heads = {tuple(m.header) for m in incoming}  # type: ignore[arg-type]
            if len(heads) != 1:
                got = "; ".join(f"rank {m.peer}: {decode_header(m.header)[0]}" for m in incoming)  # type: ignore[arg-type]
                return [f"the senders of the {what} disagree on its global shape ({got})"], []
            gshape, dtype, orig_ndim = decode_header(list(next(iter(heads))))
            if orig_ndim != ndim:
                return [
                    f"the {what} has {orig_ndim} dims, but module_output_ndim[{edge.src!r}] is {ndim}; "
                    f"send {ndim}-D tensors or set module_output_ndim"
                ], []
            if backward:
                sent = self._sent[edge][0] if self._sent[edge] else None
                if sent is None:
                    return [f"got a {what} but sent no activation on that edge"], []
                if sent != (gshape, dtype):
                    return [
                        f"the {what} has global shape {list(gshape)} {dtype}, but the activation sent had "
                        f"{list(sent[0])} {sent[1]}; the gradient must match the activation it belongs to"
                    ], []
            try:
                plan = self._plan(edge, backward, gshape[0], gshape[1])
            except ValueError as e:
                return [f"the {what} cannot be laid out: {e}"], []
            state.update(gshape=gshape, dtype=dtype, orig_ndim=orig_ndim, plan=plan)
            rest = tuple(gshape[2:])
            return [], [((*plan[i].shape, *rest), dtype) for i, _ in pairs]

        def assemble(incoming: list[Incoming]) -> torch.Tensor:
            gshape, plan = state["gshape"], state["plan"]
            b, s = dst.local_shape(gshape[0], gshape[1])
            first = plan[pairs[0][0]]
            if len(pairs) == 1 and _whole(first.dst_rows, first.dst_pos, b, s):
                buf = incoming[0].payload  # one message holding everything, in order: no scatter copy
            else:
                buf = torch.empty((b, s, *gshape[2:]), dtype=state["dtype"], device=self.device)
                for (i, _), m in zip(pairs, incoming):
                    t = plan[i]
                    buf[t.dst_rows[0] : t.dst_rows[1], t.dst_pos.to(self.device)] = m.payload
            local3 = tuple(buf.shape)
            out = buf.reshape(b * s, *gshape[2:]) if state["orig_ndim"] == 2 else buf
            if backward:
                self._sent[edge].popleft()
            else:
                self._received[edge].append((gshape, local3, state["dtype"], tuple(out.shape)))
            return out

        return msgs, resolve, assemble

    # ------------------------------------------------------------------------------------------------
    # the one exchange every public method goes through

    def communicate(
        self,
        send_forward: Mapping[str, torch.Tensor] | None = None,
        recv_forward: str | Sequence[str] | None | bool = False,
        send_backward: Mapping[str, torch.Tensor] | None = None,
        recv_backward: str | Sequence[str] | None | bool = False,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Post every requested send and receive as one batched exchange; return ``(forward, backward)``.

        Args:
            send_forward: ``{module: output}`` for modules of this rank (its outputs go to the next stage,
                or to every downstream module from the last stage; nothing from a terminal stage).
            recv_forward: ``False`` (none), ``None`` (every module of this rank) or module name(s): receive
                their inputs. Returned dict: ``{upstream module: tensor}`` at a module's first stage,
                ``{module: tensor}`` at later stages.
            send_backward: at a module's first stage ``{upstream module: grad}`` (one per upstream), at
                later stages ``{module: grad}`` (the gradient of the received input).
            recv_backward: like ``recv_forward``; returns ``{module: grad of its output}`` (summed over
                fan-out), ``{}`` for terminal stages.

        Received tensors are new (no autograd history) on ``self.device``; inputs are not mutated.
        """
        outgoing: list[tuple[int, Outgoing]] = []
        commits: list = []  # ("success" | "always", bookkeeping to apply after the exchange)
        incoming: list[tuple[list[tuple[int, Incoming]], Any, Any, str, bool, _Edge]] = []
        for backward, sends in ((False, send_forward or {}), (True, send_backward or {})):
            for name, x in sends.items():
                for edge in self._send_edges(name, backward):
                    outgoing += self._build_send(edge, backward, x, commits)
        for backward, which in ((False, recv_forward), (True, recv_backward)):
            if which is False:
                continue
            for module in self._many(which):  # type: ignore[arg-type]
                edges = self._out_edges(module) if backward else self._in_edges(module)
                for edge in edges:
                    msgs, resolve, assemble = self._build_recv(edge, backward)
                    out_name = module if (backward or edge.src == edge.dst) else edge.src
                    incoming.append((msgs, resolve, assemble, out_name, backward, edge))

        # messages to this rank itself go through the mailbox
        remote_out = []
        for key, m in outgoing:
            if m.peer == self.rank:
                self._mailbox.setdefault((key,), deque()).append((m.header, m.payload))
            else:
                remote_out.append((key, m))
        flat_in: list[tuple[int, Incoming]] = []
        for msgs, *_ in incoming:
            for key, m in msgs:
                if m.peer == self.rank:
                    box = self._mailbox.get((key,))
                    if not box:
                        raise ValueError(
                            f"rank {self.rank}: the {m.what} comes from this rank, but it was not sent yet; "
                            "call send_forward/send_backward for the sending module first"
                        )
                    m.header, m.local = box.popleft()
                flat_in.append((key, m))

        def resolve_all(_: list[Incoming]) -> tuple[list[str], list]:
            problems, by_msg = [], {}
            for msgs, resolve, *_ in incoming:
                if msgs:
                    found, specs = resolve([m for _, m in msgs])
                    problems += found
                    by_msg.update({key: spec for (key, _), spec in zip(msgs, specs)})
            if problems:
                return problems, []
            return [], [by_msg[k] for k, _ in flat_in]

        remote_out.sort(key=lambda km: km[0])
        flat_in.sort(key=lambda km: km[0])
        for key, m in remote_out:
            m.known = self._known_out.get(key)
        for key, m in flat_in:
            m.known, m.known_spec = self._known_in.get(key, (None, None))
        try:
            exchange(
                [m for _, m in remote_out],
                [m for _, m in flat_in],
                resolve_all,
                device=self.device,
                timeout=self.timeout,
                group=self.group,
            )
        except ValueError:
            # a rejected micro-batch is over on both ends: a gradient receiver forgets the activation
            # it sent, as the gradient sender forgets the one it received ("always" commits below)
            for msgs, _, _, _, backward, edge in incoming:
                if backward and msgs and self._sent[edge]:
                    self._sent[edge].popleft()
            raise
        finally:  # remember what both ends of each delivered message agreed on
            for when, commit in commits:
                if when == "always":
                    commit()
            for key, m in remote_out:
                if m.delivered:
                    self._known_out[key] = m.header
            for key, m in flat_in:
                if m.delivered:
                    self._known_in[key] = (m.header, (tuple(m.payload.shape), m.payload.dtype))
        for when, commit in commits:
            if when == "success":
                commit()
        fwd: dict[str, torch.Tensor] = {}
        bwd: dict[str, torch.Tensor] = {}
        for msgs, _, assemble, out_name, backward, _ in incoming:
            if not msgs:
                continue
            t = assemble([m for _, m in msgs])
            target = bwd if backward else fwd
            target[out_name] = target[out_name] + t if out_name in target else t
        return fwd, bwd

    def _send_edges(self, name: str, backward: bool) -> list[_Edge]:
        if not backward:
            self._one(name)
            return self._out_edges(name)
        # backward: the key is this rank's module (later stages) or an upstream module (first stage)
        if name in self.modules and self.modules[name].pp_rank > 0:
            return [e for e in self._in_edges(name) if e.src == name]
        hits = [e for m in self.modules for e in self._in_edges(m) if e.src == name and e.dst_pp == 0]
        if not hits:
            self._known(name, "send_backward")
            raise ValueError(
                f"rank {self.rank}: send_backward got a gradient for {name!r}, which feeds none of this rank's "
                f"stages ({list(self.modules)}); key the dict by the upstream module (first stage) or by "
                "this rank's module (later stages)"
            )
        return hits

    # ------------------------------------------------------------------------------------------------
    # Megatron-style names

    def recv_forward(self, module_name: str | Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Receive this stage's inputs: ``{upstream: x}`` at a module's first stage, ``{module: x}`` later."""
        return self.communicate(recv_forward=module_name)[0]

    def send_forward(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Send ``{module: output}`` to the next stage, or to every downstream module (fan-out)."""
        self.communicate(send_forward=outputs)

    def recv_backward(self, module_name: str | Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Receive ``{module: grad of its output}`` (summed over downstream modules); ``{}`` at a terminal stage."""
        return self.communicate(recv_backward=module_name)[1]

    def send_backward(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Send the gradients of the received inputs back, keyed like :meth:`recv_forward`'s result."""
        self.communicate(send_backward=grads)

    def send_forward_recv_backward(
        self, outputs: Mapping[str, torch.Tensor], module_name: str | Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """:meth:`send_forward` and :meth:`recv_backward` in one exchange (pairs with the peer's
        :meth:`send_backward_recv_forward`)."""
        return self.communicate(send_forward=outputs, recv_backward=module_name)[1]

    def send_backward_recv_forward(
        self, grads: Mapping[str, torch.Tensor], module_name: str | Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """:meth:`send_backward` and :meth:`recv_forward` in one exchange (pairs with the peer's
        :meth:`send_forward_recv_backward`)."""
        return self.communicate(send_backward=grads, recv_forward=module_name)[0]
