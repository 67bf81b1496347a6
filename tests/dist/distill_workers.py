"""Workers of tests/dist/test_distill.py: word-level distillation through the real trainer.

`make_teachers` writes a random NLLB-MoE teacher as an HF directory on a run's tokenizer;
`distill_cases` trains each case and returns, per case, the logging rank's [(step, loss,
grad_norm, label_loss, kd_loss)] and, from every rank, whether its teacher shard ended the run as
it was loaded (and as an HF teacher's files hold it), bit for bit; `vocab_parallel_kd` checks the
vocab-parallel loss on tp groups of the world against the full-vocabulary reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MOE = dict(d_model=64, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_experts=4,
           encoder_sparse_step=2, decoder_sparse_step=2, moe_token_dropout=0.0)  # fmt: skip


def make_teachers(tokenizer_dir: str, out: str) -> dict[str, str]:
    """A random NLLB-MoE teacher, deeper than the student (its own stage split), init std 0.2
    (opinionated distributions), on the run's tokenizer, as an HF directory with the tokenizer's HF
    files; returns {"moe": its path}."""
    import torch

    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.tokenizer.vocab import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    paths = {}
    for name, arch in (("moe", MOE),):
        mc = ModelConfig(vocab_size=tok.vocab_size, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         init_std=0.2, max_position_embeddings=256, **arch, **tok.special_ids())  # type: ignore[arg-type]  # fmt: skip
        path = Path(out) / f"teacher-{name}"
        save_hf_model(M2M100Translation(mc, seed=7).state_dict(), mc, path)
        tok.save_pretrained(path)
        paths[name] = str(path)
        torch.manual_seed(0)
    return paths


def _teacher_unchanged(loss: Any, path: str, loaded: dict[str, Any]) -> bool:
    """This rank's teacher shard ends the run as it was loaded, bit for bit, and as an HF teacher's
    files hold it (fp32 run); frozen, in eval mode."""
    import torch

    from models.hf import read_hf_slices
    from parallel.materialize import local_slices

    pm = loss.teacher.pm
    params = dict(pm.model.named_parameters())
    same = all(torch.equal(params[name], value) for name, value in loaded.items())
    if not (Path(path) / "trainer_state.json").is_file():
        tp = pm.tp_info
        parts = local_slices(pm.model, tp.tp_size if tp else 1, tp.tp_rank if tp else 0)
        same = same and all(torch.equal(params[n], v) for n, v in read_hf_slices(path, parts, pm.model.config))
    frozen = not any(p.requires_grad for p in params.values()) and not pm.model.training
    return same and frozen


def distill_cases(
    rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]], kd_tp: int = 0
) -> list[Any]:
    """Train each case (base + overrides); per case (history on the logging rank or None, and this
    rank's teacher check: None without a teacher). `kd_tp` > 0: first `vocab_parallel_kd` on tp
    groups of that size, its error appended last (one group for both)."""
    import logging

    import datasets

    import trainer.run.setup as setup
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    built: list[Any] = []
    original = setup.build_teacher

    def capture(*args: Any, **kwargs: Any) -> Any:
        loss = original(*args, **kwargs)
        built.append((loss, {n: p.detach().clone() for n, p in loss.teacher.pm.model.named_parameters()}))
        return loss

    setup.build_teacher = capture  # type: ignore[assignment]
    kd_error = vocab_parallel_kd(rank, world, kd_tp) if kd_tp else None
    out: list[Any] = []
    try:
        for i, case in enumerate(cases):
            built.clear()
            values = {**base, **case, "output_dir": case.get("output_dir", f"{base['output_dir']}-{i}")}
            summary = run(load_config_dict(values))
            keys = ("step", "loss", "grad_norm", "label_loss", "kd_loss")
            hist = [tuple(r.get(k) for k in keys) for r in summary.get("history") or [] if "loss" in r]
            check = _teacher_unchanged(*built[0][:1], values["teacher_model_name_or_path"], built[0][1]) if built else None
            out.append((hist or None, check))
    finally:
        setup.build_teacher = original  # type: ignore[assignment]
    return out + ([kd_error] if kd_tp else [])


def vocab_parallel_kd(rank: int, world: int, tp: int) -> float:
    """Max relative error of the vocab-parallel loss (tp groups of `tp` consecutive ranks, V = 53:
    padded columns on the last rank) against the full-vocabulary reference, values and gradient, fp64."""
    import torch
    import torch.distributed as dist

    from parallel.distill.loss import DistillSettings, VocabSlice, distillation_loss_sum
    from parallel.tp.layers import vocab_partition
    from tests.unit.test_distill_loss import inputs, reference

    groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, world, tp)]
    group, r = groups[rank // tp], rank % tp
    v = 53
    _, start, end = vocab_partition(v, tp, r)
    worst = 0.0
    for cfg in (DistillSettings(0.5, 2.0, 0.1), DistillSettings(1.0)):
        s, h, w, labels = inputs(torch.float64, v=v, seed=rank // tp)
        want_s = s.clone().requires_grad_(True)
        want = reference(want_s, h, w, labels, cfg)
        want[0].backward()
        pad = end - start - max(0, min(end, v) - start)  # padded columns of this rank
        fill = torch.finfo(s.dtype).min
        local = torch.cat([s[:, start:min(end, v)], torch.full((s.shape[0], pad), fill, dtype=s.dtype)], 1)
        w_local = torch.cat([w[start:min(end, v)], torch.zeros(pad, w.shape[1], dtype=w.dtype)])
        leaf = local.clone().requires_grad_(True)
        got = distillation_loss_sum(leaf * 1.0, h, w_local, labels, cfg, VocabSlice(group, start, v))
        got[0].backward()
        for a, b in zip(got, want):
            worst = max(worst, abs(float(a.detach()) - float(b.detach())) / abs(float(b.detach())))
        grad = leaf.grad[:, : min(end, v) - start]
        worst = max(worst, float((grad - want_s.grad[:, start:min(end, v)]).abs().max()))
        assert not leaf.grad[:, min(end, v) - start :].any(), "a padded column got a gradient"
    return worst
