"""Load a model directory lakeml wrote with transformers and score a tokenized split with it.

usage: check_model.py MODEL_DIR TOKENIZED_TABLE [SPLIT]
prints JSON: id2label, label2id, architectures, rows, loss (mean cross-entropy), accuracy,
and the logits of the first rows (for eyeballing).
"""
import json
import sys

import deltalake
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def main() -> None:
    model_dir, table = sys.argv[1], sys.argv[2]
    split = sys.argv[3] if len(sys.argv) > 3 else "test"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    AutoTokenizer.from_pretrained(model_dir)  # the directory must carry a usable tokenizer
    rows = [r for r in deltalake.DeltaTable(table).to_pyarrow_table().to_pylist() if r["split"] == split]
    pad = model.config.pad_token_id or 0
    losses, correct, first = [], 0, []
    with torch.no_grad():
        for start in range(0, len(rows), 64):
            batch = rows[start:start + 64]
            longest = max(len(r["input_ids"]) for r in batch)
            ids = torch.tensor([r["input_ids"] + [pad] * (longest - len(r["input_ids"])) for r in batch])
            mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"])) for r in batch])
            labels = torch.tensor([r["label"] for r in batch])
            logits = model(input_ids=ids, attention_mask=mask).logits
            losses.append(torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item())
            correct += (logits.argmax(-1) == labels).sum().item()
            if not first:
                first = logits[:3].tolist()
    print(json.dumps({
        "id2label": {str(k): v for k, v in model.config.id2label.items()},
        "label2id": model.config.label2id,
        "architectures": model.config.architectures,
        "rows": len(rows),
        "loss": sum(losses) / len(rows),
        "accuracy": correct / len(rows),
        "first_logits": first,
    }))


if __name__ == "__main__":
    main()
