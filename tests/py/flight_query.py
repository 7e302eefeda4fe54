"""Run SQL statements on `pipeline serve` through ADBC's Flight SQL DB-API driver.

usage: flight_query.py URI (--token TOKEN | --user USER --password PASSWORD)
                       [--started FILE] [--timeout S] [--deadline S] [--tls-root PEM]
                       SQL [SQL ...]
Runs each statement in turn on one connection. A failing statement (or a failed connect) is
recorded, not raised, so the caller sees every outcome. `--started FILE` creates FILE just
before the first statement is sent (to time a signal against a query in flight); `--timeout`
bounds each call (default 300 s); after `--deadline` seconds (default 900) the script prints
what it has, with "watchdog": true, and exits, so a server that never answers cannot hang
the caller. Prints one JSON object:
  connect_error  {"error": class, "status": ADBC status, "message": ...} or null
  results        per statement: {"columns": [...], "rows": [[...], ...], "elapsed_s": s}
                 or {"error": class, "status": ADBC status, "message": ..., "elapsed_s": s}
  watchdog       true when the deadline cut the run short
"""
import argparse
import json
import math
import os
import sys
import threading
import time

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql


def json_safe(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def error(e: BaseException) -> dict:
    status = getattr(e, "status_code", None)
    return {
        "error": type(e).__name__,
        "status": getattr(status, "name", None if status is None else str(status)),
        "message": str(e),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("--token")
    parser.add_argument("--user")
    parser.add_argument("--password")
    parser.add_argument("--started")
    parser.add_argument("--timeout", default="300")
    parser.add_argument("--deadline", type=float, default=900.0)
    parser.add_argument("--tls-root", help="a PEM file of the CA that signed a TLS server's certificate")
    parser.add_argument("sql", nargs="+")
    args = parser.parse_args()

    options = adbc_driver_flightsql.DatabaseOptions
    db_kwargs = {
        # bound every call, so a hung server fails the test instead of stalling it
        options.TIMEOUT_QUERY.value: args.timeout,
        options.TIMEOUT_FETCH.value: args.timeout,
        options.TIMEOUT_UPDATE.value: args.timeout,
    }
    if args.tls_root:
        with open(args.tls_root) as f:
            db_kwargs[options.TLS_ROOT_CERTS.value] = f.read()
    if args.token is not None:
        db_kwargs[options.AUTHORIZATION_HEADER.value] = "Bearer " + args.token
    else:
        db_kwargs["username"] = args.user
        db_kwargs["password"] = args.password

    result = {"connect_error": None, "results": [], "watchdog": False}
    lock = threading.Lock()

    def finish(watchdog: bool) -> None:
        with lock:  # printed once, by whichever comes first
            result["watchdog"] = watchdog
            print(json.dumps(result))
            sys.stdout.flush()
            os._exit(0)

    timer = threading.Timer(args.deadline, finish, args=(True,))
    timer.daemon = True
    timer.start()

    try:
        conn = flight_sql.connect(args.uri, db_kwargs=db_kwargs, autocommit=True)
        cur = conn.cursor()
    except Exception as e:  # noqa: BLE001 - recorded for the caller to judge
        result["connect_error"] = error(e)
        conn = cur = None

    if args.started:
        with open(args.started, "w") as f:
            f.write("started\n")

    if cur is not None:
        for sql in args.sql:
            started = time.monotonic()
            try:
                cur.execute(sql)
                rows = cur.fetchall()
                columns = [d[0] for d in cur.description or []]
                outcome = {"columns": columns, "rows": json_safe(rows)}
            except Exception as e:  # noqa: BLE001
                outcome = error(e)
            outcome["elapsed_s"] = time.monotonic() - started
            with lock:
                result["results"].append(outcome)
        try:
            cur.close()
            conn.close()
        except Exception:  # noqa: BLE001 - the server may be gone (shutdown tests)
            pass

    finish(False)


if __name__ == "__main__":
    main()
