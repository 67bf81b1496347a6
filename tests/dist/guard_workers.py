"""Workers for the divergence-guard and preemption tests: the real trainer (`trainer.train.run`),
with faults injected from outside the guard.

Faults are real values in the real step, placed where a real failure would put them:
a NaN loss sum on the last stage only (forward overflow), a NaN gradient on the first
stage only (backward overflow), a NaN parameter after the optimizer (a bad update), and
a SIGTERM delivered to one rank only. The guard is never replaced or told anything.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch

Fault = Callable[[int, int, Any, Any], None]  # (step, rank, parallel model, flush results) -> None


class _Injector:
    """Wraps `ParallelModel.train_step` and `.after_optimizer_step` in this process to run faults.

    `step` counts this run's calls of `train_step` (a fresh run: the trainer's step number).
    `snapshots[step]` holds this rank's parameters as they were when step `step` began.
    """

    def __init__(self, before_guard: dict[int, Fault], after_update: dict[int, Fault]) -> None:
        from parallel.parallelize import ParallelModel

        self.cls, self.step = ParallelModel, 0
        self.before_guard, self.after_update = before_guard, after_update
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.adam_steps: dict[int, float] = {}
        self.original = (ParallelModel.train_step, ParallelModel.after_optimizer_step)

    def __enter__(self) -> _Injector:
        import torch.distributed as dist

        train_step, after = self.original
        rank = dist.get_rank()
        injector = self

        def wrapped_train_step(pm: Any, *args: Any, **kwargs: Any) -> Any:
            injector.step += 1
            injector.snapshots[injector.step] = {n: p.detach().clone() for n, p in pm.model.named_parameters()}
            results = train_step(pm, *args, **kwargs)
            fault = injector.before_guard.get(injector.step)
            if fault is not None:
                fault(injector.step, rank, pm, results)
            return results

        def wrapped_after(pm: Any) -> None:
            after(pm)
            fault = injector.after_update.get(injector.step)
            if fault is not None:
                fault(injector.step, rank, pm, None)

        self.cls.train_step = wrapped_train_step  # type: ignore[method-assign]
        self.cls.after_optimizer_step = wrapped_after  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cls.train_step, self.cls.after_optimizer_step = self.original  # type: ignore[method-assign]


def nan_loss_on_last_stage(step: int, rank: int, pm: Any, results: Any) -> None:
    """A non-finite loss where only the last pipeline stage can see it (its grads stay finite)."""
    if pm.mesh.pp_rank == pm.mesh.size("pp") - 1:
        for r in results:
            if r.loss_sum is not None:
                r.loss_sum = r.loss_sum * float("nan")


def nan_grad_on_first_stage(step: int, rank: int, pm: Any, results: Any) -> None:
    """One NaN in one gradient of the first stage (after clipping, as an overflow in backward would be)."""
    if pm.mesh.pp_rank == 0:
        p = next(q for q in pm.model.parameters() if q.grad is not None)
        p.grad.view(-1)[0] = float("nan")  # before the trainer's norm and clip, which run next


def sigterm_to_this_rank_if_first(step: int, rank: int, pm: Any, results: Any) -> None:
    """SIGTERM delivered to rank 0 only, mid-step (before the guard's check)."""
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)


def nan_param_on_last_rank(step: int, rank: int, pm: Any, results: Any) -> None:
    """A NaN in one parameter of the last rank after the update (a bad optimizer step)."""
    import torch.distributed as dist

    if rank == dist.get_world_size() - 1:
        with torch.no_grad():
            next(pm.model.parameters()).view(-1)[0] = float("nan")


def step_with_device_reads(step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """`step_fn(*args, **kwargs)` (`trainer.run.step.train_step`) and the device reads it made.

    CPU AdamW reads its host-side step counters (`.item()` per parameter); on CUDA it is fused
    and reads nothing, so those reads are not counted as the step's device reads.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from parallel.dispatch_count import DispatchCounter

    optimizer = args[1]
    adamw_step = optimizer.step

    def uncounted_adamw_step() -> Any:
        with _disable_current_modes():
            return adamw_step()

    optimizer.step = uncounted_adamw_step
    try:
        with DispatchCounter() as c:
            st = step_fn(*args, **kwargs)
    finally:
        del optimizer.step
    return st, c.host_reads


def _history(summary_or_hist: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in summary_or_hist if "lr" in r]


def guard_cases(rank: int, world: int, base: dict[str, Any]) -> dict[str, Any]:
    """Every in-process scenario on one 2-rank pp=2 group; returns per scenario what the test checks."""
    import logging

    import datasets
    import torch.distributed as dist

    from trainer.config.parse import load_config_dict
    from trainer.run import loop as train
    from trainer.run.guard import DivergenceError, Preempted

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.ERROR)
    out: dict[str, Any] = {}
    tracker_rows: list[dict[str, Any]] = []

    def run(name: str, before_guard: dict[int, Fault] | None = None, after_update: dict[int, Fault] | None = None,
            **overrides: Any) -> tuple[Any, _Injector]:  # fmt: skip
        values = {**base, "output_dir": f"{base['output_dir']}-{name}", **overrides}
        tracker_rows.clear()
        with _Injector(before_guard or {}, after_update or {}) as inj:
            try:
                result: Any = train.run(load_config_dict(values))
            except (DivergenceError, Preempted) as e:
                result = e
        dist.barrier()
        return result, inj

    # The rows the logging rank wrote, also when the run ended with an exception.
    original_log = train.Tracker.log

    def log(self: Any, row: dict[str, Any]) -> None:
        original_log(self, row)
        if self.enabled:
            tracker_rows.append(dict(row))

    train.Tracker.log = log  # type: ignore[method-assign]

    # 1. Uninterrupted, and the device reads of one whole guarded step (step 4).
    counted: list[int] = []
    original_step = train.train_step

    def counting_step(*args: Any, **kwargs: Any) -> Any:
        if args[6] != 4:  # positional `step`; step 4 is past the timeline step
            return original_step(*args, **kwargs)
        st, reads = step_with_device_reads(original_step, *args, **kwargs)
        counted.append(reads)
        return st

    train.train_step = counting_step  # type: ignore[assignment]
    summary, _ = run("straight")
    train.train_step = original_step  # type: ignore[assignment]
    out["straight"] = [(r["step"], r["loss"]) for r in _history(tracker_rows)]
    base = {**base, "tokenizer_name": f"{base['output_dir']}-straight/tokenizer"}  # trained once
    out["reads_in_guarded_step"] = counted

    # 2. SIGTERM to rank 0 only during step 3: both ranks save checkpoint-3 and raise Preempted.
    err, _ = run("preempt", before_guard={3: sigterm_to_this_rank_if_first})
    out["preempt"] = (type(err).__name__, getattr(err, "step", None), getattr(err, "signum", None),
                      str(err), [r["step"] for r in _history(tracker_rows)])  # fmt: skip

    # 3. Resume the preempted run in place: steps 4.. must equal the uninterrupted run's.
    summary, _ = run("preempt", resume_from_checkpoint="latest", overwrite_output_dir=False)
    out["resumed"] = [(r["step"], r["loss"]) for r in _history(tracker_rows)]

    # 3b. SIGTERM to rank 0 only while the step-2 evaluation runs: it finishes, then step 2 is saved.
    from trainer.eval.runner import Evaluator

    evaluate = Evaluator.run

    def signalled_evaluate(self: Any, step: int, tracker: Any = None) -> dict[str, Any]:
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, step, tracker)

    Evaluator.run = signalled_evaluate  # type: ignore[method-assign]
    err, _ = run("preempt-eval", eval_steps=2, max_steps=4)
    Evaluator.run = evaluate  # type: ignore[method-assign]
    out["preempt_eval"] = (type(err).__name__, getattr(err, "step", None), str(err),
                           [(r["step"], "eval_loss" in r) for r in tracker_rows])  # fmt: skip

    # 4. nan_policy=skip: a loss NaN seen by the last stage only (step 2), then grad NaNs seen by
    #    the first stage only at steps 4, 5, 6 with at most 2 in a row: steps 2, 4, 5 are skipped,
    #    step 6 stops.
    faults = {2: nan_loss_on_last_stage, 4: nan_grad_on_first_stage, 5: nan_grad_on_first_stage,
              6: nan_grad_on_first_stage}  # fmt: skip
    err, inj = run("skip", before_guard=faults, nan_policy="skip", nan_max_consecutive_skips=2, max_steps=8)
    unchanged = {
        s: all(torch.equal(inj.snapshots[s][n], inj.snapshots[s + 1][n]) for n in inj.snapshots[s])
        for s in (1, 2, 3, 4, 5)
    }
    out["skip"] = (type(err).__name__, str(err), unchanged, _history(tracker_rows))

    # 5. nan_policy=stop with learning_rate 1e6 (diverges at step 3 by itself), saving every step.
    err, _ = run("stop", learning_rate=1e6, save_steps=1, max_steps=6)
    out["stop"] = (type(err).__name__, str(err), [r["step"] for r in _history(tracker_rows)])

    # 6. A NaN parameter on the last rank after step 2's update: the save at step 2 is refused.
    err, _ = run("refuse", after_update={2: nan_param_on_last_rank}, save_steps=2, max_steps=4)
    out["refuse"] = (type(err).__name__, str(err))
    return out
