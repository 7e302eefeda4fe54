//! `pipeline serve` through real external clients: ADBC's Flight SQL driver (DB-API),
//! pyarrow.flight's DoExchange and Spark's mapInArrow get the very predictions the predict
//! stage writes; bad logins, writes and requests are refused clearly and change no file; a
//! user sees only their tables; new commits show without a restart; sixteen clients at
//! once; SIGTERM lets a query in flight finish, then exits 0; bad `serve:` settings exit 2.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{
    INGEST, Scratch, ingest, ingest_yaml, make_model_with, pipeline_command, python,
};
use crate::serving::{
    LABELS, PREDICT, PREDICT_YAML, Server, TOKEN, assert_same_predictions, predictions,
};

const BY_TOKEN: [&str; 2] = ["--token", TOKEN];
/// A user with access to every table.
const ALICE: &str = "alice";
const ALICE_PASSWORD: &str = "alice's long passphrase";
/// A user who may read `reviews` only.
const BOB: &str = "bob";
const BOB_PASSWORD: &str = "bob's other passphrase";
const AS_ALICE: [&str; 4] = ["--user", ALICE, "--password", ALICE_PASSWORD];
const AS_BOB: [&str; 4] = ["--user", BOB, "--password", BOB_PASSWORD];

/// The serve-only pipeline (see [`serve_yaml`]).
const SERVE: &str = "serve.yaml";
/// The `preds` table entry, for [`serve_yaml`].
const PREDS: &str = "  preds: { delta: lake/preds }\n";

/// A serve-only pipeline: `reviews` and more `tables` (entries indented by two spaces), the
/// model `sentiment`, the users of users.yaml and the static token.
fn serve_yaml(tables: &str, grace: &str) -> String {
    format!(
        r#"name: s
tables:
  reviews: {{ delta: lake/reviews }}
{tables}serve:
  listen: 127.0.0.1:0
  models:
    sentiment: model
  auth:
    users_file: users.yaml
    tokens: ["${{LAKEML_TOKEN}}"]
  limits: {{ max_concurrent_queries: 64, query_timeout: 60s }}
  shutdown_grace: {grace}
"#
    )
}

/// `pipeline hash-password`, the password on stdin; returns the PHC string it prints.
fn hash_password(s: &Scratch, password: &str) -> String {
    let mut child = pipeline_command()
        .arg("hash-password")
        .current_dir(s.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pipeline hash-password");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("write the password");
    let out = child.wait_with_output().expect("wait for hash-password");
    assert!(
        out.status.success(),
        "pipeline hash-password failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hash = String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string();
    assert!(
        hash.starts_with("$argon2") && !hash.contains(password),
        "not an argon2 PHC string: {hash}"
    );
    hash
}

/// A scratch directory with the classifier (`model/`), `rows` reviews and users.yaml
/// (alice: every table; bob: `reviews` only).
fn setup(rows: usize) -> Scratch {
    let s = Scratch::new();
    make_model_with(&s, "model", &LABELS.join(","), 0);
    s.write(INGEST, &ingest_yaml());
    ingest(&s, rows);
    let alice = hash_password(&s, ALICE_PASSWORD);
    let bob = hash_password(&s, BOB_PASSWORD);
    s.write(
        "users.yaml",
        &format!(
            "users:\n  {ALICE}:\n    password: \"{alice}\"\n  {BOB}:\n    password: \"{bob}\"\n    \
             tables: [reviews]\n"
        ),
    );
    s
}

/// [`setup`], then the predict stage over all rows into `preds`, and serve.yaml with both.
fn setup_predicted(rows: usize) -> Scratch {
    let s = setup(rows);
    s.write(PREDICT, PREDICT_YAML);
    let reports = s.run_ok(&[PREDICT]);
    assert_eq!(reports[0]["rows_out"], rows, "{reports:?}");
    s.write(SERVE, &serve_yaml(PREDS, "10s"));
    s
}

/// (id, label, score) from JSON rows, with the label and the score at these positions.
fn id_label_score(rows: &Value, label: usize, score: usize) -> Vec<(u64, String, f64)> {
    rows.as_array()
        .unwrap_or_else(|| panic!("no rows: {rows}"))
        .iter()
        .map(|r| {
            (
                r[0].as_u64().unwrap_or_else(|| panic!("id in {r}")),
                r[label]
                    .as_str()
                    .unwrap_or_else(|| panic!("label in {r}"))
                    .to_string(),
                r[score].as_f64().unwrap_or_else(|| panic!("score in {r}")),
            )
        })
        .collect()
}

/// Runs SQL statements on one ADBC connection (tests/py/flight_query.py) with `auth`
/// (`BY_TOKEN`, `AS_ALICE`, ...) and more options; every outcome is recorded, nothing
/// panics on a refused statement.
fn query(server: &Server, auth: &[&str], sql: &[&str]) -> Value {
    let mut args = vec![server.uri.as_str()];
    args.extend_from_slice(auth);
    args.extend_from_slice(sql);
    python("flight_query.py", &args)
}

/// The rows of statement `i` of a flight_query.py result, which must have succeeded.
fn rows(result: &Value, i: usize) -> &Value {
    let r = &result["results"][i];
    assert!(r.get("rows").is_some(), "statement {i} failed: {result}");
    &r["rows"]
}

/// The error message of statement `i` of a flight_query.py result, which must have failed.
fn refusal(result: &Value, i: usize) -> String {
    assert!(
        result["connect_error"].is_null(),
        "could not connect: {result}"
    );
    let r = &result["results"][i];
    assert!(
        r.get("rows").is_none() && r.get("message").is_some(),
        "statement {i} was not refused: {result}"
    );
    r["message"].as_str().unwrap_or_default().to_string()
}

/// Every file under `dir`, by relative path, with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let name = path
                    .strip_prefix(dir)
                    .expect("under dir")
                    .display()
                    .to_string();
                files.insert(name, std::fs::read(&path).expect("read file"));
            }
        }
    }
    files
}

#[test]
fn sql_predictions_equal_the_predict_stage() {
    let s = setup_predicted(300);
    let want = predictions(&s);
    assert_eq!(want.len(), 300);
    let server = Server::start(&s, SERVE);
    let got = python("flight_sql.py", &[&server.uri, ALICE, ALICE_PASSWORD]);

    let rows = id_label_score(&got["rows"], 1, 2);
    assert_same_predictions("SELECT predict(text), predict_score(text)", &rows, &want);
    assert!(
        rows.windows(2).all(|w| w[0].0 < w[1].0),
        "not in ORDER BY id order"
    );

    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for (label, _) in want.values() {
        *counts.entry(label.clone()).or_default() += 1;
    }
    let groups: BTreeMap<String, u64> = got["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| {
            (
                g[0].as_str().expect("label").to_string(),
                g[1].as_u64().expect("count"),
            )
        })
        .collect();
    assert_eq!(groups, counts, "GROUP BY predict(text)");
    assert_eq!(groups.values().sum::<u64>(), 300);

    assert_eq!(got["param_rows"], json!([[3, want[&3].0]]), "WHERE id = ?");

    let objects = got["objects"].as_array().expect("objects");
    for table in ["reviews", "preds"] {
        assert!(
            objects.contains(&json!(["lakeml", "public", table])),
            "GetObjects has no lakeml.public.{table}: {objects:?}"
        );
    }
    let schema: BTreeMap<&str, &str> = got["schema"]
        .as_array()
        .expect("schema")
        .iter()
        .map(|f| (f[0].as_str().expect("name"), f[1].as_str().expect("type")))
        .collect();
    assert_eq!(schema.get("id"), Some(&"int64"), "{schema:?}");
    assert!(
        schema.get("text").is_some_and(|t| t.contains("string")),
        "{schema:?}"
    );

    assert_eq!(got["null_rows"], 1, "{got}");
    assert!(got["null_label"].is_null(), "predict(NULL): {got}");
    server.stop();
}

#[test]
fn an_int8_model_serves_what_the_int8_predict_stage_writes() {
    let s = setup(120);
    s.write(
        PREDICT,
        &PREDICT_YAML.replace(
            "      to: preds\n",
            "      to: preds\n      precision: int8\n",
        ),
    );
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    assert_eq!(want.len(), 120);
    s.write(
        SERVE,
        &serve_yaml(PREDS, "10s").replace(
            "    sentiment: model\n",
            "    sentiment: { path: model, precision: int8 }\n",
        ),
    );
    let server = Server::start(&s, SERVE);
    let got = query(
        &server,
        &AS_ALICE,
        &["SELECT id, predict(text), predict_score(text) FROM reviews ORDER BY id"],
    );
    let rows = id_label_score(rows(&got, 0), 1, 2);
    assert_same_predictions("int8 predict() over Flight SQL", &rows, &want);
    server.stop();
}

#[test]
fn exchange_equals_the_predict_stage_and_keeps_order() {
    let s = setup_predicted(300);
    let want = predictions(&s);
    let server = Server::start(&s, SERVE);
    // Batches of 64 rows, in a shuffled order: five batches, the last one short.
    let got = python(
        "flight_exchange.py",
        &[
            &server.uri,
            TOKEN,
            s.path().join("lake/reviews").to_str().expect("utf-8 path"),
            "sentiment",
            "64",
        ],
    );
    assert_eq!(got["rows_in"], 300);
    assert_eq!(got["batches_in"], 5);
    assert_eq!(got["same_order"], true, "rows came back in another order");
    assert_eq!(got["same_input"], true, "the input columns changed");
    assert_eq!(
        got["columns"],
        json!(["id", "text", "label", "label_id", "score", "probabilities"])
    );
    let schema = got["schema"].as_array().expect("schema");
    assert_eq!(schema[3], json!(["label_id", "int64"]), "{schema:?}");
    assert_eq!(schema[4], json!(["score", "float"]), "{schema:?}");
    assert!(
        schema[5][1]
            .as_str()
            .is_some_and(|t| t.starts_with("list<") && t.contains("float")),
        "{schema:?}"
    );

    let rows = id_label_score(&got["rows"], 1, 3);
    assert_same_predictions("DoExchange", &rows, &want);
    for r in got["rows"].as_array().expect("rows") {
        let label_id = r[2].as_u64().expect("label_id");
        let probabilities: Vec<f64> = r[4]
            .as_array()
            .expect("probabilities")
            .iter()
            .map(|p| p.as_f64().expect("probability"))
            .collect();
        let best = probabilities.iter().copied().fold(f64::MIN, f64::max);
        assert!(
            usize::try_from(label_id).is_ok_and(|i| LABELS.get(i).copied() == r[1].as_str())
                && probabilities.len() == LABELS.len()
                && (probabilities.iter().sum::<f64>() - 1.0).abs() < 1e-5
                && (best - r[3].as_f64().expect("score")).abs() < 1e-6,
            "an inconsistent row: {r}"
        );
    }

    assert_eq!(got["huge"]["rows"], 1, "{}", got["huge"]);
    assert!(
        got["huge"]["label"]
            .as_str()
            .is_some_and(|l| LABELS.contains(&l)),
        "100 000 characters of text: {}",
        got["huge"]
    );
    assert_eq!(
        got["subset"],
        json!({"columns": ["id", "text", "label", "score"], "rows": 10})
    );
    server.stop();
}

#[test]
fn spark_map_in_arrow_equals_the_predict_stage() {
    let s = setup_predicted(300);
    let want = predictions(&s);
    let server = Server::start(&s, SERVE);
    let got = python(
        "spark_map_in_arrow.py",
        &[
            &server.uri,
            TOKEN,
            s.path().join("lake/reviews").to_str().expect("utf-8 path"),
        ],
    );
    assert_eq!(got["partitions"], 2, "{got}");
    assert_eq!(got["probabilities_lengths"], json!([2]), "{got}");
    let rows = id_label_score(&got["rows"], 1, 2);
    assert_same_predictions("Spark mapInArrow", &rows, &want);
    server.stop();
}

#[test]
fn refusals_are_clear_and_change_nothing() {
    let s = setup(50);
    s.write(SERVE, &serve_yaml("", "10s"));
    let before = snapshot(&s.path().join("lake"));
    let server = Server::start(&s, SERVE);
    let got = python(
        "flight_refusals.py",
        &[&server.uri, ALICE, ALICE_PASSWORD, TOKEN],
    );

    for case in [
        "no_token",
        "wrong_token",
        "wrong_password",
        "exchange_no_token",
    ] {
        assert!(
            got[case]["error"]
                .as_str()
                .is_some_and(|e| e.contains("Unauthenticated")),
            "{case}: {}",
            got[case]
        );
    }
    assert_eq!(
        got["wrong_password_adbc"]["status"], "UNAUTHENTICATED",
        "{}",
        got["wrong_password_adbc"]
    );
    assert_eq!(got["login"]["ok"], "authorization", "{}", got["login"]);
    assert_eq!(got["static_token"]["ok"], json!([[50]]), "{got}");

    // Sent as queries (GetFlightInfo) and as updates (DoPut): every write is refused.
    for path in ["sql", "sql_update"] {
        let cases = got[path]
            .as_object()
            .unwrap_or_else(|| panic!("no `{path}` cases: {got}"));
        assert_eq!(cases.len(), 7, "{path}: {cases:?}");
        for (statement, outcome) in cases {
            let message = outcome["message"]
                .as_str()
                .unwrap_or_default()
                .to_lowercase();
            assert!(
                outcome.get("ok").is_none()
                    && (message.contains("read-only") || message.contains("not allowed")),
                "{path}: `{statement}` was not refused clearly: {outcome}"
            );
        }
    }
    assert_eq!(
        got["copy_target_exists"], false,
        "COPY or CREATE EXTERNAL TABLE wrote files"
    );
    assert_eq!(got["count_after"]["ok"], json!([[50]]), "{got}");

    for (case, word) in [
        ("bad_ticket", "ticket"),
        ("bad_descriptor", "descriptor"),
        ("exchange_no_text", "text"),
        ("exchange_int_text", "text"),
        ("exchange_unknown_model", "nosuch_model"),
    ] {
        let outcome = &got[case];
        assert!(
            outcome.get("error").is_some()
                && !outcome["error"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("Unauthenticated")
                && outcome["message"]
                    .as_str()
                    .is_some_and(|m| m.to_lowercase().contains(word)),
            "{case}: expected a refusal naming `{word}`: {outcome}"
        );
    }

    server.stop();
    let after = snapshot(&s.path().join("lake"));
    let changed: BTreeSet<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|name| before.get(*name) != after.get(*name))
        .collect();
    assert!(changed.is_empty(), "files under lake/ changed: {changed:?}");
}

#[test]
fn a_user_sees_only_their_tables() {
    let s = setup(20);
    s.write("secrets.csv", "id,note\n1,the twist\n2,the ending\n");
    s.write(
        SERVE,
        &serve_yaml("  secrets: { csv: secrets.csv }\n", "10s"),
    );
    let server = Server::start(&s, SERVE);

    let bob = query(
        &server,
        &AS_BOB,
        &[
            "SELECT count(*) FROM reviews",
            "SELECT * FROM secrets",
            "SELECT r.id FROM reviews r JOIN secrets s ON r.id = s.id",
            "SELECT count(*) FROM (SELECT note FROM secrets) t",
        ],
    );
    assert_eq!(rows(&bob, 0), &json!([[20]]));
    for i in 1..=3 {
        let message = refusal(&bob, i);
        assert!(
            message.contains("secrets"),
            "statement {i}: the refusal does not name the table: {message}"
        );
    }

    let alice = query(&server, &AS_ALICE, &["SELECT count(*) FROM secrets"]);
    assert_eq!(rows(&alice, 0), &json!([[2]]));
    server.stop();
}

#[test]
fn new_commits_are_visible_without_restart() {
    let s = setup(100);
    s.write(SERVE, &serve_yaml("", "10s"));
    let server = Server::start(&s, SERVE);
    let count = "SELECT count(*) FROM reviews";
    let before = query(&server, &BY_TOKEN, &[count]);
    assert_eq!(rows(&before, 0), &json!([[100]]));

    // A new version of `reviews` (overwrite, 150 rows) while the server runs.
    ingest(&s, 150);
    let after = query(
        &server,
        &BY_TOKEN,
        &[
            count,
            "SELECT count(predict(text)) FROM reviews WHERE id > 100",
        ],
    );
    assert_eq!(
        rows(&after, 0),
        &json!([[150]]),
        "the new commit is not seen"
    );
    assert_eq!(rows(&after, 1), &json!([[50]]));
    server.stop();
}

#[test]
fn sixteen_clients_fifty_queries_each() {
    // 140 ids: each `id % 7 = k` holds 20 rows.
    let s = setup(140);
    s.write(SERVE, &serve_yaml("", "10s"));
    let server = Server::start(&s, SERVE);
    let got = python("flight_load.py", &[&server.uri, TOKEN, "16", "50"]);
    eprintln!(
        "16 clients x 50 queries: p50 {:.1} ms, p99 {:.1} ms, {:.0} rows/s ({} rows in {:.1} s)",
        got["p50_ms"].as_f64().unwrap_or(f64::NAN),
        got["p99_ms"].as_f64().unwrap_or(f64::NAN),
        got["rows_per_s"].as_f64().unwrap_or(f64::NAN),
        got["rows"],
        got["wall_s"].as_f64().unwrap_or(f64::NAN),
    );
    assert_eq!(got["queries"], 800, "{got}");
    assert_eq!(got["failures"], 0, "{got}");
    // Per client: 25 predict queries of 20 rows, 25 counts of one row.
    assert_eq!(got["rows"], 16 * (25 * 20 + 25), "{got}");
    server.stop();
}

#[test]
fn sigterm_lets_a_long_query_finish_then_exits_zero() {
    let s = setup(300);
    s.write(SERVE, &serve_yaml("", "60s"));
    let mut server = Server::start(&s, SERVE);

    // How long one pass of predictions over the 300 rows takes here (the second run: the
    // model is warm; other texts than the first run's, which the server's cache answers),
    // to size a query of about 8 s whatever the machine.
    let timing = query(
        &server,
        &BY_TOKEN,
        &[
            "SELECT count(*), sum(predict_score(text)) FROM reviews",
            "SELECT count(*), sum(predict_score(text || ' ~')) FROM reviews",
        ],
    );
    rows(&timing, 1);
    let seconds = timing["results"][1]["elapsed_s"]
        .as_f64()
        .expect("elapsed_s");
    let copies = ((8.0 / seconds.max(0.05)).ceil() as u64).clamp(2, 50);
    // `copies` distinct texts per review, so no prediction can be reused.
    let slow = format!(
        "SELECT count(*) AS n, sum(predict_score(a.text || ' #' || CAST(b.id AS VARCHAR))) AS s \
         FROM reviews a CROSS JOIN (SELECT id FROM reviews WHERE id <= {copies}) b"
    );

    let marker = s.path().join("started");
    let (uri, marker_arg) = (
        server.uri.clone(),
        marker.to_str().expect("utf-8 path").to_string(),
    );
    let long = std::thread::spawn(move || {
        python(
            "flight_query.py",
            &[&uri, "--token", TOKEN, "--started", &marker_arg, &slow],
        )
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the slow query's client did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !long.is_finished(),
        "the slow query ({copies} x 300 predictions) ended within 2 s: nothing in flight to \
         test SIGTERM with"
    );

    server.signal("-TERM");
    let signalled = Instant::now();
    // A new client is not served any more (refused, or never answered).
    std::thread::sleep(Duration::from_millis(500));
    let late = query(
        &server,
        &["--token", TOKEN, "--timeout", "10", "--deadline", "20"],
        &["SELECT 1"],
    );
    assert!(
        late["results"][0].get("rows").is_none(),
        "a query sent after SIGTERM was run: {late}"
    );

    let finished = long.join().expect("the slow query's client");
    assert_eq!(
        rows(&finished, 0)[0][0],
        300 * copies,
        "the query in flight did not finish: {finished}"
    );
    // The grace period is 60 s; the server may take 30 s more to wind down.
    let status = server.wait_exit(Duration::from_secs(60 + 30).saturating_sub(signalled.elapsed()));
    let stderr = server.final_stderr();
    let status = status.unwrap_or_else(|| panic!("still running 90 s after SIGTERM:\n{stderr}"));
    assert!(status.success(), "exit {status} after SIGTERM:\n{stderr}");
}

#[test]
fn bad_serve_settings_exit_2_naming_the_field() {
    let s = Scratch::new();
    make_model_with(&s, "model", &LABELS.join(","), 0);
    s.write("reviews.csv", "id,text\n1,great film\n2,dull\n");
    // Only the certificate is missing: the key file exists (its content is never reached).
    s.write("key.pem", "not a key\n");
    // A sentence-transformers model whose modules lakeml does not run (a Dense projection).
    std::fs::create_dir_all(s.path().join("dense")).expect("mkdir");
    for entry in std::fs::read_dir(s.path().join("model"))
        .expect("model")
        .flatten()
    {
        std::fs::copy(entry.path(), s.path().join("dense").join(entry.file_name())).expect("copy");
    }
    s.write(
        "dense/modules.json",
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]"#,
    );
    s.write(
        "dense/1_Pooling/config.json",
        r#"{"pooling_mode_mean_tokens": true}"#,
    );
    let pipeline =
        |serve: &str| format!("name: s\ntables:\n  reviews: {{ csv: reviews.csv }}\n{serve}");
    let auth = "  auth:\n    tokens: [\"${LAKEML_TOKEN}\"]\n";
    let cases: [(&str, String, &[&str]); 6] = [
        (
            "missing model directory",
            format!("serve:\n  listen: 127.0.0.1:0\n  models:\n    sentiment: nosuch\n{auth}"),
            &["serve.models.sentiment", "nosuch"],
        ),
        (
            "sentence-transformers module lakeml does not run",
            format!("serve:\n  listen: 127.0.0.1:0\n  models:\n    sentiment: dense\n{auth}"),
            &[
                "serve.models.sentiment",
                "sentence_transformers.models.Dense",
            ],
        ),
        (
            "unreadable TLS certificate",
            format!(
                "serve:\n  listen: 127.0.0.1:0\n  models:\n    sentiment: model\n{auth}  \
                 tls:\n    cert: nosuch.pem\n    key: key.pem\n"
            ),
            &["serve.tls.cert", "nosuch.pem"],
        ),
        (
            "unknown key",
            format!(
                "serve:\n  listen: 127.0.0.1:0\n  models:\n    sentiment: model\n{auth}  \
                 colour: blue\n"
            ),
            &["serve", "colour"],
        ),
        (
            "all interfaces without auth",
            "serve:\n  listen: 0.0.0.0:0\n  models:\n    sentiment: model\n".to_string(),
            &["serve.auth"],
        ),
        ("no serve section", String::new(), &["serve"]),
    ];
    for (case, serve, words) in cases {
        s.write("bad.yaml", &pipeline(&serve));
        let (code, err) = s
            .failing(&["serve", "bad.yaml"])
            .env("LAKEML_TOKEN", TOKEN)
            .outcome();
        assert_eq!(code, 2, "{case}: {err}");
        for word in words {
            assert!(err.contains(word), "{case}: `{word}` not named in: {err}");
        }
    }
}

#[test]
fn a_query_past_its_timeout_is_stopped_and_a_query_over_the_limit_is_refused() {
    let s = setup(300);
    s.write(
        SERVE,
        &serve_yaml("", "10s").replace(
            "limits: { max_concurrent_queries: 64, query_timeout: 60s }",
            "limits: { max_concurrent_queries: 1, query_timeout: 5s }",
        ),
    );
    let before = snapshot(&s.path().join("lake"));
    let server = Server::start(&s, SERVE);
    // 30 distinct texts per review (another suffix each time, so no cached score helps):
    // 9000 predictions, far more than 5 s on these cores.
    let slow = |tag: &str| {
        format!(
            "SELECT count(*) AS n, sum(predict_score(a.text || ' {tag}' || CAST(b.id AS VARCHAR))) \
             FROM reviews a CROSS JOIN (SELECT id FROM reviews WHERE id <= 30) b"
        )
    };

    let alone = query(&server, &BY_TOKEN, &[&slow("#")]);
    let message = refusal(&alone, 0);
    assert!(
        message.contains("query_timeout"),
        "the slow query was not stopped by the timeout: {alone}"
    );
    let elapsed = alone["results"][0]["elapsed_s"]
        .as_f64()
        .unwrap_or(f64::NAN);
    assert!(elapsed < 30.0, "stopped only after {elapsed} s");

    // While the slow query holds the only slot, another query is refused (or, if the other
    // query came first, the slow one is).
    let marker = s.path().join("started");
    let (uri, marker_arg, sql) = (
        server.uri.clone(),
        marker.to_str().expect("utf-8 path").to_string(),
        slow("@"),
    );
    let long = std::thread::spawn(move || {
        python(
            "flight_query.py",
            &[&uri, "--token", TOKEN, "--started", &marker_arg, &sql],
        )
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the slow query's client did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut refused = Vec::new();
    while !long.is_finished() && refused.is_empty() {
        let other = query(&server, &BY_TOKEN, &["SELECT count(*) FROM reviews"]);
        if other["results"][0].get("rows").is_none() {
            refused.push(other["results"][0]["message"].to_string());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let slow_result = long.join().expect("the slow query's client");
    let slow_message = slow_result["results"][0]["message"].to_string();
    refused.push(slow_message);
    assert!(
        refused.iter().any(|m| m.contains("max_concurrent_queries")),
        "no query was refused while the only slot was taken: {refused:?}"
    );
    // The slot is free again.
    let after = query(&server, &BY_TOKEN, &["SELECT count(*) FROM reviews"]);
    assert_eq!(rows(&after, 0), &json!([[300]]));
    server.stop();
    assert!(
        snapshot(&s.path().join("lake")) == before,
        "a refused or stopped query changed files under lake/"
    );
}

#[test]
fn tls_serves_clients_that_trust_the_certificate() {
    let s = setup(20);
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            "key.pem",
            "-out",
            "cert.pem",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ])
        .current_dir(s.path())
        .output()
        .expect("run openssl");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    s.write(
        SERVE,
        &serve_yaml("", "10s").replace(
            "  limits:",
            "  tls: { cert: cert.pem, key: key.pem }\n  limits:",
        ),
    );
    let server = Server::start(&s, SERVE);
    assert!(
        server.uri.starts_with("grpc+tls://127.0.0.1:"),
        "{}",
        server.uri
    );
    let cert = s.path().join("cert.pem");
    let trusted = query(
        &server,
        &[
            "--token",
            TOKEN,
            "--tls-root",
            cert.to_str().expect("utf-8 path"),
        ],
        &["SELECT count(*), count(predict(text)) FROM reviews"],
    );
    assert_eq!(rows(&trusted, 0), &json!([[20, 20]]));
    // A client that does not trust the certificate gets no answer.
    let untrusted = query(
        &server,
        &["--token", TOKEN, "--timeout", "20"],
        &["SELECT count(*) FROM reviews"],
    );
    assert!(
        untrusted["connect_error"].is_object() || untrusted["results"][0].get("rows").is_none(),
        "a client without the CA read rows: {untrusted}"
    );
    server.stop();
}
