"""Try what `pipeline serve` must refuse, with real clients, and record how it refuses.

usage: flight_refusals.py URI USER PASSWORD TOKEN
USER/PASSWORD is a valid login, TOKEN a valid static Bearer token. Every case is recorded as
{"error": exception class, "status": ADBC status (ADBC cases), "message": ...} or
{"ok": what came back}; nothing is raised, so the caller sees every outcome. Prints one JSON
object with these keys:
  no_token, wrong_token      a Flight SQL query (GetFlightInfo, CommandStatementQuery built
                             here by hand) with no / a wrong `authorization` header (pyarrow)
  wrong_password             pyarrow's Basic handshake with a wrong password
  wrong_password_adbc        ADBC connect + query with a wrong password
  exchange_no_token          DoExchange without a token
  login                      the valid handshake (ok: the header name it returned)
  static_token               ADBC with the static token: SELECT count(*) FROM reviews
  sql                        {statement: outcome} for writes sent as queries (execute)
  sql_update                 {statement: outcome} for the same sent as updates (executescript)
  copy_target_exists         whether COPY/CREATE EXTERNAL TABLE left files in their target dir
  count_after                ADBC: SELECT count(*) FROM reviews after all of the above
  bad_ticket                 DoGet with a ticket the server never issued
  bad_descriptor             DoExchange whose command is not JSON
  exchange_no_text           DoExchange of a batch without the `text` column
  exchange_int_text          DoExchange of a batch whose `text` is int64
  exchange_unknown_model     DoExchange naming the model `nosuch_model`
"""
import json
import os
import shutil
import sys
import tempfile

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql
import pyarrow as pa
import pyarrow.flight as flight

STATEMENT_QUERY_TYPE = "type.googleapis.com/arrow.flight.protocol.sql.CommandStatementQuery"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    """A protobuf field of wire type 2 (string, bytes, message)."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def statement_query(query: str) -> bytes:
    """google.protobuf.Any{type_url, value: CommandStatementQuery{query = 1}}."""
    command = length_delimited(1, query.encode("utf-8"))
    return length_delimited(1, STATEMENT_QUERY_TYPE.encode()) + length_delimited(2, command)


def error(e: BaseException) -> dict:
    out = {"error": type(e).__name__, "message": str(e)}
    status = getattr(e, "status_code", None)  # ADBC's exceptions carry their status
    if status is not None:
        out["status"] = getattr(status, "name", str(status))
    return out


def outcome(fn) -> dict:
    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - the refusal is what is recorded
        return error(e)


TIMEOUT_S = 120.0  # per call: a server that never answers fails the case, not the test run


def bearer(token: bytes) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(
        timeout=TIMEOUT_S, headers=[(b"authorization", b"Bearer " + token)]
    )


def exchange(client, options, command: bytes, table: pa.Table):
    """One DoExchange: send `table`, read everything back. The server's status arrives on the
    read side; a write that fails because the server already answered is reported only if
    the read did not fail."""
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), options)
    write_error = None
    try:
        writer.begin(table.schema)
        for batch in table.to_batches(max_chunksize=500):
            writer.write_batch(batch)
        writer.done_writing()
    except Exception as e:  # noqa: BLE001
        write_error = e
    try:
        result = reader.read_all()
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - the read error (or write error) says more
            pass
    if write_error is not None:
        raise write_error
    return {"rows": result.num_rows, "columns": result.column_names}


def adbc_rows(conn, sql: str):
    cur = conn.cursor()
    try:
        cur.execute(sql)
        return [list(r) for r in cur.fetchall()]
    finally:
        cur.close()


def adbc_update(conn, sql: str):
    cur = conn.cursor()
    try:
        cur.executescript(sql)
        return cur.rowcount
    finally:
        cur.close()


def main() -> None:
    uri, user, password, token = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    options = adbc_driver_flightsql.DatabaseOptions
    timeouts = {options.TIMEOUT_QUERY.value: "120", options.TIMEOUT_FETCH.value: "120",
                options.TIMEOUT_UPDATE.value: "120"}
    result = {}
    client = flight.connect(uri)
    count_query = flight.FlightDescriptor.for_command(
        statement_query("SELECT count(*) FROM reviews")
    )

    # --- authentication
    no_auth = flight.FlightCallOptions(timeout=TIMEOUT_S)
    result["no_token"] = outcome(lambda: str(client.get_flight_info(count_query, no_auth)))
    result["wrong_token"] = outcome(
        lambda: str(client.get_flight_info(count_query, bearer(b"nope")))
    )
    result["wrong_password"] = outcome(
        lambda: list(client.authenticate_basic_token(user, "not-" + password, no_auth))
    )

    def wrong_password_adbc():
        conn = flight_sql.connect(
            uri, db_kwargs={"username": user, "password": "not-" + password, **timeouts},
            autocommit=True,
        )
        try:
            return adbc_rows(conn, "SELECT count(*) FROM reviews")
        finally:
            conn.close()

    result["wrong_password_adbc"] = outcome(wrong_password_adbc)
    result["exchange_no_token"] = outcome(lambda: exchange(
        client, no_auth,
        json.dumps({"model": "sentiment", "text": "text"}).encode(),
        pa.table({"text": ["fine"]}),
    ))

    login = outcome(lambda: client.authenticate_basic_token(user, password, no_auth))
    if "ok" in login:
        key, value = login["ok"]
        login_options = flight.FlightCallOptions(timeout=TIMEOUT_S, headers=[(key, value)])
        login = {"ok": key.decode() if isinstance(key, bytes) else key}
    else:
        login_options = bearer(token.encode())
    result["login"] = login

    # --- the static token, through ADBC
    def static_token():
        conn = flight_sql.connect(
            uri, db_kwargs={options.AUTHORIZATION_HEADER.value: "Bearer " + token, **timeouts},
            autocommit=True,
        )
        try:
            return adbc_rows(conn, "SELECT count(*) FROM reviews")
        finally:
            conn.close()

    result["static_token"] = outcome(static_token)

    # --- writes of every kind, with a valid login: refused, and nothing written anywhere
    target = tempfile.mkdtemp(prefix="lakeml-refusals-")
    statements = [
        "CREATE TABLE t AS SELECT 1",
        "INSERT INTO reviews SELECT * FROM reviews",
        "DROP TABLE reviews",
        f"COPY reviews TO '{target}/x.parquet'",
        f"CREATE EXTERNAL TABLE x STORED AS PARQUET LOCATION '{target}/'",
        "SET datafusion.execution.batch_size = 1",
        "DELETE FROM reviews",
    ]
    try:
        conn = flight_sql.connect(
            uri, db_kwargs={"username": user, "password": password, **timeouts},
            autocommit=True,
        )
    except Exception as e:  # noqa: BLE001
        result["sql_connect"] = error(e)
        conn = None
    if conn is not None:
        result["sql"] = {s: outcome(lambda s=s: adbc_rows(conn, s)) for s in statements}
        result["sql_update"] = {s: outcome(lambda s=s: adbc_update(conn, s)) for s in statements}
        result["count_after"] = outcome(lambda: adbc_rows(conn, "SELECT count(*) FROM reviews"))
        conn.close()
    result["copy_target_exists"] = bool(os.listdir(target))
    shutil.rmtree(target, ignore_errors=True)

    # --- malformed requests, with a valid login
    result["bad_ticket"] = outcome(
        lambda: client.do_get(flight.Ticket(b"garbage"), login_options).read_all().num_rows
    )
    result["bad_descriptor"] = outcome(
        lambda: exchange(client, login_options, b"not json", pa.table({"text": ["fine"]}))
    )
    command = json.dumps({"model": "sentiment", "text": "text"}).encode()
    result["exchange_no_text"] = outcome(lambda: exchange(
        client, login_options, command,
        pa.table({"id": pa.array([1], pa.int64()), "body": ["fine"]}),
    ))
    result["exchange_int_text"] = outcome(lambda: exchange(
        client, login_options, command,
        pa.table({"id": pa.array([1], pa.int64()), "text": pa.array([7], pa.int64())}),
    ))
    result["exchange_unknown_model"] = outcome(lambda: exchange(
        client, login_options,
        json.dumps({"model": "nosuch_model", "text": "text"}).encode(),
        pa.table({"id": pa.array([1], pa.int64()), "text": ["fine"]}),
    ))
    client.close()

    print(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
