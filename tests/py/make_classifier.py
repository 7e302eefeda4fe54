"""Make a fine-tuned-looking classifier directory from a base model, with transformers.

usage: make_classifier.py BASE_DIR OUT_DIR LABELS [SEED]
LABELS is comma-separated (e.g. `negative,positive`). The classification head is drawn
from N(0, 1) with SEED, so logits differ clearly between rows (HF's own init, std 0.02,
would put every probability near 1/len(LABELS)). Saves config.json (id2label),
model.safetensors and the tokenizer files; prints JSON {"labels": [...]}.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification


def main() -> None:
    base, out, labels = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    model = AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={l: i for i, l in enumerate(labels)},
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("classifier"):
                param.copy_(torch.randn(param.shape, generator=generator))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ["tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"]:
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    print(json.dumps({"labels": labels}))


if __name__ == "__main__":
    main()
