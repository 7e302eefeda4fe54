"""Many Flight SQL clients at once on `pipeline serve` (ADBC DB-API, one connection each).

usage: flight_load.py URI TOKEN CLIENTS QUERIES
CLIENTS threads each open their own connection with the Bearer TOKEN and run QUERIES
queries, alternating `SELECT id, predict(text) FROM reviews WHERE id % 7 = k` (k cycling
over 0..6) and `SELECT count(*), max(id) FROM reviews`. Everything stops at a 300 s
deadline; queries not run by then count as failures. Prints one JSON object: queries (run
or due), failures, errors (the first 5 messages), p50_ms, p99_ms (over the queries that
succeeded), rows (fetched in all), rows_per_s (rows over the whole run's wall time),
wall_s.
"""
import json
import os
import sys
import threading
import time

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql

DEADLINE_S = 300.0


def percentile(sorted_values, q: float):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def main() -> None:
    uri, token = sys.argv[1], sys.argv[2]
    clients, queries = int(sys.argv[3]), int(sys.argv[4])
    options = adbc_driver_flightsql.DatabaseOptions
    db_kwargs = {
        options.AUTHORIZATION_HEADER.value: "Bearer " + token,
        options.TIMEOUT_QUERY.value: "120",
        options.TIMEOUT_FETCH.value: "120",
    }
    started = time.monotonic()
    deadline = started + DEADLINE_S
    lock = threading.Lock()
    latencies_ms = []
    errors = []
    totals = {"rows": 0}

    def fail(message: str) -> None:
        with lock:
            if len(errors) < 5:
                errors.append(message)

    def client(index: int) -> None:
        try:
            conn = flight_sql.connect(uri, db_kwargs=db_kwargs, autocommit=True)
            cur = conn.cursor()
        except Exception as e:  # noqa: BLE001
            fail(f"client {index}: connect: {type(e).__name__}: {e}")
            return
        try:
            for q in range(queries):
                if time.monotonic() > deadline:
                    fail(f"client {index}: {queries - q} queries left at the deadline")
                    return
                if q % 2 == 0:
                    sql = f"SELECT id, predict(text) FROM reviews WHERE id % 7 = {(index + q // 2) % 7}"
                else:
                    sql = "SELECT count(*), max(id) FROM reviews"
                t0 = time.monotonic()
                try:
                    cur.execute(sql)
                    rows = cur.fetchall()
                except Exception as e:  # noqa: BLE001
                    fail(f"client {index} query {q}: {type(e).__name__}: {e}")
                    continue
                elapsed_ms = (time.monotonic() - t0) * 1000.0
                with lock:
                    latencies_ms.append(elapsed_ms)
                    totals["rows"] += len(rows)
        finally:
            try:
                cur.close()
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        # a query stuck past the deadline (and its RPC timeouts) must not hang the test
        t.join(max(0.0, deadline + 150.0 - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    if hung:
        fail(f"{hung} clients still running after the deadline")
    wall_s = time.monotonic() - started

    with lock:
        done = sorted(latencies_ms)
        result = {
            "clients": clients,
            "queries": clients * queries,
            "succeeded": len(done),
            # every query due that did not succeed: failed, skipped at the deadline, or hung
            "failures": clients * queries - len(done),
            "errors": list(errors),
            "p50_ms": percentile(done, 0.50),
            "p99_ms": percentile(done, 0.99),
            "rows": totals["rows"],
            "rows_per_s": totals["rows"] / wall_s if wall_s > 0 else None,
            "wall_s": wall_s,
        }
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
