"""Check a predictions table against transformers on the same model directory.

usage: check_predictions.py TABLE_DIR MODEL_DIR MAX_LENGTH [PRECISION]
The table must hold `text` (a kept column) and `logits`. Reads it with deltalake, runs
AutoModelForSequenceClassification (eval, fp32 unless PRECISION is bf16) on each row's text
and prints JSON: rows, distinct ids, max |logit diff|, max |probability diff|, label
agreement, whether `score` is the max probability and `label` its id2label name.
"""
import json
import os
import sys

import deltalake
import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def main() -> None:
    table_dir, model_dir, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
    precision = sys.argv[4] if len(sys.argv) > 4 else "fp32"
    data = deltalake.DeltaTable(table_dir).to_pyarrow_table().to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    id2label = model.config.id2label
    logit_diff = prob_diff = 0.0
    same_label = consistent = 0
    with torch.inference_mode():
        for start in range(0, len(data), 64):
            rows = data[start:start + 64]
            enc = tokenizer([r["text"] for r in rows], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
            logits = model(**enc).logits.float().numpy()
            probs = torch.softmax(torch.from_numpy(logits), -1).numpy()
            for row, l, p in zip(rows, logits, probs):
                logit_diff = max(logit_diff, float(np.abs(np.array(row["logits"]) - l).max()))
                prob_diff = max(prob_diff, float(np.abs(np.array(row["probabilities"]) - p).max()))
                same_label += int(row["label_id"] == int(p.argmax()))
                consistent += int(
                    id2label[row["label_id"]] == row["label"]
                    and abs(row["score"] - max(row["probabilities"])) < 1e-7
                    and abs(sum(row["probabilities"]) - 1.0) < 1e-5
                )
    print(json.dumps({
        "rows": len(data),
        "distinct_ids": len({r["id"] for r in data}),
        "max_logit_diff": logit_diff,
        "max_prob_diff": prob_diff,
        "same_label": same_label,
        "consistent": consistent,
        "model_versions": sorted({r["model_version"] for r in data}),
        "run_ids": len({r["run_id"] for r in data}),
    }))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
