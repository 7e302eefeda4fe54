"""Write a local Delta table as plain files, its rows (by the first column) split into parts:
Parquet with pyarrow, CSV with pyarrow's writer, JSON lines with the standard library.

usage: export_files.py DELTA_DIR OUT_DIR PARTS
writes OUT_DIR/pq/part-N.parquet, OUT_DIR/csv/part-N.csv and OUT_DIR/json/part-N.jsonl;
prints JSON: {"rows": total rows, "parts": PARTS}
"""
import json
import os
import sys

import deltalake
import pyarrow.csv as pacsv
import pyarrow.parquet as pq


def main() -> None:
    source, out, parts = sys.argv[1], sys.argv[2], int(sys.argv[3])
    table = deltalake.DeltaTable(source).to_pyarrow_table()
    table = table.sort_by(table.column_names[0])
    size = -(-table.num_rows // parts)
    for kind in ("pq", "csv", "json"):
        os.makedirs(os.path.join(out, kind), exist_ok=True)
    for n in range(parts):
        part = table.slice(n * size, size)
        pq.write_table(part, os.path.join(out, "pq", f"part-{n}.parquet"))
        pacsv.write_csv(part, os.path.join(out, "csv", f"part-{n}.csv"))
        with open(os.path.join(out, "json", f"part-{n}.jsonl"), "w", encoding="utf-8") as f:
            for row in part.to_pylist():
                f.write(json.dumps(row) + "\n")
    print(json.dumps({"rows": table.num_rows, "parts": parts}))
    sys.stdout.flush()
    os._exit(0)  # delta-rs / pyarrow thread pools can abort the interpreter at shutdown


if __name__ == "__main__":
    main()
