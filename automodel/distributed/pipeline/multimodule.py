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

import logging
import math
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

logger = logging.getLogger(__name__)

__all__ = [
    "ModuleGrid",
    "MultiModulePipelineCommunicator",
    "RankModuleInfo",
    "Shape",
    "_prepare_tensor_for_comm",
    "_restore_tensor_from_comm",
    "compute_total_pipeline_stages",
    "run_gpipe",
]


@dataclass(frozen=True)
class RankModuleInfo:
    """Where this rank sits in one module it holds (Megatron's fields first, then ours).

    ``is_source_stage``: first stage of a module with no upstream module (it receives nothing).
    ``is_terminal_stage``: last stage of a module with no downstream module (it computes the loss).
    ``p2p_communicator`` is always ``None`` here (one communicator moves every message); the bridge
    lists hold the module edges this rank sends on (``src``) and receives on (``dest``).
    """

    pp_rank: int
    pp_size: int
    p2p_communicator: Any = None
    bridge_comms_as_src_module: list | None = None
    bridge_comms_as_dest_module: list | None = None
    is_source_stage: bool = True
    is_terminal_stage: bool = True
    name: str = ""
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    upstream: tuple[str, ...] = ()
    downstream: tuple[str, ...] = ()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


#: a tensor shape, as Megatron's communicator types it
Shape = list[int] | torch.Size


def _prepare_tensor_for_comm(tensor: torch.Tensor | list | None) -> torch.Tensor | list | None:
    """Megatron's 2-D -> 3-D adapter: ``[a, b]`` becomes ``[a, b, 1]``; 3-D passes; lists map; ``None`` stays.

    Raises ``ValueError`` for a 3-D tensor whose last dim is 1 (the receiver could not tell it from an
    adapted 2-D tensor; Megatron asserts). The communicator itself does not need it: every message's
    header carries the sender's number of dims.
    """
    if tensor is None:
        return None
    if isinstance(tensor, list):
        return [_prepare_tensor_for_comm(t) for t in tensor]
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() == 2:
            return tensor.unsqueeze(-1)
        if tensor.dim() == 3 and tensor.size(-1) == 1:
            raise ValueError(
                f"a 3-D tensor with a last dim of 1 {tuple(tensor.shape)} cannot be told apart from an adapted "
                "2-D tensor after communication; send it 2-D or with a last dim > 1"
            )
    return tensor


def _restore_tensor_from_comm(tensor: torch.Tensor | list | None) -> torch.Tensor | list | None:
    """Inverse of :func:`_prepare_tensor_for_comm`: a 3-D tensor with a last dim of 1 loses it."""
    if tensor is None:
        return None
    if isinstance(tensor, list):
        return [_restore_tensor_from_comm(t) for t in tensor]
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.size(-1) == 1:
        return tensor.squeeze(-1)
    return tensor


def _is_module_names(value: Any) -> bool:
    """True for a module name or a list/tuple of names (our ``module_name``), False for a shape."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def _tensor_layout(dim_mapping: Mapping[str, Any] | None) -> tuple[int, int, int] | None:
    """Megatron's ``{'s': 0, 'b': 1, 'h': 2}`` -> the permutation to ``[b, s, h]``; ``None`` for our mesh mapping."""
    if not dim_mapping or not set(dim_mapping) <= {"s", "b", "h"}:
        return None
    if set(dim_mapping) != {"s", "b", "h"} or sorted(int(v) for v in dim_mapping.values()) != [0, 1, 2]:
        raise ValueError(
            f"dim_mapping {dict(dim_mapping)} looks like Megatron's activation layout: it needs 's', 'b' and 'h' "
            "mapped to the dims 0, 1, 2"
        )
    return int(dim_mapping["b"]), int(dim_mapping["s"]), int(dim_mapping["h"])


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
            ``cp``, ``tp``, or renamed with ``dim_mapping``), a :class:`ModuleGrid`, or a Megatron
            ``HyperCommGrid`` (anything with ``shape``, ``dim_names`` and ``rank_offset``). Build every
            mesh on every rank, in the same order.
        topology: ``{module: [downstream modules]}``; a DAG with at least one sink.
        config: Megatron's ``ModelParallelConfig`` (third, as in Megatron); kept as ``self.config`` and
            not read: tensors travel in their own dtype, shapes in message headers.
        dim_mapping: either logical dim -> mesh dim name(s) (see :meth:`ModuleGrid.from_mesh`), or
            Megatron's activation layout ``{'s': .., 'b': .., 'h': ..}``: 3-D activations are then
            ``dim_mapping``-ordered (``{'s': 0, 'b': 1, 'h': 2}`` = ``[S, B, H]``) and dp splits ``b``,
            cp splits ``s``. Default: ``[B, S, H]``.
        module_output_ndim: module -> 3 (``[B, S, H...]``, default) or 2 (``[B*S, H]``). A 2-D activation
            is split along its tokens: dp ranks hold contiguous blocks of ``N / dp`` tokens, and with cp a
            dp block is cut again by the cp layout; so a ``[B*S, H]`` vision encoder at dp=1 feeds an
            LLM at dp=2 or dp=4 (each dp rank gets its rows' tokens).
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
            layout, overlapping ranks, or a 2-D edge whose dp/cp layouts cannot both hold its tokens.

    A rank in no module's grid idles (as in Megatron): it logs one line, ``current_stage`` is 0 and every
    exchange returns ``{}`` without communicating.

    Call pattern (one module per rank): ``x = recv_forward()``, compute, ``send_forward({name: y})``;
    backward: ``g = recv_backward()``, backprop, ``send_backward({upstream: x.grad, ...})``. Both sides
    of a pair must make matching calls (``send_forward`` <-> ``recv_forward``,
    ``send_forward_recv_backward`` <-> ``send_backward_recv_forward``). A rank holding colocated modules
    passes dicts with all of them, or ``module_name=``. The Megatron arguments ``tensor_shape`` and
    ``is_first_stage`` / ``is_last_stage`` are accepted and not needed (headers carry the shapes, the
    topology the stage roles); a module name (or list of names) in the ``tensor_shape`` position is
    taken as ``module_name``. A gradient may be exchanged on an edge before any activation (Megatron's
    own send-backward tests do): its global shape then comes from the sender alone.
    """

    def __init__(
        self,
        module_to_grid_map: Mapping[str, Any],
        topology: Mapping[str, Sequence[str]],
        config: Any = None,
        dim_mapping: Mapping[str, Any] | None = None,
        module_output_ndim: Mapping[str, int] | None = None,
        *,
        cp_layout: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        device: torch.device | str | None = None,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.module_to_grid_map = module_to_grid_map
        self.tensor_layout = _tensor_layout(dim_mapping)
        mesh_mapping = None if self.tensor_layout is not None else dim_mapping
        self.dim_mapping = dim_mapping
        self.grids: dict[str, ModuleGrid] = {}
        for name, grid in module_to_grid_map.items():
            if isinstance(grid, ModuleGrid):
                self.grids[name] = grid
            elif hasattr(grid, "mesh") and hasattr(grid, "mesh_dim_names"):
                self.grids[name] = ModuleGrid.from_mesh(grid, mesh_mapping)
            elif all(hasattr(grid, a) for a in ("shape", "dim_names", "rank_offset")):
                self.grids[name] = ModuleGrid.from_hyper_comm_grid(grid)
            else:
                raise TypeError(
                    f"module {name!r}: the communicator needs a DeviceMesh, ModuleGrid or HyperCommGrid, "
                    f"got {type(grid).__name__}"
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
        self.current_rank = self.rank = dist.get_rank() if rank is None else int(rank)
        held = rank_modules(self.grids, self.rank)
        if not held:
            where = ", ".join(f"{n}: {g.rank_list()}" for n, g in self.grids.items())
            logger.info("rank %d is in no module's grid (%s): it idles in the multi-module pipeline", self.rank, where)
        self.timeout = float(timeout)
        self.group = group
        self._plans: dict[tuple, tuple] = {}
        if device is None:
            nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._edges = self._all_edges()
        self._rows2d = {e: self._edge_rows_2d(e) for e in self._edges if self.module_output_ndim[e.src] == 2}
        self.modules: dict[str, RankModuleInfo] = {}
        for m in self.grids:  # the map's order: current_stage reads the first module, as Megatron does
            if m in held:
                _, d, c, t = self.grids[m].coordinate(self.rank)  # type: ignore[misc]
                pp, pp_size = held[m], self.grids[m].pp
                ups, downs = tuple(self.upstream[m]), tuple(self.topology[m])
                self.modules[m] = RankModuleInfo(
                    pp, pp_size, None,
                    [e for e in self._edges if e.src == m and e.src_pp == pp and e.dst != m],
                    [e for e in self._edges if e.dst == m and e.dst_pp == pp and e.src != m],
                    pp == 0 and not ups, pp == pp_size - 1 and not downs,
                    m, d, c, t, ups, downs,
                )
        self._sent: dict[_Edge, deque] = {e: deque() for e in self._edges}  # forward shapes, FIFO per edge
        self._received: dict[_Edge, deque] = {e: deque() for e in self._edges}
        self._mailbox: dict[tuple[int], deque] = {}  # messages from this rank to itself, by message key
        self._known_out: dict[int, list[int]] = {}  # message key -> header the receiver accepted
        self._known_in: dict[int, tuple[list[int], tuple]] = {}  # message key -> (header, payload spec)

    @property
    def bridge_comms(self) -> list[_Edge]:
        """Every edge between two modules (Megatron builds one BridgeCommunicator per such edge)."""
        return [e for e in self._edges if e.src != e.dst]

    @property
    def rank_module_map(self) -> dict[str, RankModuleInfo]:
        """Module -> this rank's :class:`RankModuleInfo`, for every module it holds (Megatron's name)."""
        return self.modules

    def is_current_rank_in_grid(self, grid: Any) -> bool:
        """Whether this rank is in ``grid`` (a ModuleGrid, DeviceMesh or HyperCommGrid)."""
        if not isinstance(grid, ModuleGrid):
            if hasattr(grid, "mesh") and hasattr(grid, "mesh_dim_names"):
                return self.rank in torch.as_tensor(grid.mesh).flatten().tolist()
            grid = ModuleGrid.from_hyper_comm_grid(grid)
        return grid.coordinate(self.rank) is not None

    def _edge_rows_2d(self, edge: _Edge) -> int:
        """Rows ``R`` of the ``[R, N/R, H]`` view of a 2-D activation on ``edge`` (see the class docstring)."""
        a, b = self._layout(edge.src, edge.src_pp), self._layout(edge.dst, edge.dst_pp)
        with_cp = [lay for lay in (a, b) if lay.cp > 1]
        if not with_cp:
            return math.lcm(a.dp, b.dp)
        rows = with_cp[0].dp
        if any(lay.dp != rows for lay in with_cp) or any(rows % lay.dp for lay in (a, b)):
            raise ValueError(
                f"the 2-D activation {edge.label(False)} cannot be laid out on both sides: {edge.src} has dp={a.dp}, "
                f"cp={a.cp} and {edge.dst} has dp={b.dp}, cp={b.cp}; with cp > 1 on a side, the dp of every side "
                "with cp > 1 must be equal and a multiple of the other side's dp. Send it 3-D ([B, S, H]) instead"
            )
        return rows

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
        """This rank's global pipeline stage, 0-indexed (Megatron's convention).

        For colocated modules, the stage of the first one in ``module_to_grid_map``'s order (as Megatron);
        ``stage_of(name) - 1`` gives any other. An idle rank is at stage 0.
        """
        if not self.modules:
            return 0
        return self.stage_of(next(iter(self.modules))) - 1

    @staticmethod
    def compute_total_pipeline_stages(
        topology: Mapping[str, Sequence[str]],
        module_to_grid_map: Mapping[str, Any],
        rank: int | None = None,
        module_name: str | None = None,
    ) -> int:
        """Megatron's static method: :func:`automodel.distributed.pipeline.topology.compute_total_pipeline_stages`."""
        return compute_total_pipeline_stages(topology, module_to_grid_map, rank, module_name)

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
            if not self.modules:
                raise ValueError(f"rank {self.rank} holds no module (it idles); there is no stage or module to name")
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

    def _canonical(self, edge: _Edge, sending: StageLayout, x: torch.Tensor, ndim: int) -> torch.Tensor:
        """``x`` as the ``[rows, seq, ...]`` view the plans use, on the sending side's layout."""
        if x.dim() == 2:
            if ndim != 2:
                return x.unsqueeze(0)  # the header's ndim makes the receiver reject it
            k = self._rows2d[edge] // sending.dp
            if x.size(0) % k:
                return x.unsqueeze(0)  # does not fit the layout: the receivers reject the header with the reason
            return x.reshape(k, x.size(0) // k, *x.shape[1:])
        if x.dim() == 3 and self.tensor_layout is not None:
            return x.permute(*self.tensor_layout)
        return x

    def _build_send(
        self, edge: _Edge, backward: bool, x: torch.Tensor, commits: list
    ) -> list[tuple[int, Outgoing]]:
        """This rank's messages of ``x`` on ``edge``; appends to ``commits`` what to record once it is sent."""
        src, dst, ndim = self._ends(edge, backward)
        what = edge.label(backward)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rank {self.rank}: the {what} must be a tensor, got {type(x).__name__}")
        view = self._canonical(edge, src, x, ndim)
        if backward and self._received[edge]:  # else a gradient before any activation: the header decides
            commits.append(("always", self._received[edge].popleft))  # this micro-batch is done either way
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
                if sent is not None and sent != (gshape, dtype):
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
            if state["orig_ndim"] == 3 and self.tensor_layout is not None:
                inverse = [0, 0, 0]
                for i, d in enumerate(self.tensor_layout):
                    inverse[d] = i
                out = out.permute(*inverse)
            if backward:
                if self._sent[edge]:
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
        An idle rank (no module) returns ``({}, {})`` at once.
        """
        if not self.modules:
            return {}, {}
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

    def recv_forward(
        self,
        tensor_shape: Shape | str | Sequence[str] | None = None,
        is_first_stage: bool = False,
        *,
        module_name: str | Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive this stage's inputs: ``{upstream: x}`` at a module's first stage, ``{module: x}`` later.

        ``tensor_shape`` / ``is_first_stage``: Megatron's arguments, not needed (a module name there is
        ``module_name``).
        """
        return self.communicate(recv_forward=_modules_arg(tensor_shape, module_name))[0]

    def send_forward(self, output_dict: Mapping[str, torch.Tensor], is_last_stage: bool = False) -> None:
        """Send ``{module: output}`` to the next stage, or to every downstream module (fan-out)."""
        self.communicate(send_forward=output_dict)

    def recv_backward(
        self,
        tensor_shape: Shape | str | Sequence[str] | None = None,
        is_last_stage: bool = False,
        *,
        module_name: str | Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive ``{module: grad of its output}`` (summed over downstream modules); ``{}`` at a terminal stage.

        Megatron keeps only the last downstream module's gradient on a fan-out edge; the sum is exact.
        """
        return self.communicate(recv_backward=_modules_arg(tensor_shape, module_name))[1]

    def send_backward(self, grad_dict: Mapping[str, torch.Tensor], is_first_stage: bool = False) -> None:
        """Send the gradients of the received inputs back, keyed like :meth:`recv_forward`'s result."""
        self.communicate(send_backward=grad_dict)

    def send_forward_recv_backward(
        self,
        output_dict: Mapping[str, torch.Tensor],
        tensor_shape: Shape | str | Sequence[str] | None = None,
        is_last_stage: bool = False,
        *,
        module_name: str | Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """:meth:`send_forward` and :meth:`recv_backward` in one exchange (pairs with the peer's
        :meth:`send_backward_recv_forward`)."""
        return self.communicate(send_forward=output_dict, recv_backward=_modules_arg(tensor_shape, module_name))[1]

    def send_backward_recv_forward(
        self,
        grad_dict: Mapping[str, torch.Tensor],
        tensor_shape: Shape | str | Sequence[str] | None = None,
        is_first_stage: bool = False,
        *,
        module_name: str | Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """:meth:`send_backward` and :meth:`recv_forward` in one exchange (pairs with the peer's
        :meth:`send_forward_recv_backward`)."""
        return self.communicate(send_backward=grad_dict, recv_forward=_modules_arg(tensor_shape, module_name))[0]


def _modules_arg(tensor_shape: Any, module_name: Any) -> Any:
    """``module_name``, or a module name given in Megatron's ``tensor_shape`` position (a shape is ignored)."""
    if _is_module_names(tensor_shape):
        if module_name is not None:
            raise TypeError(f"got module names twice: {tensor_shape!r} and module_name={module_name!r}")
        return tensor_shape
    return module_name
