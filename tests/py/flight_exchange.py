"""Stream a Delta table through `pipeline serve`'s DoExchange with pyarrow.flight.

usage: flight_exchange.py URI TOKEN DELTA_DIR [MODEL] [BATCH_ROWS]
Reads `id, text` from the Delta table with deltalake, shuffles the rows (seeded) so their
order is not the id order, sends them in batches of BATCH_ROWS (default 500) with the
command {"model": MODEL (default "sentiment"), "text": "text"}, and reads every batch back.
Then sends one row whose text is 100 000 characters, and the first rows again asking only
for some columns. Prints one JSON object:
  rows          [[id, label, label_id, score, probabilities], ...] in the order sent
  columns       the output's column names; schema: [[name, arrow type], ...]
  batches_in    batches sent; rows_in: rows sent
  same_order    whether the output's ids are the input's, row for row
  same_input    whether the input columns came back unchanged
  huge          {"rows", "label", "score"} for the long text
  subset        {"columns": [...], "rows": n} for "columns": ["label", "score"]
"""
import json
import os
import random
import sys

import deltalake
import pyarrow as pa
import pyarrow.flight as flight


def exchange(client, options, command: dict, table: pa.Table, batch_rows: int) -> pa.Table:
    """One DoExchange: all batches out, then everything back (the server's error, if any,
    arrives on the read side)."""
    descriptor = flight.FlightDescriptor.for_command(json.dumps(command).encode())
    writer, reader = client.do_exchange(descriptor, options)
    write_error = None
    try:
        writer.begin(table.schema)
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
        writer.done_writing()
    except Exception as e:  # noqa: BLE001 - the read below carries the server's status
        write_error = e
    try:
        result = reader.read_all()
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001
            pass
    if write_error is not None:
        raise write_error
    return result


def main() -> None:
    uri, token, delta_dir = sys.argv[1], sys.argv[2].encode(), sys.argv[3]
    model = sys.argv[4] if len(sys.argv) > 4 else "sentiment"
    batch_rows = int(sys.argv[5]) if len(sys.argv) > 5 else 500

    data = deltalake.DeltaTable(delta_dir).to_pyarrow_table(columns=["id", "text"])
    # the server must keep the client's order, whatever it is
    order = list(range(data.num_rows))
    random.Random(0).shuffle(order)
    data = data.take(pa.array(order, pa.int64())).combine_chunks()

    client = flight.connect(uri)
    # bounded, so a server that never answers fails the test instead of hanging it
    options = flight.FlightCallOptions(
        timeout=300.0, headers=[(b"authorization", b"Bearer " + token)]
    )
    command = {"model": model, "text": "text"}
    out = exchange(client, options, command, data, batch_rows)

    ids_in = data.column("id").to_pylist()
    ids_out = out.column("id").to_pylist() if "id" in out.column_names else []
    same_input = out.num_rows == data.num_rows and all(
        name in out.column_names
        and out.column(name).to_pylist() == data.column(name).to_pylist()
        for name in data.column_names
    )
    rows = [
        [r["id"], r["label"], r["label_id"], r["score"], r["probabilities"]]
        for r in out.select(["id", "label", "label_id", "score", "probabilities"]).to_pylist()
    ]

    huge_text = "good " * 20000
    huge = exchange(
        client, options, command,
        pa.table({"id": pa.array([1], pa.int64()), "text": pa.array([huge_text], pa.string())}),
        batch_rows,
    ).to_pylist()

    subset = exchange(
        client, options, {**command, "columns": ["label", "score"]}, data.slice(0, 10),
        batch_rows,
    )
    client.close()

    print(json.dumps({
        "rows": rows,
        "columns": out.column_names,
        "schema": [[f.name, str(f.type)] for f in out.schema],
        "batches_in": len(data.to_batches(max_chunksize=batch_rows)),
        "rows_in": data.num_rows,
        "same_order": ids_in == ids_out,
        "same_input": same_input,
        "huge": {
            "rows": len(huge),
            "label": huge[0]["label"] if huge else None,
            "score": huge[0]["score"] if huge else None,
        },
        "subset": {"columns": subset.column_names, "rows": subset.num_rows},
    }))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
