"""Generation through the 3D model (`parallel.generate`) equals single-device `models.generate.generate`.

Every rank builds the same small model (fixed seed), trained on a copy task until its
output length follows the source length. The test process then picks each dp replica's
source rows from a pool by their single-device outputs, so that decoding is not
degenerate on any CPU (float rounding moves single outputs, not the pool's spread):
rows end in `</s>` at varied lengths, one is cut by max_length, and beams diverge
from greedy. Then, on a (pp, dp, tp) mesh, for four pipeline cuts

    [5, 4]        src_embed enc0 enc1 enc_norm tgt_embed | dec0 dec1 dec2 head
    [2, 7]        src_embed enc0 | enc1 enc_norm tgt_embed dec0 dec1 dec2 head
                  (the encoder crosses ranks; pp rank 0 holds no decoder block)
    [2, 3, 2, 2]  v=2: stages 0, 2 on pp rank 0 and 1, 3 on pp rank 1, so each
                  token crosses rank 1 -> 0 -> 1 through the decoder
    [2, 2, 3, 2]  zbv (the V): stages 0, 3 on pp rank 0 and 1, 2 on pp rank 1, so the
                  head, and the search, live on pp rank 0

and the interleaved one again with sequence parallelism (suspended while decoding),
the token ids of greedy and beam search (num_beams 3, a forced target tag per
row, padded sources of varied lengths, a max_length that cuts some rows) equal
`generate` on the full model, with each dp replica decoding its own batch; and
the in-loop BLEU/chrF of `Evaluator.run` (3D decoding, dp replicas sharing the
batches) equal `evaluate_directions` on the full model.

One spawned group per mesh shape checks all of it (spawning dominates the cost).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.dist.harness import run_distributed

TINY = dict(
    vocab_size=101,  # not a multiple of tp: the vocab-parallel head pads it
    d_model=32,
    encoder_layers=2,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    max_position_embeddings=64,
)
TAGS = {"en": 4, "de": 5, "fr": 6}
FIRST_WORD = 7
# (balance, schedule, v, sequence_parallel)
CUTS = [
    ([5, 4], "1f1b", 1, False),
    ([2, 7], "1f1b", 1, False),
    ([2, 3, 2, 2], "interleaved_1f1b", 2, False),
    ([2, 3, 2, 2], "interleaved_1f1b", 2, True),
    ([2, 2, 3, 2], "zbv", 2, False),  # the V: stages 0 and 3 on pp rank 0, which leads the search
]


class WordTokenizer:
    """Source word `w<id>` is id; id decodes to the two words `w<id> v<id>`, so that the tiny
    model's short outputs still have 4-grams for BLEU. (A sibling of tests.unit.test_evaluate's,
    not imported: that module pulls in `transformers` models, which every rank would pay for.)"""

    pad_id, eos_id = 1, 2

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split() if w.startswith("w")]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i} v{i}" for i in ids if i >= FIRST_WORD)

    def lang_id(self, lang: str) -> int:
        return TAGS[lang]


def random_sources(n: int, seed: int, max_len: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(FIRST_WORD, TINY["vocab_size"], (k,), generator=g).tolist() for k in lens]


def copy_batch(cfg: Any, words: list[list[int]], tags: list[int]) -> Any:
    """`__en__ w.. </s>` -> `__tgt__ w.. </s>` (teacher forcing from `</s>`)."""
    from models.m2m100 import IGNORE_INDEX, Seq2SeqBatch
    from trainer.eval.decode import pad_batch

    src, mask = pad_batch([[TAGS["en"], *w, cfg.eos_token_id] for w in words], cfg.pad_token_id)
    labels, _ = pad_batch([[t, *w, cfg.eos_token_id] for w, t in zip(words, tags)], IGNORE_INDEX)
    dec = torch.full_like(labels, cfg.pad_token_id)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORE_INDEX, cfg.pad_token_id)
    return Seq2SeqBatch(src, mask, dec, labels)


def trained_state() -> dict[str, torch.Tensor]:
    """The copy task until output lengths track source lengths (once, in the test process; the
    ranks load the result). 30 steps left every output 1-2 words long on some CPUs."""
    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation

    torch.manual_seed(0)
    cfg = ModelConfig(**TINY)
    model = M2M100Translation(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(200):
        words = random_sources(32, seed=1000 + step, max_len=7)
        tags = [TAGS["fr"] if i % 2 else TAGS["de"] for i in range(32)]
        loss, n = model.loss(copy_batch(cfg, words, tags))
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


SEARCHES = ((1, 12), (3, 12), (3, 6))  # (num_beams, max_length); the last cuts long rows
ROWS = 5


def out_lengths(out: torch.Tensor) -> list[int]:
    return [len([t for t in row if t != 1]) for row in out.tolist()]


def pick_rows(base: Any, dp_rank: int) -> tuple[list[list[int]], list[int]]:
    """This replica's ROWS sources, picked from a pool by their single-device outputs: one
    where beam search differs from greedy, one longer than the cut, then new greedy lengths."""
    from models.generate import generate

    pool = random_sources(48, seed=100 + dp_rank, max_len=7)
    tags = [TAGS["fr"] if i % 2 else TAGS["de"] for i in range(len(pool))]
    batch = copy_batch(base.config, pool, tags)  # its sources: `__en__ w.. </s>`, padded
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        greedy, beam = (generate(base, ids, mask, torch.tensor(tags), k, n) for k, n in SEARCHES[:2])
    lengths, beam_lengths = out_lengths(greedy), out_lengths(beam)
    differs = [i for i in range(len(pool)) if greedy[i].tolist() != beam[i].tolist()]
    long = [i for i in range(len(pool)) if beam_lengths[i] > SEARCHES[2][1]]
    chosen = differs[:1] + [i for i in long[:1] if i not in differs[:1]]
    for i in sorted(range(len(pool)), key=lambda i: lengths[i]):
        if len(chosen) < ROWS and lengths[i] not in {lengths[j] for j in chosen}:
            chosen.append(i)
    for i in range(len(pool)):  # fewer distinct lengths than rows: fill up with repeats
        if len(chosen) < ROWS and i not in chosen:
            chosen.append(i)
    varied = len({lengths[j] for j in chosen}) >= 3
    assert differs and long and varied, f"tiny model degenerate: {lengths=} {beam_lengths=}"
    return [pool[i] for i in chosen], [tags[i] for i in chosen]


def token_parity(base: Any, pm: Any, rows: tuple[list[list[int]], list[int]]) -> list[dict[str, Any]]:
    """Greedy and beam search on this replica's own batch: 3D ids vs `generate` (leader ranks)."""
    from models.generate import SearchSettings, generate
    from parallel.generate import pipeline_generate
    from trainer.eval.decode import pad_batch

    cfg = base.config
    words = rows[0]
    ids, mask = pad_batch([[TAGS["en"], *w, cfg.eos_token_id] for w in words], cfg.pad_token_id)
    tags = torch.tensor(rows[1])
    out = []
    for num_beams, max_length in SEARCHES:
        settings = SearchSettings(num_beams=num_beams, max_length=max_length)
        got = pipeline_generate(pm, ids, mask, tags, settings)
        want = generate(base, ids, mask, tags, num_beams=num_beams, max_length=max_length)
        if got is not None:
            out.append(
                {"beams": num_beams, "max_length": max_length, "got": got.tolist(), "want": want.tolist()}
            )
    return out


def bleu_parity(base: Any, pm: Any, mesh: Any, log_rank: int) -> dict[str, Any] | None:
    """`Evaluator.run` on the mesh vs `evaluate_directions` on the full model (logging rank)."""
    import torch.distributed as dist

    from trainer.data.batching import EvalBatch
    from models.generate import SearchSettings
    from trainer.eval.decode import evaluate_directions, translate
    from trainer.eval.runner import Evaluator

    tok, cfg = WordTokenizer(), base.config
    batches: dict[str, list[EvalBatch]] = {}
    for lang, seed in (("fr", 7), ("de", 8)):
        texts = [" ".join(f"w{i}" for i in w) for w in random_sources(10, seed=seed, max_len=6)]
        # References: the single-device translation for 2 sentences in 3, the source otherwise,
        # so BLEU is inside (0, 100) and moves with any changed hypothesis.
        hyps = translate(base, tok, texts, "en", lang, SearchSettings(num_beams=3, max_length=12))
        ref_texts = [h if i % 3 else t for i, (h, t) in enumerate(zip(hyps, texts))]
        words = [tok.encode(t) for t in texts]
        batch = copy_batch(cfg, words, [TAGS[lang]] * len(words))
        batches[f"en-{lang}"] = [EvalBatch(f"en-{lang}", batch, texts, ref_texts, TAGS[lang])]
    args = SimpleNamespace(
        generation_num_beams=3, generation_max_length=12, per_device_eval_batch_size=3, eval_spbleu=False,
        disable_tqdm=True,
    )
    evaluator = Evaluator(pm, mesh, tok, batches, args, log_rank)  # type: ignore[arg-type]
    got = evaluator.run(step=0)
    if dist.get_rank() != log_rank:
        return None
    want = evaluate_directions(base, evaluator.texts, tok, num_beams=3, max_length=12, batch_size=3)
    want.pop("eval_samples")
    return {"got": {k: v for k, v in got.items() if not k.startswith("eval_loss")}, "want": want}


def sp_count(model: Any) -> int:
    """Sequence-parallel tp linears (decoding suspends them; training needs them back)."""
    return sum(bool(getattr(m, "sequence_parallel", False)) for m in model.modules())


def generate_worker(
    rank: int,
    world: int,
    shape: tuple[int, int, int],
    state: dict[str, torch.Tensor],
    rows: list[tuple[list[list[int]], list[int]]],
) -> dict[str, Any]:
    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation
    from parallel.mesh import ParallelDims, build_mesh, coords_to_rank
    from parallel.parallelize import build_parallel_model

    base = M2M100Translation(ModelConfig(**TINY))
    base.load_state_dict(state)
    base.eval()
    pp, dp, tp = shape
    mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world))
    result: dict[str, Any] = {"tokens": {}, "bleu": None, "sp_restored": True}
    for balance, schedule, v, sp in CUTS:
        pm = build_parallel_model(
            copy.deepcopy(base), mesh, balance, 2, schedule, v, "none", 0.0, sequence_parallel=sp
        )
        pm.model.eval()
        sp_layers = sp_count(pm.model)
        cut = f"{schedule} {balance}{' sp' if sp else ''}"
        result["tokens"][cut] = (pm.plan.last_stage_rank, token_parity(base, pm, rows[mesh.dp_rank]))
        result["sp_restored"] &= sp_count(pm.model) == sp_layers and (sp_layers > 0) == sp
        if (balance, sp) == (CUTS[0][0], False):
            result["bleu"] = bleu_parity(base, pm, mesh, coords_to_rank((pp - 1, 0, 0), mesh.dims.shape))
    return result


def check(results: list[dict[str, Any]], shape: tuple[int, int, int]) -> None:
    pp, dp, tp = shape
    leaders = [r for r in range(pp * dp * tp) if r // (dp * tp) == pp - 1]  # the last stage's ranks
    lengths: set[int] = set()
    for rank, res in enumerate(results):
        for cut, (leader_pp, cases) in res["tokens"].items():
            assert bool(cases) == (rank // (dp * tp) == leader_pp), (rank, cut)
            for case in cases:
                assert case["got"] == case["want"], (rank, cut, case)
                lengths.update(len([t for t in row if t != 1]) for row in case["want"])
            # Not degenerate: beam search (same max_length) picks differently from greedy somewhere.
            if cases:
                assert cases[0]["want"] != cases[1]["want"], (rank, cut)
    assert len(lengths) >= 3, lengths  # rows end at varied lengths
    bleu = results[leaders[0]]["bleu"]
    assert bleu is not None and bleu["got"] == bleu["want"], bleu
    assert 0.0 < bleu["want"]["eval_bleu"] < 100.0, bleu
    assert all(r["bleu"] is None for i, r in enumerate(results) if i != leaders[0])
    assert all(r["sp_restored"] for r in results)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return trained_state()


@pytest.fixture(scope="module")
def rows(state: dict[str, torch.Tensor]) -> list[tuple[list[list[int]], list[int]]]:
    """Each dp replica's source rows and target tags (see `pick_rows`)."""
    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation

    base = M2M100Translation(ModelConfig(**TINY))
    base.load_state_dict(state)
    return [pick_rows(base.eval(), dp_rank) for dp_rank in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("shape", [(2, 2, 2)])  # (2, 1, 2) repeated its coverage without dp
def test_generation_3d_equals_single_device(
    shape: tuple[int, int, int],
    state: dict[str, torch.Tensor],
    rows: list[tuple[list[list[int]], list[int]]],
) -> None:
    world = shape[0] * shape[1] * shape[2]
    results = run_distributed(generate_worker, world, args=(shape, state, rows), timeout=240)
    check(results, shape)
