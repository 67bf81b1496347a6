"""Run an NLLB-MoE directory in transformers 4.x (`HF4_PYTHON`): logits and `generate` as JSON.

    $HF4_PYTHON scripts/check_hf_nllb_moe.py MODEL_DIR REQUEST.json

REQUEST holds `input_ids`, `attention_mask`, `decoder_input_ids` (lists of rows),
`forced_bos_token_id`, `max_length` and `beams` (a list of beam widths). The last line of stdout
is one JSON object: `transformers` (its version), `logits` (eval, fp32) and `generated` (one list
of rows per beam width). Used by tests/unit/test_hf_nllb_moe.py against transformers 4.57.6,
whose `NllbMoeSparseMLP` combines the top-2 experts correctly (5.x's does not; see that test).
Imports nothing of this project, so it runs in a bare venv (torch, transformers, safetensors).
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from transformers import NllbMoeForConditionalGeneration


def main(model_dir: str, request_file: str) -> None:
    req = json.loads(open(request_file).read())
    model = NllbMoeForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor(req["input_ids"])
    mask = torch.tensor(req["attention_mask"])
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor(req["decoder_input_ids"])
        )
        generated = [
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                forced_bos_token_id=req["forced_bos_token_id"],
                num_beams=beams,
                max_length=req["max_length"],
                do_sample=False,
            ).tolist()
            for beams in req["beams"]
        ]
    out = {"transformers": transformers.__version__, "logits": logits.logits.tolist(), "generated": generated}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
