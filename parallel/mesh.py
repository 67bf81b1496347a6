"""The (pp, dp, tp) device mesh: validated sizes, process groups, rank coordinates.

Owns everything about *which rank talks to which*; nothing here knows the model
beyond the sizes it must divide. Legend: pp = pipeline stages (outermost axis,
across nodes), dp = data-parallel replicas, tp = tensor-parallel ranks (innermost
axis, consecutive ranks on one node), as in Megatron-LM and torchtitan:

    rank = (pp_i * dp + dp_i) * tp + tp_i

    pp=2, dp=2, tp=2:   pp_i=0: dp_i=0 -> ranks 0 1 | dp_i=1 -> ranks 2 3
                        pp_i=1: dp_i=0 -> ranks 4 5 | dp_i=1 -> ranks 6 7

Usage (one object created once and passed in; a function gets only its axis):

    init_distributed(timeout_s=600)
    dims = ParallelDims(pp=2, dp=-1, tp=2, world_size=dist.get_world_size())  # -1: dp inferred
    dims.validate(model_config)            # before any collective
    mesh = build_mesh(dims, "cuda" if torch.cuda.is_available() else "cpu")
    apply_tensor_parallel(model, mesh.group("tp"))

Experts (ep): the expert-parallel axis is a sub-group of the dp axis. The dp
coordinate splits as `dp_i = edp_i * ep + ep_i`: the ep ranks of one ep group are
consecutive dp replicas (ep * tp consecutive global ranks, inside a node where it
fits), each holding E / ep experts of every sparse layer; the expert-data-parallel
group (edp = dp / ep) joins the replicas holding the same experts:

    pp=1, dp=4, ep=2, tp=1:   ep groups {0 1} {2 3}   edp groups {0 2} {1 3}

Single process: `init_distributed` initialises a 1-rank group on an in-memory
`HashStore` (no port, no env vars), so the mesh, its groups and every collective
work unchanged with world size 1.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.errors import ParallelConfigError

if TYPE_CHECKING:
    from models.config import ModelConfig

logger = logging.getLogger(__name__)

Axis = Literal["pp", "dp", "tp", "ep", "edp"]
AXES: tuple[Axis, Axis, Axis] = ("pp", "dp", "tp")
MeshKey = Axis | tuple[Axis, ...]  # mesh["tp"], mesh["dp", "tp"]


# ----------------------------------------------------------------------------- sizes (pure)


@dataclass
class ParallelDims:
    """Sizes of the mesh axes; `dp=-1` is inferred from the world size by `validate()`.

    Attributes:
        pp: pipeline-parallel size (stages).
        dp: data-parallel size, or -1 to take `world_size // (pp * tp)`.
        tp: tensor-parallel size.
        world_size: number of ranks (processes).
        local_world_size: ranks per node (torchrun's LOCAL_WORLD_SIZE); None = unknown.
        allow_tp_across_nodes: permit `tp > local_world_size` (slow inter-node all-reduces).
        ep: expert-parallel size, a divisor of dp (each sparse layer's experts spread over ep replicas).
    """

    pp: int
    dp: int
    tp: int
    world_size: int
    local_world_size: int | None = None
    allow_tp_across_nodes: bool = False
    ep: int = 1

    def validate(self, model_config: ModelConfig | None = None) -> ParallelDims:
        """Check the sizes (and the model's divisibility by tp); infer dp if -1. Pure: no collectives.

        Args:
            model_config: when given, tp must divide its heads, FFN widths and d_model, and ep its
                experts (ep > 1 needs a sparse model).

        Returns:
            self, with `dp` resolved.

        Raises:
            ParallelConfigError: naming the flag (ParallelArguments name), its value and the valid ones, e.g.
                `tensor_parallel_size=3 does not divide 4 ranks; valid: 1, 2, 4`.
        """
        for name, value in (("pipeline_parallel_size", self.pp), ("tensor_parallel_size", self.tp),
                            ("world_size", self.world_size)):  # fmt: skip
            if value < 1:
                raise ParallelConfigError(f"{name}={value} must be >= 1")
        if self.dp == -1:
            self._check_divides_world()
            self.dp = self.world_size // (self.pp * self.tp)
        if self.dp < 1:
            raise ParallelConfigError(f"data_parallel_size={self.dp} must be >= 1 or -1 (inferred)")
        if self.pp * self.dp * self.tp != self.world_size:
            self._check_divides_world()
            raise ParallelConfigError(
                f"pipeline_parallel_size({self.pp}) * data_parallel_size({self.dp}) * "
                f"tensor_parallel_size({self.tp}) = {self.pp * self.dp * self.tp} != WORLD_SIZE"
                f"({self.world_size}); valid: data_parallel_size={self.world_size // (self.pp * self.tp)} "
                f"or -1 (inferred)"
            )
        if self.ep < 1 or self.dp % self.ep:
            raise ParallelConfigError(
                f"expert_parallel_size={self.ep} does not divide data_parallel_size({self.dp}); "
                f"valid: {_divisors(self.dp)}"
            )
        lws = self.local_world_size
        if lws is not None and self.tp > lws and not self.allow_tp_across_nodes:
            raise ParallelConfigError(
                f"tensor_parallel_size={self.tp} > LOCAL_WORLD_SIZE({lws}): tensor parallelism would "
                f"cross nodes; valid: tensor_parallel_size <= {lws}, or set allow_tp_across_nodes"
            )
        if model_config is not None:
            check_tp_divides_model(model_config, self.tp)
            check_ep_divides_model(model_config, self.ep, self.dp)
        return self

    def _check_divides_world(self) -> None:
        """Raise naming the flag (the ParallelArguments name) whose size does not divide the ranks."""
        world, pp, tp = self.world_size, self.pp, self.tp
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        if world % pp:
            raise ParallelConfigError(
                f"pipeline_parallel_size={pp} does not divide {ranks}; valid: {_divisors(world)}"
            )
        per_stage = world // pp
        if per_stage % tp:
            where = ranks if pp == 1 else (
                f"the {per_stage} ranks of a pipeline stage (WORLD_SIZE({world}) / pipeline_parallel_size({pp}))"
            )  # fmt: skip
            raise ParallelConfigError(
                f"tensor_parallel_size={tp} does not divide {where}; valid: {_divisors(per_stage)}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        """(pp, dp, tp), the mesh shape (dp must be resolved)."""
        return (self.pp, self.dp, self.tp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas holding the same experts (dp / ep)."""
        return self.dp // self.ep

    def size(self, axis: Axis) -> int:
        """Size of `axis` ("pp", "dp", "tp", "ep" or "edp"; dp must be resolved)."""
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "ep": self.ep, "edp": self.edp}[axis]


def check_tp_divides_model(config: ModelConfig, tp: int) -> None:
    """Raise if tp does not divide the attention heads, FFN widths or d_model.

    The vocabulary need not be divisible: it is padded to a multiple of tp.

    Raises:
        ParallelConfigError: naming the first size tp does not divide.
    """
    for name in (
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "d_model",
    ):
        value = int(getattr(config, name))
        if value % tp != 0:
            raise ParallelConfigError(
                f"tensor_parallel_size={tp} does not divide {name}({value}); valid: {_divisors(value)}"
            )


def check_ep_divides_model(config: ModelConfig, ep: int, dp: int | None = None) -> None:
    """Raise if ep does not divide the experts of each sparse layer, or ep > 1 on a dense model;
    the valid sizes named also divide `dp` where it is given (ep is a sub-axis of dp).

    Raises:
        ParallelConfigError: naming `expert_parallel_size`, its value and the valid ones.
    """
    experts = int(getattr(config, "num_experts", 0) or 0)
    if ep > 1 and experts == 0:
        raise ParallelConfigError(
            f"expert_parallel_size={ep} needs a sparse (Mixture-of-Experts) model; this one is dense "
            f"(num_experts=0); valid: 1"
        )
    if experts and experts % ep:
        raise ParallelConfigError(
            f"expert_parallel_size={ep} does not divide num_experts({experts}); valid: "
            f"{_divisors(experts if dp is None else math.gcd(experts, dp))}"
        )


def _divisors(n: int) -> str:
    """`12 -> "1, 2, 3, 4, 6, 12"`: the sizes an axis over n ranks (or heads, ...) may take."""
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def rank_to_coords(rank: int, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(pp_i, dp_i, tp_i) of a global rank on a (pp, dp, tp) mesh, tp innermost.

    Raises:
        ValueError: if the rank is outside the mesh.
    """
    pp, dp, tp = shape
    if not 0 <= rank < pp * dp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {pp * dp * tp} ranks {shape}")
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def coords_to_rank(coords: tuple[int, int, int], shape: tuple[int, int, int]) -> int:
    """Global rank of (pp_i, dp_i, tp_i): `(pp_i * dp + dp_i) * tp + tp_i`.

    Raises:
        ValueError: if a coordinate is outside its axis.
    """
    for c, n, axis in zip(coords, shape, AXES):
        if not 0 <= c < n:
            raise ValueError(f"{axis} coordinate {c} is outside [0, {n})")
    pp_i, dp_i, tp_i = coords
    _, dp, tp = shape
    return (pp_i * dp + dp_i) * tp + tp_i


# ----------------------------------------------------------------------------- process groups


def init_distributed(backend: str | None = None, timeout_s: float = 600) -> None:
    """Initialise the default process group from torchrun's env vars (no-op if already done).

    NCCL on CUDA, gloo on CPU unless `backend` says otherwise. Without WORLD_SIZE
    (plain `python -m ...`) or with WORLD_SIZE=1, a 1-rank group is created on an
    in-memory HashStore: no port, no MASTER_ADDR, and the rest of the code runs
    unchanged. Under torchrun's shared agent store, the group's keys live in a
    namespace of this restart attempt (`elastic_attempt_store`), so a group
    restarted by `--max-restarts` connects instead of failing on the dead
    attempt's keys. NCCL's async error handling and flight recorder are switched on
    unless the environment says otherwise (`nccl_debug_defaults`).

    Args:
        backend: "nccl", "gloo" or None (pick by device).
        timeout_s: collective timeout in seconds.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        for key, value in nccl_debug_defaults().items():
            os.environ.setdefault(key, value)
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=timeout_s)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    store = elastic_attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank = int(os.environ["RANK"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def nccl_debug_defaults() -> dict[str, str]:
    """NCCL settings that make a hang or a dead peer an error with a record, not a silent stall.

    Async error handling aborts the communicator when a collective times out (the
    process exits and torchrun can restart the group) instead of blocking forever;
    the flight recorder keeps the last collectives of every rank and dumps them on
    a timeout (`TORCH_NCCL_DEBUG_INFO_TEMP_FILE` + rank, /tmp/nccl_trace_rank_<r> by
    default; `python -m torch.distributed.flight_recorder.fr_trace` reads them).
    Applied with `os.environ.setdefault`, so a value the user set wins.
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def elastic_attempt_store(timeout: timedelta) -> dist.Store | None:
    """The default group's store under torchrun's shared agent store: a namespace per restart attempt.

    Why: torchrun's c10d rendezvous hands the workers the agent's own TCPStore
    (TORCHELASTIC_USE_AGENT_STORE=True, since torch 2.5), and that store outlives the
    workers. After `--max-restarts` restarts the group, the dead attempt's keys are
    still there: gloo's full-mesh connect reads a peer's address key, gets the dead
    process's address when the new peer has not overwritten it yet, and fails with
    "connectFullMesh ... Connection refused" (NCCL reads a stale unique id the same
    way). pytorch/pytorch#135712 describes it; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on
    the agent avoids it (a fresh store per attempt, what scripts/launch_multinode.sh
    sets). For plain `torchrun` the worker prefixes every key with
    TORCHELASTIC_RESTART_COUNT, so each attempt's keys are new.

    The count is each agent's own: on one node it is always the same for all
    workers; across nodes it agrees when every node's workers fail with the dead one
    (gloo does at once), but an agent whose workers were still healthy (e.g. blocked
    in NCCL) restarts them without counting, and the group would then wait on two
    namespaces until `timeout`. Multi-node jobs with restarts should therefore set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launcher does; `init_distributed`
    warns when they do not.

    Args:
        timeout: the store's timeout (the collective timeout).

    Returns:
        A PrefixStore over a client of the agent's store, or None when the agent does not
        share its store (then `init_process_group`'s env:// rendezvous is used as usual).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes > 1 and restarts > 0 and os.environ.get("RANK") == "0":
        logger.warning(
            "torchrun --max-restarts over several nodes with the shared agent TCPStore: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (scripts/launch_multinode.sh does) so "
            "that a restarted group cannot wait on two restart counts"
        )
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"polyglot3d/attempt{attempt}/default_pg", client)


@dataclass
class ParallelMesh:
    """The DeviceMesh with named axes, this rank's coordinates, and pp subgroups.

    Build it with `build_mesh` (collective); every method here is local.
    """

    dims: ParallelDims
    device_mesh: DeviceMesh
    coords: tuple[int, int, int]
    expert_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp), when ep > 1
    _pp_subgroups: dict[tuple[int, ...], ProcessGroup] = field(default_factory=dict, repr=False)
    _sub_meshes: dict[MeshKey, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def ep_rank(self) -> int:
        """Position in this rank's ep group: its experts are [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return self.dp_rank % self.dims.ep

    @property
    def edp_rank(self) -> int:
        """Position in this rank's expert-data-parallel group."""
        return self.dp_rank // self.dims.ep

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return coords_to_rank(self.coords, self.dims.shape)

    def __getitem__(self, axis: MeshKey) -> DeviceMesh:
        """The sub-mesh of `axis` (or of several (pp, dp, tp) axes) that holds this rank; "edp" is the
        dp sub-mesh when ep is 1; "ep" exists only when ep > 1. Made once per key: DeviceMesh slices
        anew at each `[]` (~1.5 ms; a checkpoint wraps every tp-sharded tensor in one)."""
        if axis not in self._sub_meshes:
            self._sub_meshes[axis] = self._slice(axis)
        return self._sub_meshes[axis]

    def _slice(self, axis: MeshKey) -> DeviceMesh:
        if isinstance(axis, tuple) or axis in AXES:
            return self.device_mesh[axis]
        if self.expert_mesh is not None:
            return self.expert_mesh[axis]
        if axis == "edp":  # ep == 1: the replicas holding the same experts are the dp replicas
            return self.device_mesh["dp"]
        raise ValueError("the 'ep' axis exists only when expert_parallel_size > 1")

    def group(self, axis: Axis) -> ProcessGroup:
        """The process group of this rank along `axis` ("ep" only when ep > 1)."""
        if axis in AXES:
            return self.device_mesh.get_group(axis)
        return self[axis].get_group()

    def size(self, axis: Axis) -> int:
        return self.dims.size(axis)

    def axis_rank(self, axis: Axis) -> int:
        """This rank's coordinate along `axis`."""
        if axis == "ep":
            return self.ep_rank
        if axis == "edp":
            return self.edp_rank
        return self.coords[AXES.index(axis)]

    def pp_peer(self, stage_rank: int) -> int:
        """Global rank of pipeline rank `stage_rank` with this rank's (dp, tp) coordinates (for p2p)."""
        return coords_to_rank((stage_rank, self.dp_rank, self.tp_rank), self.dims.shape)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def pp_subgroup(self, pp_ranks: Sequence[int]) -> ProcessGroup | None:
        """Group of the given pipeline ranks that share this rank's (dp, tp) coordinates.

        Used for the tied embedding's all-reduce between the first and the last stage. The first
        call for a given `pp_ranks` is **collective**: every rank of the world must make it, in the
        same order, because `new_group` is (each call creates the groups of all dp x tp columns).
        `build_mesh` creates the first/last-stage group up front, so `pp_subgroup((0, pp - 1))` is
        always local.

        Args:
            pp_ranks: pipeline coordinates, e.g. (0, pp - 1).

        Returns:
            The group if this rank's pp coordinate is in `pp_ranks`, else None.

        Raises:
            ValueError: on an out-of-range or repeated pipeline rank.
        """
        key = tuple(sorted(set(pp_ranks)))
        if len(key) != len(pp_ranks) or any(not 0 <= p < self.dims.pp for p in key):
            raise ValueError(f"pp_ranks {list(pp_ranks)} must be distinct values in [0, {self.dims.pp})")
        if key not in self._pp_subgroups:
            _, dp, tp = self.dims.shape
            for dp_i in range(dp):
                for tp_i in range(tp):
                    ranks = [coords_to_rank((p, dp_i, tp_i), self.dims.shape) for p in key]
                    group = dist.new_group(ranks)  # every rank calls, member or not
                    if (dp_i, tp_i) == (self.dp_rank, self.tp_rank):
                        self._pp_subgroups[key] = group
        return self._pp_subgroups[key] if self.pp_rank in key else None


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> ParallelMesh:
    """Create the (pp, dp, tp) DeviceMesh and its groups, and with ep > 1 the (pp, edp, ep, tp)
    view of the same ranks with its ep and edp groups (collective: all ranks call it).

    Args:
        dims: sizes; validated here again (pure) before any collective.
        device_type: "cpu" or "cuda".

    Returns:
        The ParallelMesh of this rank.

    Raises:
        ParallelConfigError: if the sizes do not fit the world (see `ParallelDims.validate`).
        RuntimeError: if torch.distributed is not initialised (call `init_distributed`).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call parallel.mesh.init_distributed() first"
        )
    world = dist.get_world_size()
    if dims.world_size != world:
        raise ParallelConfigError(f"ParallelDims.world_size({dims.world_size}) != WORLD_SIZE({world})")
    dims.validate()
    device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
    for axis in AXES:  # create the sub-groups now, collectively, not lazily on first use
        device_mesh.get_group(axis)
    expert_mesh = None
    if dims.ep > 1:  # dp split into (edp, ep), ep inner: an ep group is ep consecutive replicas
        expert_mesh = device_mesh._unflatten(1, (dims.edp, dims.ep), ("edp", "ep"))
        for axis in ("edp", "ep"):
            expert_mesh.get_group(axis)
    coords = rank_to_coords(dist.get_rank(), dims.shape)
    mesh = ParallelMesh(dims=dims, device_mesh=device_mesh, coords=coords, expert_mesh=expert_mesh)
    mesh.pp_subgroup((0, dims.pp - 1) if dims.pp > 1 else (0,))
    return mesh
