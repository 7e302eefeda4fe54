//! `pipeline schedule` on S3 (`moto_server` on 127.0.0.1): a job watching an S3 Delta table
//! fires on an append, its polls ask only for the next log entry, and its run history is an
//! S3 table that two schedulers on different hosts share. One of them is killed mid-run; the
//! other recovers the attempt once its lease ran out, and the retry scores each id once.

use std::time::{Duration, Instant};

use crate::common::{INGEST, Scratch, ingest, ingest_yaml, make_model_with};
use crate::jobs::Scheduler;
use crate::storage::{S3_SECRET, Server, pipeline, run_json, s3_storage, store_py};

/// Reviews in the local table; the S3 copy gets them in three appends.
const TOTAL: usize = 780;

const SCHED: &str = "sched.yaml";

/// The ids in `s3://lake/preds`, sorted.
fn scored(moto: &Server) -> Vec<u64> {
    let preds = store_py("s3", moto, &["read", "s3://lake/preds"]);
    let mut ids: Vec<u64> = preds["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    ids.sort_unstable();
    ids
}

#[test]
fn s3_watches_fire_on_an_append_and_another_host_recovers_an_expired_lease() {
    let moto = Server::moto();
    let s = Scratch::new();
    make_model_with(&s, "model", "rotten,fresh", 0);
    s.write(INGEST, &ingest_yaml());
    ingest(&s, TOTAL);
    store_py("s3", &moto, &["mkdir", "lake"]);
    let storage = s3_storage(&moto.endpoint());
    s.write(
        "load.yaml",
        &format!(
            "name: load\n{storage}tables:\n  local_reviews: {{ delta: lake/reviews }}\n  \
             reviews: {{ delta: s3://lake/reviews }}\n\
             stages:\n  - write: {{ sql: 'SELECT * FROM local_reviews WHERE id > ${{LO}} AND \
             id <= ${{HI}}', to: reviews, mode: append }}\n"
        ),
    );
    let load = |lo: usize, hi: usize| {
        let (lo, hi) = (lo.to_string(), hi.to_string());
        run_json(
            &s,
            "load.yaml",
            &[("S3_SECRET", S3_SECRET), ("LO", &lo), ("HI", &hi)],
        );
    };
    load(0, 10);
    s.write(
        SCHED,
        &format!(
            "name: sched\n{storage}tables:\n  reviews: {{ delta: s3://lake/reviews }}\n  \
             preds: {{ delta: s3://lake/preds }}\n  runs: {{ delta: s3://lake/runs }}\n\
             scheduler: {{ history: runs, poll: 500ms, lease: 3s, grace: 5s }}\n\
             stages:\n  - predict: {{ from: reviews, model: model, to: preds }}\n\
             jobs:\n  score:\n    on: {{ table_updated: [reviews] }}\n    \
             retries: {{ max: 2, backoff: 1s }}\n"
        ),
    );
    // Two "machines": their own host names and caches (where a remote history's lock is).
    let host = |name: &'static str| {
        let cache = s.path().join(format!("cache-{name}"));
        (name, cache.to_string_lossy().into_owned())
    };
    let start = |(name, cache): &(&str, String)| {
        Scheduler::start_with(
            &s,
            SCHED,
            &format!("{name}.log"),
            &[
                ("S3_SECRET", S3_SECRET),
                ("LAKEML_HOST", name),
                ("LAKEML_CACHE", cache),
            ],
        )
    };
    let (host_a, host_b) = (host("host-a"), host("host-b"));

    // (a) An append to the S3 table fires the job; the new rows are scored once.
    let a = start(&host_a);
    load(10, 20);
    a.wait_for(
        "job=score|event=fired|trigger=table_updated",
        Duration::from_secs(30),
    );
    a.wait_for(
        "job=score|event=finished|state=SUCCEEDED",
        Duration::from_secs(60),
    );
    assert_eq!(scored(&moto), (1..=20).collect::<Vec<u64>>());

    // While nothing changes, a poll is one GET of the next log entry: never a listing.
    let seen = moto.log().lines().count();
    std::thread::sleep(Duration::from_secs(3));
    let log = moto.log();
    let requests: Vec<&str> = log
        .lines()
        .skip(seen)
        .filter(|l| l.contains("reviews/_delta_log") || l.contains("prefix=reviews"))
        .collect();
    let keys: std::collections::BTreeSet<&str> = requests
        .iter()
        .filter_map(|l| l.split_whitespace().find(|w| w.contains("_delta_log")))
        .collect();
    assert!(
        (3..=9).contains(&requests.len())
            && keys.len() == 1
            && requests
                .iter()
                .all(|l| l.contains("GET /lake/reviews/_delta_log/") && l.contains(".json")),
        "polls of the idle S3 table in 3 s (poll 500ms):\n{}",
        requests.join("\n")
    );

    // (b) Host B joins; the next append is claimed by one of the two, which is killed
    // mid-run with its run. The other records the attempt FAILED once its lease has run out
    // and runs the retry.
    let b = start(&host_b);
    let fired_before = a.lines(&["job=score", "event=fired"]).len();
    load(20, TOTAL);
    let began = Instant::now();
    let (holder, other, holder_name, other_name) = loop {
        if a.lines(&["job=score", "event=fired"]).len() > fired_before {
            break (&a, &b, host_a.0, host_b.0);
        }
        if !b.lines(&["job=score", "event=fired"]).is_empty() {
            break (&b, &a, host_b.0, host_a.0);
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "neither scheduler fired:\n{}\n{}",
            a.text(),
            b.text()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let finished_before = holder.lines(&["event=finished"]).len();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(
        holder.lines(&["event=finished"]).len(),
        finished_before,
        "the run ended before the kill; make it longer:\n{}",
        holder.text()
    );
    holder.kill_group();
    let killed = Instant::now();
    let interrupted = other.wait_for(
        &format!("job=score|event=interrupted|the lease of {holder_name}:"),
        Duration::from_secs(20),
    );
    assert!(
        killed.elapsed() >= Duration::from_secs(1),
        "recovered before the lease could run out: {interrupted}"
    );
    other.wait_for(
        "job=score|event=finished|attempt=2|state=SUCCEEDED",
        Duration::from_secs(120),
    );
    let other_log = other.text();
    assert!(
        !other_log.contains("lease-lost"),
        "the survivor lost a lease:\n{other_log}"
    );

    let out = pipeline(
        &s,
        &["runs", SCHED, "--json", "--limit", "100"],
        &[("S3_SECRET", S3_SECRET)],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut runs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("run json"))
        .collect();
    runs.reverse();
    let summary: Vec<(i64, &str)> = runs
        .iter()
        .map(|r| {
            (
                r["attempt"].as_i64().unwrap_or_default(),
                r["state"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [(1, "SUCCEEDED"), (1, "FAILED"), (2, "SUCCEEDED")],
        "{runs:?}"
    );
    let (failed, retry) = (&runs[1], &runs[2]);
    assert_eq!(failed["run_id"], retry["run_id"]);
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!("interrupted: the lease of {holder_name}:"))
            && reason.contains("expired at"),
        "{failed}"
    );
    assert!(
        retry["host"]
            .as_str()
            .is_some_and(|h| h.starts_with(&format!("{other_name}:"))),
        "{retry}"
    );
    assert!(
        retry["input_versions"]["reviews"].as_u64().is_some(),
        "{retry}"
    );
    assert_eq!(scored(&moto), (1..=TOTAL as u64).collect::<Vec<u64>>());
    assert!(!other_log.contains(S3_SECRET), "the secret leaked");
}
