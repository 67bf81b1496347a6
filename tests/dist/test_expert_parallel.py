"""Expert parallelism (ep) equals one process: the real trainer on NLLB-MoE meshes, below it every
schedule / remat / sharding family, checkpoints resharded across ep, and a `transformers`
checkpoint fine-tuned on (pp 2, ep 2) and exported back.

Trainer (configs/tiny_moe.yaml: 8 experts in every 2nd layer; dropout and expert output masking
off; 5 steps of 16 pairs): per-step loss and grad norm match one process within 1e-4 relative
(the goal; measured ~1e-7 without tp, ~1e-6 with it):

    dropless, router_aux_loss_coef 0     against the unsplit batch (any grouping routes alike)
    aux loss 0.01 and capacity drops     against one process with the same 4 micro-batches
                                         (the same routing groups: slots of the global batch)

on (pp 2, dp 2, ep 2) with 1F1B and ZB-V and on (pp 2, tp 2, dp 2, ep 2) with ZB-V; evaluation
at the end runs through the mesh (eval loss, and BLEU/chrF decoded on pp x ep (x tp), the ep
peers decoding together) and equals one process's; `trainer.translate --model DIR` on
(pp 2, tp 2, dp 2, ep 2) writes the lines one process writes for a `save_pretrained` NllbMoe.

A random `NllbMoeForConditionalGeneration` saved by `save_pretrained` as sharded safetensors
(with the run's tokenizer) fine-tunes on (pp 2, dp 2, ep 2): its step-0 eval loss equals stock
`transformers`' on the same batches (each rank read only its experts), and `trainer.export` of
the ep-trained checkpoint writes a directory `transformers` loads, whose loss equals the
trainer's last eval loss. (transformers 5.x's NllbMoe combine is broken upstream: the stock
model runs with 4.57.6's combine patched in, tests/unit/test_hf_nllb_moe.py.)

Below the trainer (`tests/dist/expert_workers.py`; a 4-expert model built stage- and
expert-locally, 3 AdamW steps, one process computed on each rank): ZB-V with full remat and
keyed routing randomness (`sampling` second expert, expert output masking), interleaved 1F1B
with stage remat and the aux loss, tp over the experts' FFN dim with sequence parallelism,
the all-to-all dispatcher alone where ranks send or receive nothing,
ZeRO-1 with capacity drops and FSDP over edp (with and without a pipeline), within 1e-5; and a DCP checkpoint of a
(dp 4, ep 2) run (per-expert transformers names, AdamW state) resuming on ep 4, on pp x tp
with ep 1, on tp x ep with ZeRO-1 and on FSDP.

Three spawned groups (1, 4 and 8 ranks) run the whole module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dist.expert_workers import Case, group_run, trainer_and_translate, trainer_cases
from tests.dist.harness import run_distributed
from tests.dist.test_export import ENV, stock_eval_loss
from tests.dist.train_workers import mesh_overrides as mesh

ROOT = Path(__file__).resolve().parents[2]
TOL, TOL_BELOW = 1e-4, 1e-5
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

DROPLESS = {"moe_dropless": True, "router_aux_loss_coef": 0.0}
AUX_CAPACITY = {"moe_dropless": False, "moe_capacity_factor": 0.5, "router_aux_loss_coef": 0.01}
EVAL = {"do_eval": True, "eval_steps": 0}
EP2 = {"expert_parallel_size": 2}

BELOW = {
    "pp2-dp2-ep2-zbv-full-remat-capacity-aux-sampling-eom": Case(
        pp=2,
        dp=2,
        ep=2,
        schedule="zbv",
        remat="full",
        dropless=False,
        aux=0.01,
        model={"second_expert_policy": "sampling", "moe_token_dropout": 0.2},
    ),
    "pp2-dp2-ep2-interleaved-stage-remat-aux": Case(
        pp=2, dp=2, ep=2, schedule="interleaved_1f1b", remat="stage", aux=0.01
    ),
    "dp2-tp2-ep2-sequence-parallel-aux": Case(dp=2, tp=2, ep=2, sequence_parallel=True, aux=0.01),
    "dp4-ep2-zero1-capacity": Case(dp=4, ep=2, m=1, sharding="zero1", dropless=False, capacity_factor=0.5),
    "dp4-ep4-fsdp-gpipe": Case(dp=4, ep=4, schedule="gpipe", sharding="fsdp"),
    "dp4-ep2-fsdp-aux-capacity": Case(dp=4, ep=2, sharding="fsdp", dropless=False, aux=0.01),  # edp 2
    "pp2-dp2-ep2-fsdp-interleaved": Case(pp=2, dp=2, ep=2, schedule="interleaved_1f1b", sharding="fsdp"),
}
RESHARD_FROM = Case(dp=4, ep=2, m=1)
RESHARD = {
    "dp4-ep4": Case(dp=4, ep=4, m=1),
    "pp2-tp2-ep1": Case(pp=2, tp=2, m=2),
    "dp2-tp2-ep2-zero1": Case(dp=2, tp=2, ep=2, sharding="zero1"),
    "dp4-ep2-fsdp": Case(dp=4, ep=2, m=1, sharding="fsdp"),
}


def base(tmp: Path, **extra: Any) -> dict[str, Any]:
    values = yaml.safe_load((ROOT / "configs" / "tiny_moe.yaml").read_text())
    values.update(
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        moe_token_dropout=0.0,
        builtin_size=400,
        max_steps=5,
        do_eval=False,
        max_eval_samples=8,
        generation_max_length=8,
        generation_num_beams=1,
        learning_rate=3e-3,
        warmup_steps=1,
        plots=False,
        output_dir=str(tmp / "run"),
    )
    values.update(extra)
    return values


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """One process: dropless over the unsplit batch, and the aux loss with capacity over 4
    micro-batches (the meshes' routing groups), both evaluated at the start and the end."""
    tmp = tmp_path_factory.mktemp("moe_ref")
    values = base(tmp)
    cases = [mesh(**DROPLESS, **EVAL), mesh(m=4, **AUX_CAPACITY, **EVAL)]
    [hists] = run_distributed(trainer_cases, 1, args=(values, cases), timeout=300, env=ENV)
    values["tokenizer_name"] = str(tmp / "run-0" / "tokenizer")
    return values, hists


@pytest.fixture(scope="module")
def group4(reference, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 4-rank group: trainer runs on (pp 2, dp 2, ep 2), the HF fine-tune, the checks below the trainer."""
    tmp = tmp_path_factory.mktemp("ep4")
    values = {**reference[0], "output_dir": str(tmp / "run")}
    hf_dir = _stock_nllb_moe(tmp, values)
    runs = [
        mesh(pp=2, dp=2, **EP2, **DROPLESS, **EVAL),
        mesh(pp=2, dp=2, m=2, pipeline_schedule="zbv", **EP2, **AUX_CAPACITY),
        mesh(pp=2, dp=2, **EP2, **EVAL, max_steps=2, model_name_or_path=str(hf_dir), tokenizer_name=None),
    ]
    args = (str(tmp), values, runs, list(BELOW.values()), RESHARD_FROM, list(RESHARD.values()))
    results = run_distributed(group_run, 4, args=args, timeout=900, env=ENV, collective_timeout=300)
    hf_values = {**values, **runs[2], "output_dir": f"{values['output_dir']}-2"}
    return {"results": results, "hf_dir": hf_dir, "hf_values": hf_values, "tmp": tmp}


def _rows(results: list[Any], i: int) -> list[dict[str, Any]]:
    return next(r[i] for r in results if r[i])  # the logging rank's (the others: empty)


def _check(name: str, got: list[dict[str, Any]], ref: list[dict[str, Any]], evaluated: bool = False) -> None:
    a = [(r["step"], r["loss"], r["grad_norm"]) for r in got if "loss" in r]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in ref if "loss" in r]
    assert [s for s, _, _ in a] == [1, 2, 3, 4, 5] == [s for s, _, _ in b], name
    err = max(max(abs(x[1] - y[1]) / abs(y[1]), abs(x[2] - y[2]) / abs(y[2])) for x, y in zip(a, b))
    print(f"{name:<40} max rel err (loss, grad norm) over 5 steps: {err:.1e}")
    assert err <= TOL, (name, err)
    if evaluated:
        ours, theirs = [r for r in got if "eval_loss" in r][-1], [r for r in ref if "eval_loss" in r][-1]
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5), name
        assert (ours["eval_bleu"], ours["eval_chrf"]) == (theirs["eval_bleu"], theirs["eval_chrf"]), name


def test_trainer_pp2_dp2_ep2_equals_one_process(reference, group4) -> None:
    _, (ref_dropless, ref_aux) = reference
    trained = [r["trainer"] for r in group4["results"]]
    _check("pp2-dp2-ep2-1f1b-dropless", _rows(trained, 0), ref_dropless, evaluated=True)
    _check("pp2-dp2-ep2-zbv-aux-capacity", _rows(trained, 1), ref_aux)
    assert any(r.get("moe_dropped", 0) > 0 for r in _rows(trained, 1)), "capacity dropped nothing"


def test_trainer_and_translate_on_pp2_tp2_dp2_ep2_equal_one_process(reference, tmp_path: Path) -> None:
    """The trainer on (pp 2, tp 2, dp 2, ep 2), then `trainer.translate --model DIR` on the same mesh
    for a `save_pretrained` NllbMoe directory: the lines one process writes (beam 2)."""
    import io

    from trainer.eval.hf_translate import TranslateArguments
    from trainer.eval.hf_translate import run as translate

    values, (_, ref_aux) = reference
    values = {**values, "output_dir": str(tmp_path / "run")}
    hf_dir = _stock_nllb_moe(tmp_path, values)
    runs = [mesh(pp=2, tp=2, dp=2, m=2, pipeline_schedule="zbv", **EP2, **AUX_CAPACITY, **EVAL)]
    flags = dict(model=str(hf_dir), source_lang="en", target_lang="de", num_beams=2, max_length=8,
                 batch_size=2, device="cpu")  # fmt: skip
    lines = ["one hundred and three", "twenty", "the fourth of May", "seven thousand"]
    mesh_flags = dict(flags, pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=2,
                      expert_parallel_size=2)  # fmt: skip
    results = run_distributed(trainer_and_translate, 8, args=(values, runs, mesh_flags, lines), timeout=600,
                              env=ENV, collective_timeout=300)  # fmt: skip
    _check("pp2-tp2-dp2-ep2-zbv-aux-capacity", _rows([r["trainer"] for r in results], 0), ref_aux, evaluated=True)
    one = io.StringIO()
    translate(TranslateArguments(**flags), io.StringIO("\n".join(lines) + "\n"), one)
    on_mesh = results[0]["translate"]
    print(f"trainer.translate on (pp2, tp2, dp2, ep2): {on_mesh.splitlines()}")
    assert on_mesh == one.getvalue() and len(on_mesh.splitlines()) == len(lines)


def test_hf_checkpoint_fine_tunes_on_pp2_ep2_and_exports(group4, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.nllb_moe import modeling_nllb_moe

    from tests.unit.test_hf_nllb_moe import _combine_4_57
    from trainer.export import main as export_main
    from trainer.tokenizer.stock_m2m100 import run_layout
    from trainer.tokenizer.vocab import Tokenizer

    monkeypatch.setattr(modeling_nllb_moe.NllbMoeExperts, "forward", _combine_4_57)
    values, hf_dir = group4["hf_values"], group4["hf_dir"]
    evals = [r for r in _rows([r["trainer"] for r in group4["results"]], 2) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2], evals
    stock = stock_eval_loss(hf_dir, values)
    print(f"HF import on (pp2, dp2, ep2): step-0 eval_loss {evals[0]['eval_loss']:.8f}, stock {stock:.8f}")
    assert evals[0]["eval_loss"] == pytest.approx(stock, rel=1e-5)
    ckpt = Path(values["output_dir"]) / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["mesh"] == {"pp": 2, "dp": 2, "tp": 1, "ep": 2}
    out = group4["tmp"] / "export"
    assert export_main(["--checkpoint", str(ckpt), "--output", str(out), "--max_shard_size", "100KB"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "nllb-moe"
    assert (out / "model.safetensors.index.json").is_file()
    layout = run_layout(Tokenizer.load(Path(values["output_dir"]) / "tokenizer"), state["model_config"]["vocab_size"])
    exported = stock_eval_loss(out, values, layout)
    print(f"ep-trained checkpoint exported: stock eval_loss {exported:.8f}, trainer {evals[-1]['eval_loss']:.8f}")
    assert exported == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert abs(evals[-1]["eval_loss"] - evals[0]["eval_loss"]) > 1e-4, "fine-tuning changed nothing"


def test_below_the_trainer_every_family_equals_one_process(group4) -> None:
    results = [r["meshes"] for r in group4["results"]]
    bad = []
    for i, (name, case) in enumerate(BELOW.items()):
        r = results[0][i]
        sent = [res[i]["bytes"] for res in results]
        print(f"{name:<56} max rel err {r['err']:.1e}  dropped {r['dropped']}  a2a bytes/rank {sent}")
        if max(res[i]["err"] for res in results) > TOL_BELOW:
            bad.append((name, r["got"], r["ref"]))
        assert any(sent), f"{name}: no token crossed the ep group"
        if not case.dropless:
            assert r["dropped"] > 0, f"{name}: capacity dropped nothing; the case tests nothing"
    assert not bad, bad


def test_dispatch_where_ranks_send_or_receive_nothing_equals_one_process(group4) -> None:
    """The all-to-all dispatcher alone (ep 4, both layouts) when a rank keeps no assignment, no rank
    routes to rank 0's experts, or no rank has a token: output and gradients as one process."""
    for rank, res in enumerate(group4["results"]):
        assert len(res["dispatch"]) == 8, res["dispatch"]
        for case, err in res["dispatch"].items():
            assert err <= TOL_BELOW, f"rank {rank}, {case}: {err}"


def test_checkpoint_reshards_across_expert_parallel_sizes(group4) -> None:
    """A DCP checkpoint of a (dp 4, ep 2) run loads on ep 4, ep 1 (pp x tp), tp x ep with ZeRO-1
    and FSDP over edp: step 3 continues as the uninterrupted run."""
    for i, name in enumerate(RESHARD):
        err = max(r["reshard"][i] for r in group4["results"])
        print(f"resume {name:<20} step 3 vs uninterrupted: max rel err {err:.1e}")
        assert err <= TOL_BELOW, (name, err)


def _stock_nllb_moe(tmp: Path, values: dict[str, Any]) -> Path:
    """A random NllbMoeForConditionalGeneration in the run's vocabulary, saved by `save_pretrained`
    as several safetensors files with their index, with the run's tokenizer beside it."""
    import torch
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    from trainer.tokenizer.vocab import Tokenizer

    tok = Tokenizer.load(values["tokenizer_name"])
    ids = tok.special_ids()
    torch.manual_seed(7)
    config = NllbMoeConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_experts=4,
        encoder_sparse_step=2,
        decoder_sparse_step=2,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        moe_token_dropout=0.0,
        init_std=0.1,
        pad_token_id=ids["pad_token_id"],
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        decoder_start_token_id=ids["decoder_start_token_id"],
    )
    hf_dir = tmp / "stock_moe"
    NllbMoeForConditionalGeneration(config).save_pretrained(str(hf_dir), max_shard_size="100KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    tok.save(hf_dir)
    return hf_dir
