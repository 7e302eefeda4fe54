"""Query `pipeline serve` as a Flight SQL client would: ADBC's DB-API driver, with a login.

usage: flight_sql.py URI USER PASSWORD
Connects with username/password (the driver does the Flight Basic handshake and sends the
Bearer token it gets back), then runs predictions in SQL, a GROUP BY over them, a prepared
statement with a `?` parameter, the catalog calls (GetObjects, GetTableSchema) and a NULL
text. Prints one JSON object:
  rows        [[id, label, score], ...] from `SELECT id, predict(text), predict_score(text)`
  groups      [[label, count], ...] from GROUP BY, by label
  param_rows  [[id, label], ...] for `WHERE id = ?` with 3
  objects     [[catalog, db_schema, table], ...] from adbc_get_objects()
  tables      the table names in `objects`, sorted
  schema      [[name, arrow type], ...] of adbc_get_table_schema("reviews")
  null_label  predict(CAST(NULL AS VARCHAR)) (None when the server gives NULL)
"""
import json
import os
import sys

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql


def main() -> None:
    uri, user, password = sys.argv[1], sys.argv[2], sys.argv[3]
    # autocommit=True: a read-only server has no transactions to turn autocommit off for.
    options = adbc_driver_flightsql.DatabaseOptions
    db_kwargs = {
        "username": user,
        "password": password,
        # a server that never answers fails the test instead of hanging it
        options.TIMEOUT_QUERY.value: "300",
        options.TIMEOUT_FETCH.value: "300",
    }
    conn = flight_sql.connect(uri, db_kwargs=db_kwargs, autocommit=True)
    cur = conn.cursor()

    cur.execute(
        "SELECT id, predict(text) AS label, predict_score(text) AS score "
        "FROM reviews ORDER BY id"
    )
    rows = [[int(i), label, float(score)] for i, label, score in cur.fetchall()]

    cur.execute("SELECT predict(text) AS l, count(*) AS n FROM reviews GROUP BY l ORDER BY l")
    groups = [[label, int(n)] for label, n in cur.fetchall()]

    # A `?` parameter: the driver prepares the statement, binds (3,) as an int64 and runs it.
    cur.execute("SELECT id, predict(text) AS label FROM reviews WHERE id = ?", (3,))
    param_rows = [[int(i), label] for i, label in cur.fetchall()]

    objects = []
    for catalog in conn.adbc_get_objects().read_all().to_pylist():
        for db_schema in catalog["catalog_db_schemas"] or []:
            for table in db_schema["db_schema_tables"] or []:
                objects.append(
                    [catalog["catalog_name"], db_schema["db_schema_name"], table["table_name"]]
                )
    objects.sort(key=lambda o: [str(x) for x in o])
    schema = conn.adbc_get_table_schema("reviews")

    cur.execute("SELECT predict(CAST(NULL AS VARCHAR)) AS l")
    null_rows = cur.fetchall()

    cur.close()
    conn.close()
    print(json.dumps({
        "rows": rows,
        "groups": groups,
        "param_rows": param_rows,
        "objects": objects,
        "tables": sorted({o[2] for o in objects}),
        "schema": [[f.name, str(f.type)] for f in schema],
        "null_rows": len(null_rows),
        "null_label": null_rows[0][0] if null_rows else "<no row>",
    }))
    sys.stdout.flush()
    # the Go driver's threads can outlive the interpreter's shutdown; the output is complete
    os._exit(0)


if __name__ == "__main__":
    main()
