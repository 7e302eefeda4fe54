"""`spark.read.format("lakeml")`: a Spark 4 Python Data Source (no JVM jars).

Two ways in, by option:

- `query` (+ `endpoint`, and `token` or `user`/`password`; `timeout`): a Flight SQL query on
  `pipeline serve`; with `pipeline` (a pipeline file) instead of `endpoint`, on a local
  worker for that file, started by the driver and by each executor (lakeml_spark._local). The driver calls GetFlightInfo once to plan; each Flight endpoint (the
  server offers one per independent partition of its plan) becomes one Spark partition, which
  fetches its ticket with DoGet. Tickets carry the Delta versions the query was planned at,
  so every partition reads one snapshot. An endpoint without locations is fetched from
  `endpoint` itself.
- `path` (or `.load(path)`, + optional `version`, `rows_per_partition`): a Delta table (one
  lakeml wrote, or write_delta()), on local disk or in an object store; options
  `storage.<key>` are its delta-rs storage options (`storage.aws_endpoint_url`, ...). Planning reads the table's Delta log at `version` (default:
  the latest) with the `deltalake` package and takes exactly its ACTIVE files: files an
  overwrite or a delete removed, and files a failed job left behind uncommitted, are never
  read, whatever lies in the directory. Files are packed into partitions of about 128 MiB
  (`partition_bytes`); `rows_per_partition` splits them further by row ranges (whole Parquet
  row groups are read, then sliced), so a one-file table can still feed many tasks without a
  shuffle. Partition values come from the log; tables whose files do not hold the table's rows
  as they are (deletion vectors, column mapping) are refused.

Register first: `lakeml_spark.register(spark)` (the package must be importable on the
executors: `pip install ./python` there, or ship it with `spark.sparkContext.addPyFile`).
"""
from __future__ import annotations

import urllib.parse

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from . import _flight, _storage

DEFAULT_PARTITION_BYTES = 128 << 20
UNSUPPORTED_READER_FEATURES = {"deletionVectors", "columnMapping"}


class FlightPartition(InputPartition):
    def __init__(self, index: int, ticket: bytes, uri: str):
        super().__init__(index)
        self.ticket, self.uri = ticket, uri


class FilesPartition(InputPartition):
    """[(file URI, first row, end row or None, partition values {column: value})]."""

    def __init__(self, index: int, files: list):
        super().__init__(index)
        self.files = files


def _spark_schema(schema: pa.Schema):
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField, StructType

    from ._predict import _plain

    return StructType([StructField(f.name, from_arrow_type(_plain(f.type), prefer_timestamp_ntz=True),
                                   f.nullable) for f in schema])


def _conform(batch: pa.RecordBatch, target: pa.Schema) -> pa.RecordBatch:
    """A batch with exactly `target`'s columns and types (what Spark was told)."""
    columns = []
    for f in target:
        i = batch.schema.get_field_index(f.name)
        col = batch.column(i) if i >= 0 else pa.nulls(batch.num_rows, f.type)
        columns.append(col if col.type == f.type else col.cast(f.type))
    return pa.RecordBatch.from_arrays(columns, schema=target)


def _spark_arrow_schema(schema):
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


class LakemlDataSource(DataSource):
    """spark.read.format("lakeml").option("query", ...) or .load(delta_path)."""

    @classmethod
    def name(cls) -> str:
        return "lakeml"

    def _mode(self) -> str:
        has_query, has_path = "query" in self.options, "path" in self.options
        if has_query == has_path:
            raise ValueError('format("lakeml") takes either option("query", SQL) with '
                             'option("endpoint", "grpc://HOST:PORT"), or a Delta table path '
                             '(option("path", DIR) or .load(DIR)), not both and not neither')
        return "query" if has_query else "path"

    def schema(self):
        if self._mode() == "query":
            return _spark_schema(_QueryPlan(self.options).info().schema)
        return _spark_schema(_DeltaPlan(self.options).arrow_schema())

    def reader(self, schema) -> DataSourceReader:
        if self._mode() == "query":
            return FlightSqlReader(dict(self.options), schema)
        return DeltaFilesReader(dict(self.options), schema)


class _QueryPlan:
    def __init__(self, options):
        self.query = options["query"]
        endpoint = options.get("endpoint") or options.get("uri")
        pipeline = options.get("pipeline")
        if bool(endpoint) == bool(pipeline):
            raise ValueError('format("lakeml") with a query needs option("endpoint", '
                             '"grpc://HOST:PORT"), a `pipeline serve` address, or '
                             'option("pipeline", FILE), a pipeline file each executor serves '
                             'itself (one local worker), not both')
        self.local = None
        if pipeline:
            from ._local import LocalWorker

            self.local = LocalWorker(pipeline=pipeline,
                                     idle=float(options.get("idle_timeout", "120")))
            self.uri = None  # each process's own worker
        else:
            self.uri = endpoint if "://" in endpoint else "grpc://" + endpoint
        self.timeout = float(options.get("timeout", "600"))
        self.token = options.get("token")
        self.user, self.password = options.get("user"), options.get("password")

    def authorization(self, uri: str | None = None) -> str | None:
        if self.token:
            return self.token
        if self.user:
            return _flight.login(uri or self.uri, self.user, self.password or "", self.timeout)
        return None

    def call_options(self, authorization: str | None):
        import pyarrow.flight as flight

        return flight.FlightCallOptions(timeout=self.timeout,
                                        headers=_flight.headers(authorization))

    def info(self, authorization: str | None = None):
        import pyarrow.flight as flight

        descriptor = flight.FlightDescriptor.for_command(_flight.statement_query(self.query))
        if self.local is None:
            authorization = authorization or self.authorization()
            return _flight.client(self.uri).get_flight_info(descriptor,
                                                             self.call_options(authorization))
        uri, _, path = self.local.connect()
        with self.local.busy(path):
            authorization = authorization or self.authorization(uri)
            return _flight.client(uri).get_flight_info(descriptor,
                                                        self.call_options(authorization))


class FlightSqlReader(DataSourceReader):
    def __init__(self, options: dict, schema):
        self.options, self.schema = options, schema

    def partitions(self):
        plan = _QueryPlan(self.options)
        info = plan.info()
        parts = []
        for i, endpoint in enumerate(info.endpoints):
            uri = plan.uri
            # A local worker's tickets are read by each executor's own worker (a ticket
            # carries the query and the Delta versions it was planned at, not a server).
            for location in ([] if plan.local else endpoint.locations):
                text = location.uri.decode() if isinstance(location.uri, bytes) else str(location.uri)
                if text and not text.startswith("arrow-flight-reuse-connection:"):
                    uri = text
                    break
            parts.append(FlightPartition(i, endpoint.ticket.ticket, uri))
        return parts

    def read(self, partition: FlightPartition):
        import pyarrow.flight as flight

        plan = _QueryPlan(self.options)
        target = _spark_arrow_schema(self.schema)
        if plan.local is None:
            yield from self._fetch(plan, partition.uri, partition.ticket, target)
            return
        uri, _, path = plan.local.connect()
        with plan.local.busy(path):
            yield from self._fetch(plan, uri, partition.ticket, target)

    @staticmethod
    def _fetch(plan, uri: str, ticket: bytes, target):
        import pyarrow.flight as flight

        reader = _flight.client(uri).do_get(flight.Ticket(ticket),
                                            plan.call_options(plan.authorization(uri)))
        for chunk in reader:
            if chunk.data is not None and chunk.data.num_rows:
                yield _conform(chunk.data, target)


class _DeltaPlan:
    def __init__(self, options):
        import deltalake

        self.path = options["path"]
        version = options.get("version")
        self.table = deltalake.DeltaTable(self.path, version=int(version) if version else None,
                                          storage_options=storage_options(options) or None)
        protocol = self.table.protocol()
        features = set(protocol.reader_features or [])
        if protocol.min_reader_version == 2 or features & UNSUPPORTED_READER_FEATURES:
            raise ValueError(
                f"format(\"lakeml\"): {self.path} needs Delta reader features this reader does "
                f"not have (reader v{protocol.min_reader_version}, {sorted(features)}): its "
                "Parquet files do not hold the table's rows as they are")

    def arrow_schema(self) -> pa.Schema:
        return pa.schema(self.table.schema().to_arrow())

    def files(self) -> list[tuple[str, int, int | None, dict]]:
        """(URI, size, rows, partition values) of every active file."""
        actions = pa.table(self.table.get_add_actions(flatten=False)).to_pylist()
        uris = self.table.file_uris()
        out = []
        for i, a in enumerate(actions):
            relative = urllib.parse.unquote(a["path"])
            uri = uris[i] if i < len(uris) and uris[i].endswith(relative) else next(
                (u for u in uris if u.endswith(relative)), None)
            if uri is None:
                raise ValueError(f"format(\"lakeml\"): the Delta log of {self.path} names "
                                 f"{a['path']}, which deltalake's file list does not hold")
            out.append((uri, a["size_bytes"], a.get("num_records"), a.get("partition") or {}))
        return out


def storage_options(options: dict) -> dict:
    """The `storage.<key>` options, as delta-rs storage options."""
    return {k[len("storage."):]: v for k, v in options.items() if k.lower().startswith("storage.")}


class DeltaFilesReader(DataSourceReader):
    def __init__(self, options: dict, schema):
        self.options, self.schema = options, schema

    def partitions(self):
        plan = _DeltaPlan(self.options)
        target = int(self.options.get("partition_bytes", DEFAULT_PARTITION_BYTES))
        rows_per = self.options.get("rows_per_partition")
        rows_per = int(rows_per) if rows_per else None
        pieces = []  # (uri, start, end, values, bytes)
        for uri, size, rows, values in plan.files():
            if rows_per and rows is None:  # no statistics in the log: the Parquet footer
                import pyarrow.parquet as pq

                source, fs = _storage.filesystem(uri, storage_options(self.options))
                rows = pq.ParquetFile(source, filesystem=fs).metadata.num_rows
            if rows_per and rows and rows > rows_per:
                for start in range(0, rows, rows_per):
                    end = min(rows, start + rows_per)
                    pieces.append((uri, start, end, values, size * (end - start) // rows))
            else:
                pieces.append((uri, 0, None, values, size))
        parts, current, current_bytes = [], [], 0
        for uri, start, end, values, nbytes in pieces:
            if current and (rows_per or current_bytes + nbytes > target):
                parts.append(FilesPartition(len(parts), current))
                current, current_bytes = [], 0
            current.append((uri, start, end, values))
            current_bytes += nbytes
        if current:
            parts.append(FilesPartition(len(parts), current))
        # A table without files still needs a partition (it reads nothing).
        return parts or [FilesPartition(0, [])]

    def read(self, partition: FilesPartition):
        import pyarrow.parquet as pq

        target = _spark_arrow_schema(self.schema)
        options = storage_options(self.options)
        for uri, start, end, values in partition.files:
            source, fs = _storage.filesystem(uri, options)
            f = pq.ParquetFile(source, filesystem=fs)
            meta = f.metadata
            end = meta.num_rows if end is None else end
            first = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                lo, hi = max(start, first), min(end, first + n)
                if lo < hi:
                    table = f.read_row_group(g)
                    table = table.slice(lo - first, hi - lo)
                    for column, value in values.items():
                        if column in table.column_names:
                            continue
                        t = target.field(column).type
                        table = table.append_column(
                            column, pa.array([value] * table.num_rows).cast(t)
                            if value is not None else pa.nulls(table.num_rows, t))
                    for batch in table.to_batches(max_chunksize=8192):
                        yield _conform(batch, target)
                first += n
                if first >= end:
                    break


def register(spark) -> None:
    """Makes `spark.read.format("lakeml")` available in this session."""
    spark.dataSource.register(LakemlDataSource)


def read_delta(spark, path: str, version: int | None = None, rows_per_partition: int | None = None,
               storage_options: dict | None = None):
    """A Delta table's active files at `version` (default latest) as a DataFrame; `path` may
    be an object-store URL, with delta-rs's `storage_options` for it."""
    register(spark)
    reader = spark.read.format("lakeml")
    for key, value in (storage_options or {}).items():
        reader = reader.option(f"storage.{key}", str(value))
    if version is not None:
        reader = reader.option("version", str(version))
    if rows_per_partition:
        reader = reader.option("rows_per_partition", str(rows_per_partition))
    return reader.load(_storage.table_uri(path))


def read_query(spark, query: str, endpoint: str | None = None, token: str | None = None,
               timeout: float | None = None, *, pipeline: str | None = None):
    """A Flight SQL query's result from `pipeline serve`, one Spark partition per endpoint:
    the worker at `endpoint`, or, with `pipeline` (a pipeline file), a local worker for that
    file in the driver's process and in each executor (lakeml_spark._local)."""
    import os

    register(spark)
    reader = spark.read.format("lakeml").option("query", query)
    if pipeline:
        reader = reader.option("pipeline", os.path.abspath(os.path.expanduser(pipeline)))
    if endpoint:
        reader = reader.option("endpoint", endpoint)
    if token:
        reader = reader.option("token", token)
    if timeout:
        reader = reader.option("timeout", str(timeout))
    return reader.load()
