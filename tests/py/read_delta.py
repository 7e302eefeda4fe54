"""Read a Delta table with delta-rs's Python package (an independent reader) and print it.

usage: read_delta.py TABLE_DIR [VERSION]
prints JSON: version, schema (name -> type), rows (sorted by the first column), stored_order
(the first column as stored: files in the log's order, rows in file order), history.
"""
import json
import os
import sys

import deltalake


def main() -> None:
    path = sys.argv[1]
    version = int(sys.argv[2]) if len(sys.argv) > 2 else None
    table = deltalake.DeltaTable(path, version=version)
    data = table.to_pyarrow_table()
    first = data.column_names[0]
    stored_order = data.column(first).to_pylist()
    rows = sorted(data.to_pylist(), key=lambda r: r[first])
    for row in rows:
        for key, value in row.items():
            if isinstance(value, bytes):
                row[key] = value.decode("utf-8", "replace")
    print(json.dumps({
        "version": table.version(),
        "schema": {f.name: str(f.type) for f in data.schema},
        "num_rows": data.num_rows,
        "files": len(table.file_uris()),
        "rows": rows,
        "stored_order": stored_order,
        "history": [
            {"version": h.get("version"), "operation": h.get("operation"), "lakeml": h.get("lakeml")}
            for h in table.history()
        ],
    }, default=str))
    # delta-rs / pyarrow thread pools can abort the interpreter at shutdown
    # ("terminate called without an active exception"); the output is complete here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
