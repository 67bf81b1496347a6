"""Spawn a gloo process group on CPU for a test, loudly and never hanging.

    results = run_distributed(worker, world_size=4, args=(cfg,), timeout=180)

`worker(rank, world_size, *args)` must be a module-level function (it is pickled by
reference). Ranks start from a forkserver that imported torch, transformers and the trainer
once (`TRAINER_PRELOAD`), instead of fresh interpreters that each import them (seconds per
rank on 2 cores: an empty 8-rank group took 22 s, now 4 s); `preload=()` spawns fresh
interpreters instead. The first forkserver of the process fixes its preload and its own
environment, so each rank is handed the caller's environment at the call (plus `env`), as a
spawned one would inherit it; preload only modules whose threads (if any) survive a fork.

Each rank gets WORLD_SIZE/RANK/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_* in its environment, an initialised gloo default group with a collective timeout,
and its return value is sent back (must be picklable). A rank that raises makes
the whole call raise with that rank's traceback; a group that does not finish
within `timeout` seconds is killed and the call raises TimeoutError.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

# What a group running the trainer preloads (`preload=`): torch, transformers, the trainer and what a
# run imports on first use: `datasets` (with pandas and pyarrow), the built-in corpus's CLDR data,
# matplotlib for curves.png, `AutoTokenizer` for an HF tokenizer directory (transformers works out
# its lazy import structure on first use: 0.7 CPU-s a process after the rest); together three
# seconds of CPU per rank on 2 cores. Only pyarrow starts a
# thread at import (jemalloc's background thread, fork-safe: datasets' own `map(num_proc=)` forks
# with it). Then tests/dist/frozen.py freezes the collector's view of them. tests/served.py's server
# preloads the same.
TRAINER_PRELOAD = ("torch", "transformers", "trainer.run.loop", "trainer.config.parse", "datasets",
                   "trainer.data.corpus", "matplotlib.figure", "matplotlib.backends.backend_agg",
                   "transformers.models.auto.tokenization_auto", "tests.dist.frozen")  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    queue: Any,
    collective_timeout: float,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": env.get("LOCAL_WORLD_SIZE", str(world_size)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
        )
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout: float = 240,
    env: dict[str, str] | None = None,
    collective_timeout: float = 90,
    preload: Sequence[str] = TRAINER_PRELOAD,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
        TimeoutError: the group did not finish in `timeout` seconds (all ranks are killed).
    """
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(list(preload))
        env = {**os.environ, **(env or {})}  # the forkserver's environment is the first caller's
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, args, env or {}, queue, collective_timeout),
            daemon=False,  # a rank may start processes of its own (data-loader workers); `finally` kills it
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed test did not finish in {timeout}s; ranks done: {sorted(results)}"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and p.exitcode not in (0, None)
                ]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
