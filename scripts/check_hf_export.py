"""Check an export with whatever `transformers` this Python has (4.46+ or 5.x), against expectations.

    python scripts/check_hf_export.py EXPORT_DIR EXPECTED.json

Used by `tests/unit/test_hf_tokenizer.py` to run the export round trip in transformers 4.x
(`HF4_PYTHON=/path/to/python`, a venv with `torch`, `transformers==4.57.*`, `sentencepiece`),
and by hand. Imports nothing from this repository, so it runs in a bare venv.

EXPECTED.json (written by the test with the current transformers) holds `tokenizer_class`
(`M2M100Tokenizer` or `NllbTokenizer`), `src_lang`, `tgt_lang` (`en` or `eng_Latn`), `texts`,
`targets`, and the ids the exported tokenizer must give: `input_ids` (`[src] tokens </s>`),
`labels` (`[tgt] tokens </s>`), `plain_ids` (no specials), `model_max_length`, and the
greedy `generated` ids (forced BOS: `get_lang_id(tgt_lang)`, or the code's token id for
NLLB) and first-row `logits` of the exported model. Prints one line per failed check and exits 1 if any failed, else prints
`N passed, 0 failed` and exits 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def check(export_dir: str, expected: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The checks made and the failed ones (one line each)."""
    import torch
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    failed: list[str] = []
    done: list[str] = []

    def expect(name: str, got: Any, want: Any) -> None:
        done.append(name)
        if got != want:
            failed.append(f"{name}: got {got!r}, expected {want!r}")

    tok = AutoTokenizer.from_pretrained(export_dir)
    expect("tokenizer class", type(tok).__name__.removesuffix("Fast"), expected["tokenizer_class"])
    expect("model_max_length", tok.model_max_length, expected["model_max_length"])
    tok.src_lang, tok.tgt_lang = expected["src_lang"], expected["tgt_lang"]
    enc = tok(expected["texts"], text_target=expected["targets"])
    expect("input_ids (src_lang)", enc["input_ids"], expected["input_ids"])
    expect("labels (text_target)", enc["labels"], expected["labels"])
    expect("plain ids", tok(expected["texts"], add_special_tokens=False)["input_ids"], expected["plain_ids"])
    long = tok(" ".join(expected["texts"]) * 20, truncation=True)["input_ids"]
    expect("truncated length", len(long), expected["model_max_length"])
    model = AutoModelForSeq2SeqLM.from_pretrained(export_dir).eval()
    batch = tok(expected["texts"], return_tensors="pt", padding=True)
    code = expected["tgt_lang"]  # M2M100Tokenizer: get_lang_id("de"); NllbTokenizer: the code's token
    forced = tok.get_lang_id(code) if hasattr(tok, "get_lang_id") else tok.convert_tokens_to_ids(code)
    with torch.no_grad():
        out = model.generate(**batch, forced_bos_token_id=forced, num_beams=1, do_sample=False, max_length=12)
        dec = torch.tensor([expected["generated"][0]])
        logits = model(input_ids=batch["input_ids"][:1], decoder_input_ids=dec).logits[0]
    rows = [[int(i) for i in row if int(i) != tok.pad_token_id] for row in out]
    expect("generated (forced BOS)", rows, expected["generated"])
    want = torch.tensor(expected["logits"])
    error = float((logits - want).abs().max())
    expect("logits within 1e-4", error <= 1e-4, True)
    print(f"transformers {transformers.__version__}: {type(tok).__name__}, {type(model).__name__}")
    return done, failed


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: check_hf_export.py EXPORT_DIR EXPECTED.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        expected = json.load(f)
    done, failed = check(argv[0], expected)
    for line in failed:
        print(f"FAILED {line}")
    print(f"{len(done) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
