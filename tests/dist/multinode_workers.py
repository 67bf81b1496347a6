"""Placement probe for multi-node launches: where does each rank of the (pp, dp, tp) mesh live?

Run under torchrun (one torchrun per node; here two "nodes" on one machine):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        --rdzv-id probe tests/dist/multinode_workers.py --out DIR --pp 2 --tp 2

or `python -m tests.dist.multinode_workers --out DIR ...` under the same torchrun
flags (`torchrun ... -m tests.dist.multinode_workers ...`). Each rank initialises
the gloo process group, builds the mesh with `parallel.mesh.build_mesh`, checks
that its tp group really connects its mesh neighbours (an all-gather of global
ranks over the tp group) and writes `DIR/rank<R>.json` with its global rank,
LOCAL_RANK, GROUP_RANK (node id), LOCAL_WORLD_SIZE, hostname, pp/dp/tp
coordinates, the members of its tp/pp/dp groups, and the error the trainer's
size check raises for tp = WORLD_SIZE (larger than a node).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from parallel.mesh import AXES, ParallelDims, build_mesh, init_distributed
from trainer.config.dims import parallel_dims


def probe(out_dir: Path, pp: int, tp: int, dp: int = -1) -> dict[str, object]:
    """Build the mesh on the initialised world and describe this rank (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(
        pp=pp, dp=dp, tp=tp, world_size=world, local_world_size=int(os.environ["LOCAL_WORLD_SIZE"])
    ).validate()
    mesh = build_mesh(dims, "cpu")
    groups = {axis: dist.get_process_group_ranks(mesh.group(axis)) for axis in AXES}
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dims.tp)]
    dist.all_gather(gathered, torch.tensor([rank]), group=mesh.group("tp"))
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "hostname": socket.gethostname(),
        "mesh_shape": list(dims.shape),
        "coords": {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.tp_rank},
        "groups": groups,
        "tp_all_gather": [int(t.item()) for t in gathered],
        "tp_across_nodes_error": _tp_across_nodes_error(world),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.rename(out_dir / f"rank{rank}.json")
    dist.barrier()
    return record


def _tp_across_nodes_error(world: int) -> str | None:
    """The trainer's own check (`parallel_dims(...).validate()`, LOCAL_WORLD_SIZE from
    torchrun's environment) for tp = the whole world: the message it raises, or None if accepted."""
    args = SimpleNamespace(
        pipeline_parallel_size=1,
        data_parallel_size=-1,
        tensor_parallel_size=world,
        expert_parallel_size=1,
        allow_tp_across_nodes=False,
    )
    try:
        parallel_dims(args, world_size=world).validate()  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<R>.json")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=-1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=120)
    try:
        probe(args.out, args.pp, args.tp, args.dp)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
