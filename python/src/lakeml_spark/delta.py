"""write_delta(): a DataFrame into a Delta table, in ONE commit, exactly once per (app_id,
version).

1. Driver, before any work: if the table exists and its Delta app transaction for `app_id`
   is at `version` or later, the job is done already: nothing is computed or written. An
   append must match the table's columns and types.
2. Executors (one Spark job): each task writes its partition's rows as Parquet files
   (`part-<partition>-<uuid>.parquet`, rolled at `max_rows_per_file`) straight into the
   table's directory, with the table's Arrow schema, and returns (path, size, rows, stats).
   Nothing references these files yet: a failed, retried or killed task or job only leaves
   files no Delta version names (`DeltaTable.vacuum` removes them).
3. Driver: the table is read again; if `app_id` got to `version` meanwhile, nothing is
   committed. Otherwise all the files go into one transaction with `deltalake`'s
   `create_write_transaction` (or `create_table_with_add_actions` for a new table), carrying
   `txn(app_id, version)`. A concurrent commit of the same app id makes this commit fail
   (delta-rs's conflict check), so two runs of one job version cannot both land.
   `overwrite` removes every file of the previous version in that same commit.

A killed driver (at any moment) therefore leaves the table at its previous version; rerun
the job: it writes its files again and commits once.
"""
from __future__ import annotations

import json
import os
import time
import uuid

import pyarrow as pa

from . import _storage

DEFAULT_MAX_ROWS_PER_FILE = 1_000_000


def _open_table(path: str, storage_options: dict | None):
    import deltalake

    try:
        return deltalake.DeltaTable(path, storage_options=storage_options)
    except deltalake.exceptions.TableNotFoundError:
        return None


def _delta_types(schema: pa.Schema) -> dict:
    """{column: Delta type JSON} (nullability aside), to compare an append with the table."""
    from deltalake import Schema

    return {f["name"]: f["type"] for f in json.loads(Schema.from_arrow(schema).to_json())["fields"]}


def _stats(table: pa.Table) -> str:
    """Delta file statistics: numRecords; nullCount of the top-level non-struct columns;
    minValues/maxValues of the integer ones (others are left out: absent means unknown)."""
    import pyarrow.compute as pc

    null_count, lo, hi = {}, {}, {}
    for name, col in zip(table.column_names, table.columns):
        t = col.type
        if pa.types.is_struct(t):
            continue
        null_count[name] = col.null_count
        if pa.types.is_integer(t) and col.null_count < len(col):
            mm = pc.min_max(col)
            lo[name], hi[name] = mm["min"].as_py(), mm["max"].as_py()
    return json.dumps({"numRecords": table.num_rows, "minValues": lo, "maxValues": hi,
                       "nullCount": null_count})


class _FileWriter:
    """The executor side: one partition's rows into Parquet files in the table directory,
    on local disk or, through pyarrow's file systems, in an object store."""

    def __init__(self, root: str, schema: pa.Schema, max_rows: int, storage_options: dict | None):
        self.root, self.schema, self.max_rows = root, schema, max_rows
        self.storage_options = storage_options

    def __call__(self, batches):
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx else 0
        base, fs = _storage.filesystem(self.root, self.storage_options)
        pending: list[pa.RecordBatch] = []
        rows = 0
        written = []

        def flush():
            if not pending:
                return
            table = pa.Table.from_batches(pending, schema=self.schema)
            name = f"part-{partition:05d}-{uuid.uuid4()}-c000.snappy.parquet"
            full = f"{base.rstrip('/')}/{name}"
            pq.write_table(table, full, compression="snappy", filesystem=fs)
            if fs is None:
                st = os.stat(full)
                size, mtime = st.st_size, int(st.st_mtime * 1000)
            else:
                info = fs.get_file_info(full)
                size, mtime = info.size, int(time.time() * 1000)
            written.append((name, size, mtime, table.num_rows, _stats(table)))
            pending.clear()

        for batch in batches:
            if not batch.num_rows:
                continue
            batch = _cast(batch, self.schema)
            while batch.num_rows:
                take = min(batch.num_rows, self.max_rows - rows)
                pending.append(batch.slice(0, take))
                rows += take
                batch = batch.slice(take)
                if rows >= self.max_rows:
                    flush()
                    rows = 0
        flush()
        if written:
            names, sizes, times, counts, stats = zip(*written)
            yield pa.RecordBatch.from_pydict(
                {"path": list(names), "size": list(sizes), "modification_time": list(times),
                 "rows": list(counts), "stats": list(stats)},
                schema=pa.schema([("path", pa.string()), ("size", pa.int64()),
                                  ("modification_time", pa.int64()), ("rows", pa.int64()),
                                  ("stats", pa.string())]))


def _cast(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    columns = [batch.column(f.name) for f in schema]
    columns = [c if c.type == f.type else c.cast(f.type) for c, f in zip(columns, schema)]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def write_delta(df, path: str, mode: str = "append", app_id: str | None = None,
                version: int | None = None, *, max_rows_per_file: int = DEFAULT_MAX_ROWS_PER_FILE,
                metadata: dict | None = None, before_commit=None,
                storage_options: dict | None = None) -> dict:
    """Writes `df` to the Delta table at `path` in one commit; returns what happened:
    {"committed": bool, "version": table version after, "rows": n, "files": n, "reason": ...}.

    mode: "append" (creates the table if missing) or "overwrite" (replaces every row, and the
    schema, in a new version; old versions stay readable). app_id/version: the job's Delta app
    transaction; a table whose txn for app_id is already >= version is left as it is (the
    rerun of a job that committed). metadata: extra commitInfo entries. before_commit: a
    callable run on the driver after the files are written, just before the commit (a hook
    for tests and progress reporting). path may be an object-store URL (s3://, az://,
    abfss://, gs://); storage_options are delta-rs's keys for it (see `_storage`): delta-rs
    commits with them (a conditional put on S3 and Azure), and the executors write the
    Parquet files through pyarrow's file system built from them.
    """
    import deltalake
    from deltalake import CommitProperties, Transaction
    from deltalake.transaction import AddAction, create_table_with_add_actions
    from pyspark.sql.pandas.types import to_arrow_schema

    if mode not in ("append", "overwrite"):
        raise ValueError(f"write_delta(): mode must be 'append' or 'overwrite', not {mode!r}")
    if (app_id is None) != (version is None):
        raise ValueError("write_delta(): give app_id and version together (or neither)")
    if version is not None and (not isinstance(version, int) or version < 0):
        raise ValueError(f"write_delta(): version must be a non-negative int, not {version!r}")
    if max_rows_per_file < 1:
        raise ValueError("write_delta(): max_rows_per_file must be at least 1")
    root = _storage.table_uri(path)

    def covered(table) -> int | None:
        if table is None or app_id is None:
            return None
        done = table.transaction_version(app_id)
        return done if done is not None and done >= version else None

    table = _open_table(root, storage_options)
    done = covered(table)
    if done is not None:
        return {"committed": False, "version": table.version(), "rows": 0, "files": 0,
                "reason": f"the table's txn for {app_id} is at {done} >= {version}: "
                          "this job version was committed already"}

    # Delta's view of Spark's schema (timestamps as UTC, lists as Delta arrays)...
    arrow = pa.schema(deltalake.Schema.from_arrow(
        to_arrow_schema(df.schema, timezone="UTC")).to_arrow())
    if table is not None and mode == "append":
        have = pa.schema(table.schema().to_arrow())
        want, got = _delta_types(have), _delta_types(arrow)
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()), key=str)
            raise ValueError(
                f"write_delta(): the DataFrame's columns do not match the table {path} "
                f"(append needs the same columns and types; differing: "
                f"{[d[0] for d in diff]}); use mode='overwrite' to replace the schema")
        # ...and the table's own Arrow schema (nullability, field names) for the files.
        arrow = have
    if not _storage.is_remote(root):
        os.makedirs(root, exist_ok=True)

    started = time.monotonic()
    out_schema = "path string, size long, modification_time long, rows long, stats string"
    files = df.mapInArrow(_FileWriter(root, arrow, max_rows_per_file, storage_options).__call__,
                          out_schema).collect()
    write_s = time.monotonic() - started
    if before_commit is not None:
        before_commit([r.asDict() for r in files])

    adds = [AddAction(r["path"], r["size"], {}, r["modification_time"], True, r["stats"])
            for r in files]
    rows = sum(r["rows"] for r in files)
    properties = CommitProperties(
        custom_metadata={"lakeml_spark": {"app_id": app_id, "app_version": version, "mode": mode,
                                          "rows": rows, "files": len(adds)}, **(metadata or {})},
        app_transactions=[Transaction(app_id, version)] if app_id is not None else None,
    )
    table = _open_table(root, storage_options)
    done = covered(table)
    if done is not None:
        return {"committed": False, "version": table.version(), "rows": 0, "files": 0,
                "reason": f"another run committed {app_id} version {done} while this one was "
                          f"writing; its {len(adds)} files are left unreferenced"}
    if table is None:
        create_table_with_add_actions(root, deltalake.Schema.from_arrow(arrow), adds,
                                      mode="error", commit_properties=properties,
                                      storage_options=storage_options)
    else:
        table.create_write_transaction(adds, mode, arrow, commit_properties=properties)
    after = deltalake.DeltaTable(root, storage_options=storage_options)
    return {"committed": True, "version": after.version(), "rows": rows, "files": len(adds),
            "write_s": write_s}
