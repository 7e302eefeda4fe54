"""predict(): a DataFrame's text through `pipeline serve` workers, with mapInArrow and Flight
DoExchange.

Per Spark partition (one Python task):
1. The partition's Arrow batches are collected (they are needed again if the partition has to
   be retried elsewhere), and only the text column (and the pair) is sent: the other columns
   never leave the executor, they are joined back by position (the worker returns the rows it
   is sent, in order).
2. One DoExchange to one worker: endpoint `(partition id + Spark attempt + retry) % N`, a
   writer thread streams the batches while this thread reads the replies.
3. A transport failure (worker down, killed mid-stream, timed out, stream cut short) retries
   the WHOLE partition on the next endpoint, after `backoff * 2**retry` seconds (capped at
   30 s), at most `retries` times; then the task fails and Spark's own task retry takes over.
   Nothing is yielded before the partition's every row has its prediction, so a partition is
   never half-emitted and Spark's task retry stays correct.
4. A refusal (INVALID_ARGUMENT: the worker will refuse these rows whoever runs them) is not
   retried: with fail_on_error=True it fails the task with the worker's message.

fail_on_error=False (ai_query's errorMessage): an `error` column is appended; a row gets NULL
predictions and a reason there instead of failing the job:
- checked on the executor before sending: a NULL text ("text is NULL"), a binary text that is
  not UTF-8 ("text is not valid UTF-8"), a text column of a non-string type (every row:
  "text column `c` is int64, not a string"); such rows are sent as NULL (the worker answers a
  NULL text with NULL predictions);
- whatever the worker still refuses: the refused request is split in halves and resent,
  down to single rows, so only the rows the worker refuses get its message as their error
  (a refusal costs about 2 log2(rows) extra exchanges per bad row; none when no row is bad).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import pyarrow as pa

from . import _flight
from ._errors import WorkerError
from ._local import LocalWorker

PREDICTED = ("label", "label_id", "score", "probabilities")
MAX_BACKOFF_S = 30.0
OUTPUT_BATCH_ROWS = 8192


def _normalize(endpoint: str) -> str:
    endpoint = endpoint.strip()
    return endpoint if "://" in endpoint else "grpc://" + endpoint


def _endpoints(endpoints) -> list[str]:
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    out = [_normalize(e) for e in (endpoints or []) if e and e.strip()]
    if not out:
        raise ValueError("predict() needs at least one worker endpoint, e.g. "
                         "endpoints=['grpc://127.0.0.1:50051']")
    return out


class _Retryable(Exception):
    """An exchange failed in a way another try may not (its __cause__ is the error)."""


@dataclasses.dataclass(frozen=True)
class _Job:
    """Everything a task needs; pickled into the mapInArrow function."""

    endpoints: tuple[str, ...]
    token: str | None
    text: str
    text_pair: str | None
    command: dict
    predicted: tuple[str, ...]  # the columns the worker appends, in its order
    out_types: tuple  # their Arrow types as Spark wants them back
    batch_rows: int
    timeout: float
    fail_on_error: bool
    retries: int
    backoff: float
    local: LocalWorker | None = None  # no endpoints: this executor's own worker

    def sent_columns(self) -> list[str]:
        return [self.text] + ([self.text_pair] if self.text_pair else [])

    # --- one exchange with failover ----------------------------------------------------------

    def call(self, table: pa.Table, partition: int, attempt: int) -> pa.Table:
        """The predicted columns for `table`'s rows; fails over to the next endpoint on a
        transport error; raises the refusal itself (is_refusal) unchanged."""
        if self.local is not None:
            return self.call_local(table, partition)
        n = len(self.endpoints)
        last: BaseException | None = None
        for retry in range(self.retries + 1):
            uri = self.endpoints[(partition + attempt + retry) % n]
            try:
                return self.exchange(uri, self.token, table)
            except _Retryable as e:
                last = e.__cause__
                if retry == self.retries:
                    break
                delay = min(self.backoff * 2 ** retry, MAX_BACKOFF_S)
                nxt = self.endpoints[(partition + attempt + retry + 1) % n]
                print(f"lakeml_spark: partition {partition}: worker {uri} failed "
                      f"({type(last).__name__}: {_first_line(last)}); retrying the partition "
                      f"({table.num_rows} rows) on {nxt} in {delay:.1f} s "
                      f"(retry {retry + 1} of {self.retries})", file=sys.stderr, flush=True)
                time.sleep(delay)
        raise WorkerError(f"lakeml_spark: partition {partition}: {self.retries + 1} attempts "
                          f"over {n} endpoint(s) failed; last error: {type(last).__name__}: "
                          f"{last}") from last

    def exchange(self, uri: str, token: str | None, table: pa.Table) -> pa.Table:
        """One DoExchange: the predicted columns. A failure worth another try (transport,
        RESOURCE_EXHAUSTED) comes as _Retryable, its cause the error; a refusal or an auth
        failure as it is."""
        try:
            reply = _flight.exchange(uri, self.command, table, self.batch_rows, token,
                                     self.timeout)
            return reply.select(list(self.predicted))
        except _flight.FATAL:
            raise
        except Exception as e:  # noqa: BLE001 - sorted here
            if _flight.is_refusal(e) and not _resource_exhausted(e):
                raise
            _flight.forget(uri)
            raise _Retryable() from e

    def call_local(self, table: pa.Table, partition: int) -> pa.Table:
        """The same on this executor's worker; a worker that fails the call is restarted
        once and the partition sent again."""
        assert self.local is not None
        last: BaseException | None = None
        for attempt in range(2):
            uri, token, path = self.local.connect()
            try:
                with self.local.busy(path):
                    return self.exchange(uri, token, table)
            except _Retryable as e:
                self.local.restart(path, uri)
                last = e.__cause__
                if attempt == 0:
                    print(f"lakeml_spark: partition {partition}: the local worker {uri} failed "
                          f"({type(last).__name__}: {_first_line(last)}); restarting it and "
                          f"sending the partition ({table.num_rows} rows) again",
                          file=sys.stderr, flush=True)
        raise WorkerError(f"lakeml_spark: partition {partition}: the local worker failed twice; "
                          f"last error: {type(last).__name__}: {last}") from last

    def call_or_split(self, table: pa.Table, partition: int, attempt: int):
        """fail_on_error=False: (predicted columns, per-row errors). A refused request is
        split in halves until the refused rows are alone; they get NULL predictions and the
        worker's message."""
        try:
            return self.call(table, partition, attempt), [None] * table.num_rows
        except Exception as e:  # noqa: BLE001
            if not (_flight.is_refusal(e) and not _resource_exhausted(e)):
                raise
            if table.num_rows == 1:
                return self.nulls(1), [f"refused by the worker: {_first_line(e)}"]
        half = table.num_rows // 2
        a, ea = self.call_or_split(table.slice(0, half), partition, attempt)
        b, eb = self.call_or_split(table.slice(half), partition, attempt)
        return pa.concat_tables([a, b]), ea + eb

    def nulls(self, rows: int) -> pa.Table:
        return pa.table({name: pa.nulls(rows, t) for name, t in zip(self.predicted, self.out_types)})

    # --- the partition -----------------------------------------------------------------------

    def __call__(self, batches):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx else 0
        attempt = ctx.attemptNumber() if ctx else 0
        batches = [b for b in batches if b.num_rows]
        if not batches:
            return
        data = pa.Table.from_batches(batches)
        if self.fail_on_error:
            send = pa.table({c: _as_sent(data.column(c)) for c in self.sent_columns()})
            try:
                predicted = self.call(send, partition, attempt)
            except Exception as e:  # noqa: BLE001
                if _flight.is_refusal(e) and not _resource_exhausted(e):
                    raise WorkerError(
                        f"lakeml_spark: partition {partition}: the worker refused its rows: "
                        f"{_first_line(e)} (fail_on_error=False gives those rows NULL "
                        "predictions and an `error` instead)") from e
                raise
            errors = None
        else:
            send, errors = self.checked(data)
            predicted, refused = self.call_or_split(send, partition, attempt)
            errors = [e or r for e, r in zip(errors, refused)]
            missing = predicted.column(self.predicted[0]).is_null().to_pylist()
            errors = [e or ("no prediction" if m else None) for e, m in zip(errors, missing)]
        columns = list(data.columns)
        names = list(data.column_names)
        for name, t in zip(self.predicted, self.out_types):
            columns.append(predicted.column(name).cast(t))
            names.append(name)
        if errors is not None:
            columns.append(pa.array(errors, pa.string()))
            names.append("error")
        out = pa.Table.from_arrays(columns, names=names)
        # Only now, the whole partition predicted: never half-emitted.
        yield from out.to_batches(max_chunksize=OUTPUT_BATCH_ROWS)

    def checked(self, data: pa.Table):
        """fail_on_error=False: the columns to send, rows that cannot be sent set to NULL, and
        each row's reason (None: fine)."""
        errors: list[str | None] = [None] * data.num_rows
        send = {}
        for c in self.sent_columns():
            col = data.column(c).combine_chunks()
            t = col.type
            if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
                values = col.cast(pa.string())
            elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
                texts = []
                for i, v in enumerate(col.to_pylist()):
                    if v is None:
                        texts.append(None)
                        continue
                    try:
                        texts.append(v.decode("utf-8"))
                    except UnicodeDecodeError:
                        texts.append(None)
                        errors[i] = errors[i] or f"{c} is not valid UTF-8"
                values = pa.array(texts, pa.string())
            else:
                values = pa.nulls(len(col), pa.string())
                for i, v in enumerate(col.is_valid().to_pylist()):
                    if v:
                        errors[i] = errors[i] or f"text column `{c}` is {t}, not a string"
            if c == self.text:
                for i, v in enumerate(col.is_null().to_pylist()):
                    if v:
                        errors[i] = errors[i] or f"{c} is NULL"
            send[c] = values
        return pa.table(send), errors


def _as_sent(col):
    """A string column as the worker reads it (plain Utf8); anything else is sent as it is,
    for the worker to accept or refuse."""
    t = col.type
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return col.cast(pa.string())
    return col


def _first_line(e: BaseException) -> str:
    """The worker's own message, without pyarrow's wrapping and gRPC's debug context."""
    text = str(e).strip()
    if "with message: " in text:
        text = text.split("with message: ", 1)[1]
    for cut in (". gRPC client debug context", " gRPC client debug context", ". Client context:",
                ". Detail:"):
        text = text.split(cut, 1)[0]
    text = text.strip()
    return text.splitlines()[0] if text else type(e).__name__


def _resource_exhausted(e: BaseException) -> bool:
    """RESOURCE_EXHAUSTED (too many calls at once on that worker) is worth another worker."""
    text = str(e).lower()
    return "resource exhausted" in text or "resource_exhausted" in text or "resourceexhausted" in text


def _appended_schema(uri: str, token: str | None, command: dict, sent: list[str],
                     timeout: float) -> pa.Schema:
    """The worker's answer to one row of empty text: the schema of the columns it appends
    (the model's label type included)."""
    row = pa.table({c: pa.array([""], pa.string()) for c in sent})
    reply = _flight.exchange(uri, command, row, 1, token, timeout)
    return pa.schema([f for f in reply.schema if f.name not in sent])


def probe(endpoints: list[str], token: str | None, command: dict, sent: list[str],
          timeout: float, retries: int, backoff: float) -> pa.Schema:
    """_appended_schema() from the first endpoint that answers."""
    last = None
    for retry in range(max(retries + 1, len(endpoints))):
        uri = endpoints[retry % len(endpoints)]
        try:
            return _appended_schema(uri, token, command, sent, timeout)
        except _flight.FATAL:
            raise
        except Exception as e:  # noqa: BLE001
            if _flight.is_refusal(e):
                raise WorkerError(f"lakeml_spark: the worker at {uri} refused the request "
                                  f"{command}: {_first_line(e)}") from e
            _flight.forget(uri)
            last = e
            time.sleep(min(backoff * 2 ** (retry // len(endpoints)), MAX_BACKOFF_S))
    raise WorkerError(f"lakeml_spark: no worker answered ({', '.join(endpoints)}); last error: "
                      f"{type(last).__name__}: {last}") from last


def probe_local(sc, local: LocalWorker, command: dict, sent: list[str],
                timeout: float) -> pa.Schema:
    """probe() on an executor's own worker, in a one-task Spark job (which also starts the
    worker there, or fails with the worker's own message)."""

    def lakeml_probe(_):
        uri, token, path = local.connect()
        with local.busy(path):
            schema = _appended_schema(uri, token, command, sent, timeout)
        yield schema.serialize().to_pybytes()

    (schema,) = sc.parallelize([0], 1).mapPartitions(lakeml_probe).collect()
    return pa.ipc.read_schema(pa.py_buffer(schema))


def predict(df, text: str = "text", model: str | None = None, endpoints=None,
            token: str | None = None, *, text_pair: str | None = None,
            columns: list[str] | None = None, batch_rows: int = 8192, timeout: float = 600.0,
            fail_on_error: bool = True, retries: int = 3, backoff: float = 0.5,
            threads: int | None = None, precision: str | None = None,
            max_length: int | None = None, idle_timeout: float = 120.0):
    """`df` with the worker's predictions appended: `label`, `label_id`, `score`,
    `probabilities` (or `columns`, a subset), plus `error` when fail_on_error is False.

    Without `endpoints`, `model` (a model directory or an object-store URL) runs on the
    executors themselves: each starts one local `pipeline serve` for it (127.0.0.1, a random
    port and token), shared by all its tasks, with `threads` (default: the executor's cores),
    `precision` and `max_length` as a `serve.models` entry takes them; it stops when the
    executor does, or after `idle_timeout` seconds unused (lakeml_spark._local). A worker
    that dies mid-task is restarted once and the partition sent again.

    endpoints: `pipeline serve` addresses (`grpc://host:port`, a list or a comma-separated
    string); partition p starts on endpoints[p % N]. token: the workers' Bearer token.
    model: a model name of the workers' `serve.models` (default: their default model).
    batch_rows: rows per Flight batch (the worker sorts each batch by length before cutting it
    into forward passes, so larger batches pad less; 8192 is the predict stage's window).
    timeout: seconds per DoExchange call (a partition's whole exchange). retries: further attempts of a failed partition on the next endpoints,
    with backoff * 2**retry seconds between them. The output schema comes from a worker (one
    row of empty text is sent on the driver), not from this code.
    """
    if columns:
        unknown = [c for c in columns if c not in PREDICTED]
        if unknown:
            raise ValueError(f"predict(): unknown columns {unknown}; the worker appends "
                             f"{', '.join(PREDICTED)}")
    local = _local_worker(df, model, endpoints, threads, precision, max_length, idle_timeout)
    return _exchange("predict", df, text, model, endpoints, token, text_pair,
                     list(columns) if columns else list(PREDICTED), batch_rows, timeout,
                     fail_on_error, retries, backoff, local)


def embed(df, text: str = "text", model: str | None = None, endpoints=None,
          token: str | None = None, *, batch_rows: int = 8192, timeout: float = 600.0,
          fail_on_error: bool = True, retries: int = 3, backoff: float = 0.5,
          threads: int | None = None, precision: str | None = None,
          max_length: int | None = None, idle_timeout: float = 120.0):
    """`df` with the worker's sentence vector of `text` appended as `embedding`
    (array<float>), plus `error` when fail_on_error is False: the model's pooling, as the
    `embed` stage and `embed(text)` in SQL make it. Endpoints (or workers on the executors,
    with `model` and no `endpoints`), failover, retries and batching are predict()'s.
    """
    local = _local_worker(df, model, endpoints, threads, precision, max_length, idle_timeout)
    return _exchange("embed", df, text, model, endpoints, token, None, ["embedding"],
                     batch_rows, timeout, fail_on_error, retries, backoff, local)


def _local_worker(df, model, endpoints, threads, precision, max_length, idle_timeout):
    """The executors' own worker when there are no endpoints (None otherwise)."""
    if endpoints:
        return None
    if not model:
        raise ValueError("lakeml_spark: give `model` (a model directory or URL) to run it on "
                         "the executors, or `endpoints` of `pipeline serve` workers, e.g. "
                         "endpoints=['grpc://10.0.0.5:50051']")
    if idle_timeout <= 0:
        raise ValueError("idle_timeout must be positive (seconds)")
    if "://" not in model:
        model = os.path.abspath(os.path.expanduser(model))
    if threads is None:
        threads = _executor_cores(df.sparkSession.sparkContext)
    return LocalWorker(model=model, threads=threads, precision=precision,
                       max_length=max_length, idle=float(idle_timeout))


def _executor_cores(sc) -> int | None:
    """spark.executor.cores, or local[N]'s N; None: the worker's default (all cores)."""
    cores = sc.getConf().get("spark.executor.cores", None)
    if cores:
        return int(cores)
    match = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?", sc.master)
    if match:
        n = match.group(1)
        return 1 if n is None else (os.cpu_count() or 1) if n == "*" else int(n)
    return None


def _exchange(caller, df, text, model, endpoints, token, text_pair, columns, batch_rows,
              timeout, fail_on_error, retries, backoff, local):
    """predict() and embed(): `columns` from the workers, appended to `df` by mapInArrow."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_type
    from pyspark.sql.types import StringType, StructField, StructType

    uris = [] if local is not None else _endpoints(endpoints)
    if batch_rows < 1 or retries < 0 or timeout <= 0 or backoff < 0:
        raise ValueError("batch_rows must be at least 1, retries at least 0, timeout positive, "
                         "backoff not negative")
    for c in [text] + ([text_pair] if text_pair else []):
        if c not in df.columns:
            raise ValueError(f"{caller}(): no column `{c}` in the DataFrame (it has "
                             f"{', '.join(df.columns)})")
    command = {"text": text, "text_pair": text_pair, "columns": columns}
    if model and local is None:
        command["model"] = model
    sent = [text] + ([text_pair] if text_pair else [])

    if local is None:
        schema = probe(uris, token, command, sent, min(timeout, 120.0), retries, backoff)
    else:
        schema = probe_local(df.sparkSession.sparkContext, local, command, sent, timeout)
    clash = [f.name for f in schema if f.name in df.columns]
    if not fail_on_error and "error" in df.columns:
        clash.append("error")
    if clash:
        raise ValueError(f"{caller}(): the DataFrame already has {clash}, which {caller}() "
                         "appends; rename or drop them first")
    fields = [StructField(f.name, from_arrow_type(_plain(f.type)), True) for f in schema]
    out_types = tuple(to_arrow_type(f.dataType) for f in fields)
    if not fail_on_error:
        fields.append(StructField("error", StringType(), True))
    out_schema = StructType(list(df.schema.fields) + fields)
    job = _Job(endpoints=tuple(uris), token=token, text=text, text_pair=text_pair,
               command=command, predicted=tuple(f.name for f in schema), out_types=out_types,
               batch_rows=batch_rows, timeout=timeout, fail_on_error=fail_on_error,
               retries=retries, backoff=backoff, local=local)

    def lakeml_predict(batches):
        return job(batches)

    return df.mapInArrow(lakeml_predict, out_schema)


def _plain(t: pa.DataType) -> pa.DataType:
    """Large and view types as the plain ones Spark maps."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_list(t):
        return pa.list_(_plain(t.value_type))
    return t
