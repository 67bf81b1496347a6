"""The stock M2M100 layout of an export (`trainer.hf_m2m100`): which runs get it, where each id goes,
and what the new rows hold. The round trip through `trainer.export` is in `test_hf_tokenizer.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from trainer.errors import TokenizerError
from trainer.tokenizer.stock_m2m100 import permute_model, save_m2m100_tokenizer, stock_codes, stock_layout

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
PIECES = [*SPECIALS, "__de__", "__en__", "▁a", "b", "c"]  # ours: S = 9 (L = 2 tags), N = 7


def test_stock_codes_are_m2m100s_hundred() -> None:
    codes = stock_codes()
    assert len(codes) == 100 and codes[:3] == ["af", "am", "ar"] and codes.index("de") == 16


@pytest.mark.parametrize(
    "tags",
    [["deu_Latn", "eng_Latn"], ["__en__", "__xx__"], ["__en_XX__"], ["__en__", "fra_Latn"], []],
    ids=["nllb", "unknown-code", "mbart-style", "mixed", "none"],
)
def test_runs_without_all_stock_codes_keep_their_ids(tags: list[str]) -> None:
    assert stock_layout([*SPECIALS, *tags, "x"], tags, 5 + len(tags)) is None


def test_layout_golden_table() -> None:
    """Specials and pieces keep their order at 0..N-1, tag `__xx__` goes to N + stock index of xx,
    the padded model row (V = 10 > S = 9) takes the first madeup slot."""
    layout = stock_layout(PIECES, ["__de__", "__en__"], 10)
    assert layout is not None
    assert layout.new_id == (0, 1, 2, 3, 7 + 16, 7 + 18, 4, 5, 6, 107)
    assert layout.pieces == (*SPECIALS, "▁a", "b", "c") and layout.codes == ("de", "en")
    assert layout.size == 7 + 100 + 8 and layout.num_madeup_words == 8
    assert layout.madeup_fill_ids == tuple(range(108, 115))
    assert len(layout.new_code_ids) == 98 and {23, 25}.isdisjoint(layout.new_code_ids)
    ids = torch.tensor([[5, 6, 2], [4, -100, 9]])
    assert layout.map_ids(ids).tolist() == [[25, 4, 2], [23, -100, 107]]  # ignore_index kept


def test_more_padded_rows_than_madeup_words_grow_the_vocabulary() -> None:
    layout = stock_layout(PIECES, ["__de__", "__en__"], 9 + 12)
    assert layout is not None and layout.size == 7 + 100 + 12 and layout.madeup_fill_ids == ()


def test_permuted_rows_and_new_rows() -> None:
    """Trained rows move; an untrained code gets the mean of the tag rows, an unfilled madeup word <unk>'s."""
    layout = stock_layout(PIECES, ["__de__", "__en__"], 10)
    assert layout is not None
    weight = torch.randn(10, 4)
    config = ModelConfig(vocab_size=10, d_model=4, encoder_attention_heads=2, decoder_attention_heads=2)
    other = torch.ones(3)
    state, new_config = permute_model({"shared.weight": weight, "fc1.weight": other}, config, layout)
    out = state["shared.weight"]
    assert out.shape == (115, 4) and new_config.vocab_size == 115 and state["fc1.weight"] is other
    for ours, stock in enumerate(layout.new_id):
        assert torch.equal(out[stock], weight[ours])
    assert torch.allclose(out[7 + stock_codes().index("fr")], weight[4:6].mean(dim=0))
    assert torch.equal(out[114], weight[3]) and torch.equal(out[108], weight[3])


def test_shape_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"vocab_size=8 is smaller than the tokenizer's 9 pieces"):
        stock_layout(PIECES, ["__de__", "__en__"], 8)
    layout = stock_layout(PIECES, ["__de__", "__en__"], 9)
    assert layout is not None
    with pytest.raises(ValueError, match=r"embedding has 10 rows; the layout maps 9"):
        layout.permute_rows(torch.zeros(10, 2))


def test_default_codes_must_be_the_runs(tmp_path: Path) -> None:
    layout = stock_layout(PIECES, ["__de__", "__en__"], 9)
    assert layout is not None
    with pytest.raises(
        TokenizerError, match=r"src_lang='fr' is not a language code of the run; valid: \['de', 'en'\]"
    ):
        save_m2m100_tokenizer(b"", layout, tmp_path, src_lang="fr")
    assert not list(tmp_path.iterdir())  # nothing written
