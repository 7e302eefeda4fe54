"""Token ids from `transformers` AutoTokenizer, the reference for lakeml's tokenize stage.

usage: reference_ids.py MODEL_DIR MAX_LENGTH ROWS_JSONL
ROWS_JSONL holds objects with `text` and optionally `pair`, in id order. Prints a JSON list
of input_ids lists (truncation longest_first at MAX_LENGTH, special tokens, no padding).
"""
import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    model, max_length, rows_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rows = [json.loads(line) for line in open(rows_file) if line.strip()]
    tok = AutoTokenizer.from_pretrained(model)
    texts = [r["text"] for r in rows]
    pairs = [r["pair"] for r in rows] if all("pair" in r for r in rows) else None
    out = tok(texts, pairs, truncation="longest_first", max_length=max_length, padding=False)
    print(json.dumps(out["input_ids"]))


if __name__ == "__main__":
    main()
