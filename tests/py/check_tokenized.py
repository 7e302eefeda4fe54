"""Compare a lakeml tokenized table with `transformers` AutoTokenizer, row by row.

usage: check_tokenized.py TOKENIZED_DIR SOURCE_DIR MODEL_DIR MAX_LENGTH
Both tables are read with the `deltalake` package. Every source row's text is tokenized by
AutoTokenizer(truncation=True, max_length=MAX_LENGTH) and must equal the table's input_ids,
length and (string -> id, sorted) label; `truncated` counts the rows whose untruncated
encoding is longer than MAX_LENGTH. Prints a JSON summary; exits 1 on any difference.
"""
import json
import sys

import deltalake
from transformers import AutoTokenizer


def main() -> None:
    tokenized_dir, source_dir, model_dir, max_length = sys.argv[1:5]
    tokenized = deltalake.DeltaTable(tokenized_dir).to_pyarrow_table().to_pylist()
    source = deltalake.DeltaTable(source_dir).to_pyarrow_table().to_pylist()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [r["text"] for r in source]
    expected = tok(texts, truncation=True, max_length=int(max_length), padding=False)["input_ids"]
    # Rows whose whole text has more than max_length tokens: the ones truncation cut.
    whole = tok(texts, truncation=False, padding=False)["input_ids"]
    labels = sorted({r["label"] for r in source})
    by_id = {r["id"]: r for r in tokenized}
    mismatches = []
    for row, ids in zip(source, expected):
        got = by_id.get(row["id"])
        if got is None:
            mismatches.append({"id": row["id"], "why": "missing"})
        elif got["input_ids"] != ids or got["length"] != len(ids):
            mismatches.append({"id": row["id"], "why": "ids", "want": ids, "got": got["input_ids"]})
        elif got["label"] != labels.index(row["label"]) or got["split"] != row["split"]:
            mismatches.append({"id": row["id"], "why": "label/split"})
    summary = {
        "source_rows": len(source),
        "tokenized_rows": len(tokenized),
        "tokens": sum(len(ids) for ids in expected),
        "truncated": sum(1 for ids in whole if len(ids) > int(max_length)),
        "labels": labels,
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:3],
    }
    print(json.dumps(summary))
    sys.exit(1 if mismatches or len(tokenized) != len(source) else 0)


if __name__ == "__main__":
    main()
