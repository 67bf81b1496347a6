"""Sampling across directions: the temperature math, realised shares, resume and mesh independence."""

from __future__ import annotations

import hashlib
import json
import math

import datasets
import numpy as np
import pytest

from trainer.config.data_args import DataArguments
from trainer.data.batching import BatchLayout, GlobalBatchSampler, direction_ids
from trainer.data.sampling import (
    DirectionSampling,
    SamplingError,
    direction_probabilities,
    draw_epoch,
    epoch_counts,
)
from trainer.errors import ConfigError, DataError

SIZES = {"en-de": 2000, "de-en": 400, "en-fr": 40}  # 50:10:1, a high / mid / low-resource mix


def _synthetic(sizes: dict[str, int]) -> datasets.Dataset:
    """Tokenized-looking rows (the columns the sampler reads), lengths drawn at random."""
    rng = np.random.default_rng(123)
    cols: dict[str, list] = {"src_lang": [], "tgt_lang": [], "src_len": [], "tgt_len": [], "input_ids": [],
                             "labels": []}  # fmt: skip
    for name, n in sizes.items():
        src, tgt = name.split("-")
        for s, t in rng.integers(3, 40, size=(n, 2)).tolist():
            for key, value in zip(cols, (src, tgt, s, t, [5] * s, [6] * t)):
                cols[key].append(value)
    return datasets.Dataset.from_dict(cols)


@pytest.fixture(scope="module")
def train() -> datasets.Dataset:
    return _synthetic(SIZES)


def _sampler(train: datasets.Dataset, layout: BatchLayout, **kw: object) -> GlobalBatchSampler:
    return GlobalBatchSampler(train, layout, 7, 0, 2, DirectionSampling(**kw))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ the math


def test_temperature_math() -> None:
    sizes = {"a": 1000, "b": 10}
    p1 = direction_probabilities(sizes, DirectionSampling(1.0))
    assert p1 == pytest.approx({"a": 1000 / 1010, "b": 10 / 1010})
    p5 = direction_probabilities(sizes, DirectionSampling(5.0))
    z = 1000**0.2 + 10**0.2
    assert p5 == pytest.approx({"a": 1000**0.2 / z, "b": 10**0.2 / z})
    uniform = direction_probabilities(sizes, DirectionSampling(1e9))  # T -> inf
    assert uniform["b"] == pytest.approx(0.5)
    # weights replace the sizes; the temperature still applies to them
    w = {"a": 2.0, "b": 1.0}
    p = direction_probabilities(sizes, DirectionSampling(1.0, w))
    assert p == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    r = math.sqrt(2)
    p = direction_probabilities(sizes, DirectionSampling(2.0, w))
    assert p == pytest.approx({"a": r / (r + 1), "b": 1 / (r + 1)})
    # no overflow for huge corpora at a low temperature; an empty direction gets p = 0
    huge = direction_probabilities({"a": 10**12, "b": 10**11, "c": 0}, DirectionSampling(0.01))
    assert huge["a"] == pytest.approx(1.0) and huge["c"] == 0.0


def test_sampling_errors_name_the_value() -> None:
    with pytest.raises(SamplingError, match=r"sampling_temperature=0 must be > 0"):
        DirectionSampling(0)
    with pytest.raises(SamplingError, match=r"no weight for \['b'\]"):
        direction_probabilities({"a": 1, "b": 1}, DirectionSampling(1.0, {"a": 1.0}))
    with pytest.raises(SamplingError, match=r"weigh \['b'\], which have no training pair"):
        direction_probabilities({"a": 1, "b": 0}, DirectionSampling(1.0, {"a": 1.0, "b": 1.0}))


def test_epoch_counts_and_draws() -> None:
    counts = epoch_counts([0.5, 0.3, 0.2], 7)  # 3.5, 2.1, 1.4 -> largest remainders get the 1 left
    assert counts.tolist() == [4, 2, 1] and epoch_counts([1 / 3] * 3, 100).sum() == 100
    groups = [np.arange(0, 10), np.arange(10, 13)]
    drawn = draw_epoch(np.random.default_rng(0), groups, np.array([4, 8]))  # down- and up-sampled
    assert len(drawn) == 12
    assert len(set(drawn[drawn < 10].tolist())) == 4  # a subset: no example twice
    assert sorted(np.bincount(drawn[drawn >= 10] - 10).tolist()) == [2, 3, 3]  # each floor(8/3) or once more


def test_config_weights() -> None:
    pairs = ["en-de", "de-en"]
    args = DataArguments(language_pairs=pairs, sampling_weights=["en-de:2 de-en:1"], sampling_temperature=5)
    assert DataArguments.direction_weights(args.sampling_weights) == {"en-de": 2.0, "de-en": 1.0}
    for bad, match in ((["en-de:2"], r"but the run's directions are \['en-de', 'de-en'\]"),
                       (["en-de:0", "de-en:1"], r"'en-de:0' is not of the form src-tgt:w"),
                       (["en-de:x", "de-en:1"], r"'en-de:x' is not of the form"),
                       (["en-de:1", "en-de:2"], r"names 'en-de' twice")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            DataArguments(language_pairs=pairs, sampling_weights=bad)
    with pytest.raises(ConfigError, match=r"sampling_temperature=-1"):
        DataArguments(language_pairs=pairs, sampling_temperature=-1)


# ------------------------------------------------------------------------------------------ the sampler


def test_default_keeps_the_plain_shuffle(train: datasets.Dataset) -> None:
    """T=1 without weights is today's order, bit for bit: the digests were taken from the sampler
    before sampling existed (same data, seed and layouts), so old runs resume unchanged."""
    golden = {"ecf021e0bfa4fbf3": BatchLayout(4, 2, 2, 2), "b7d4282602e59cce": BatchLayout(4, 2, 1, 2, 200)}
    for digest, layout in golden.items():
        s = _sampler(train, layout)
        h = hashlib.sha256()
        for _ in range(100):
            h.update(np.concatenate(next(s).slots).astype(np.int64).tobytes())
        assert h.hexdigest()[:16] == digest
        assert "sampling_temperature" not in s.state_dict()


def test_direction_ids(train: datasets.Dataset) -> None:
    names, ids = direction_ids(train.filter(lambda r: r["src_len"] > 5))  # through an indices mapping
    assert names == ["de-en", "en-de", "en-fr"]
    kept = train.filter(lambda r: r["src_len"] > 5)
    assert [names[i] for i in ids[:3]] == [f"{r['src_lang']}-{r['tgt_lang']}" for r in kept.select(range(3))]


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_realised_shares_match_expected(train: datasets.Dataset, temperature: float) -> None:
    s = _sampler(train, BatchLayout(8, 2, 1, 2), temperature=temperature)
    steps = 2 * len(s.epoch_plan(0)) + 7  # two epochs and a bit
    for _ in range(steps):
        next(s)
    shares = s.shares()
    assert sum(v["examples"] for v in shares.values()) == steps * 32
    for name, v in shares.items():
        assert v["realised"] == pytest.approx(v["expected"], abs=0.01), name
    if temperature == 5.0:  # the low-resource direction is upsampled: ~40 pairs drawn ~5x per epoch
        assert shares["en-fr"]["expected"] > 0.2 and shares["en-fr"]["examples"] > 4 * 2 * SIZES["en-fr"]


def test_epoch_is_the_data_size(train: datasets.Dataset) -> None:
    plain = _sampler(train, BatchLayout(8, 2, 1, 2))
    hot = _sampler(train, BatchLayout(8, 2, 1, 2), temperature=5.0)
    assert len(hot.epoch_plan(0)) == len(plain.epoch_plan(0)) == sum(SIZES.values()) // 32
    assert hot.epoch_plan(0)[0][0].tolist() != hot.epoch_plan(1)[0][0].tolist()  # epochs differ


def test_weighted_sampling_resumes_exactly_on_any_mesh(train: datasets.Dataset) -> None:
    """Mid-epoch state (JSON round trip, as in trainer_state.json) -> the same following batches,
    on the same mesh and on another one with the same global batch (32 pairs)."""
    kw = {"temperature": 2.0, "weights": {"en-de": 1.0, "de-en": 1.0, "en-fr": 3.0}}
    ref = _sampler(train, BatchLayout(8, 2, 1, 2), **kw)
    for _ in range(40):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))
    expected = [next(ref).example_indices() for _ in range(60)]  # crosses into epoch 1
    assert ref.epoch == 1
    for layout in (BatchLayout(8, 2, 1, 2), BatchLayout(2, 4, 2, 2), BatchLayout(32)):
        again = _sampler(train, layout, **kw)
        again.load_state_dict(state)
        assert [next(again).example_indices() for _ in range(60)] == expected
        assert again.shares() == ref.shares()  # realised shares continue over the run
    with pytest.raises(DataError, match=r"sampling_temperature"):
        _sampler(train, BatchLayout(8, 2, 1, 2), temperature=3.0).load_state_dict(state)
    with pytest.raises(DataError, match=r"data state from a different run"):
        _sampler(train, BatchLayout(8, 2, 1, 2)).load_state_dict(state)


def test_weights_must_fit_the_data(train: datasets.Dataset) -> None:
    with pytest.raises(DataError, match=r"no weight for \['en-fr'\]"):
        _sampler(train, BatchLayout(8), weights={"en-de": 1.0, "de-en": 1.0})


def test_window_shares_count_the_window_only(train: datasets.Dataset) -> None:
    """`shares_since(mark)` is each direction's fraction of the examples served after `mark`
    (the logging window's `share/<direction>`), not of the whole run."""
    s = _sampler(train, BatchLayout(8, 2, 1, 2), temperature=5.0)
    for _ in range(5):
        next(s)
    mark = s.drawn.copy()
    window = [next(s) for _ in range(3)]
    counts = np.bincount(s.direction_of[np.concatenate([x for gb in window for x in gb.slots])],
                         minlength=len(s.directions))  # fmt: skip
    got = s.shares_since(mark)
    assert list(got) == s.directions and sum(got.values()) == pytest.approx(1.0)
    assert got == {d: round(int(n) / (3 * 32), 6) for d, n in zip(s.directions, counts)}
    assert got != {d: v["realised"] for d, v in s.shares().items()}  # the run's shares differ
    assert s.shares_since(s.drawn.copy()) == dict.fromkeys(s.directions, 0.0)  # an empty window
