//! File tables in object stores as stage sources (issue 36): Parquet, CSV and JSON-lines
//! objects on S3 (`moto_server`) and Azure Blob (Azurite), each read as one object, a prefix
//! and a glob, feed write stages, and on S3 a tokenize → train → predict chain too. Every
//! output table equals, row by row, the one the same files give from local disk; a rerun
//! finds every stage up to date; and after one object changes, a rerun runs exactly the
//! stages that read it again.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::common::{INGEST, Scratch, ingest, ingest_yaml_with_split, minilm, python};
use crate::storage::{
    AZ_KEY, S3_SECRET, Server, assert_same_predictions, azure_storage, run_json, s3_storage,
    store_py,
};

/// Reviews in the files, written as three parts of each format.
const ROWS: usize = 90;
const PARTS: usize = 3;

/// The file tables: name, kind, and where under the files' root.
const SOURCES: [(&str, &str, &str); 6] = [
    ("pq_one", "parquet", "pq/part-0.parquet"),
    ("pq_dir", "parquet", "pq/"),
    ("csv_glob", "csv", "csv/*.csv"),
    ("csv_one", "csv", "csv/part-1.csv"),
    ("json_glob", "json", "json/*.jsonl"),
    ("json_dir", "json", "json/"),
];

/// A pipeline over the files under `root` (a local directory or a container's URL, ending
/// in `/`): each file table copied by a write stage into `{out}/{name}`, `pq_dir` tokenized,
/// and with `chain`, a model trained on it (into `{out}-run`) that predicts `csv_glob`.
fn files_yaml(storage: &str, root: &str, out: &str, chain: bool) -> String {
    let mut tables = String::new();
    let mut stages = String::new();
    for (name, kind, at) in SOURCES {
        tables += &format!("  {name}: {{ {kind}: '{root}{at}' }}\n");
        tables += &format!("  w_{name}: {{ delta: '{out}/{name}' }}\n");
        stages += &format!("  - write: {{ from: {name}, to: w_{name} }}\n");
    }
    tables += &format!("  tok: {{ delta: '{out}/tok' }}\n");
    let minilm = minilm().display().to_string();
    stages += &format!(
        "  - tokenize: {{ from: pq_dir, tokenizer: {minilm}, label: truth, keep: [split], \
         max_length: 64, to: tok }}\n"
    );
    if chain {
        tables += &format!("  preds: {{ delta: '{out}/preds' }}\n");
        stages += &format!(
            "  - train: {{ from: tok, model: {minilm}, output: '{out}-run', max_steps: 4, \
             batch_size: 16, eval_every: none, save: final, threads: 1 }}\n  \
             - predict: {{ from: csv_glob, model: '{out}-run/model', to: preds }}\n"
        );
    }
    format!("name: files\n{storage}tables:\n{tables}stages:\n{stages}")
}

/// A Delta table under the scratch directory, read by delta-rs's Python reader.
fn read(s: &Scratch, table: &str) -> Value {
    python(
        "read_delta.py",
        &[s.path().join(table).to_str().expect("utf-8 path")],
    )
}

/// The stages of `reports` that ran (were not up to date).
fn ran(reports: &[Value]) -> BTreeSet<String> {
    reports
        .iter()
        .filter(|r| r["cached"] == false)
        .map(|r| r["stage"].as_str().expect("stage").to_string())
        .collect()
}

/// The files of [`SOURCES`] in the store behind `server` (`kind`: s3 or azure, whose
/// pipeline settings are `storage` and whose container `lake` is at `url`), read by the
/// pipeline of [`files_yaml`] and compared with the same files on local disk.
fn file_tables_feed_stages(kind: &str, server: &Server, storage: &str, url: &str, chain: bool) {
    let s = Scratch::new();
    s.write(INGEST, &ingest_yaml_with_split());
    ingest(&s, ROWS);
    let files = s.path().join("files");
    let exported = python(
        "export_files.py",
        &[
            s.path().join("lake/reviews").to_str().expect("utf-8 path"),
            files.to_str().expect("utf-8 path"),
            &PARTS.to_string(),
        ],
    );
    assert_eq!(exported["rows"], ROWS as u64, "{exported}");
    store_py(kind, server, &["mkdir", "lake"]);
    let upload = |dir: &str, only: &str| {
        let local = files.join(dir);
        let dest = format!("lake/files/{dir}");
        store_py(
            kind,
            server,
            &["upload", local.to_str().expect("utf-8 path"), &dest, only],
        );
    };
    for dir in ["pq", "csv", "json"] {
        upload(dir, "");
    }
    let env = [("S3_SECRET", S3_SECRET)];

    s.write("local.yaml", &files_yaml("", "files/", "lake/local", chain));
    let (local, _) = run_json(&s, "local.yaml", &[]);
    s.write(
        "remote.yaml",
        &files_yaml(storage, &format!("{url}/files/"), "lake/remote", chain),
    );
    let (remote, _) = run_json(&s, "remote.yaml", &env);
    assert_eq!(remote.len(), local.len(), "{remote:?}");
    assert_eq!(
        ran(&remote).len(),
        remote.len(),
        "a first run ran every stage"
    );
    let mut tables: Vec<String> = SOURCES.iter().map(|(n, _, _)| n.to_string()).collect();
    tables.push("tok".into());
    for table in &tables {
        let (l, r) = (
            read(&s, &format!("lake/local/{table}")),
            read(&s, &format!("lake/remote/{table}")),
        );
        assert!(l["num_rows"].as_u64().unwrap_or(0) > 0, "{table}: {l}");
        assert_eq!(
            r["schema"], l["schema"],
            "{table}: the schema read from {kind}"
        );
        assert_eq!(r["rows"], l["rows"], "{table}: the rows read from {kind}");
    }
    let whole = read(&s, "lake/remote/pq_dir");
    assert_eq!(
        whole["num_rows"], ROWS as u64,
        "a prefix reads every object"
    );
    if chain {
        let (l, r) = (read(&s, "lake/local/preds"), read(&s, "lake/remote/preds"));
        assert_same_predictions(&r["rows"], &l["rows"], ROWS);
    }

    // Unchanged objects: every stage is up to date.
    let (again, _) = run_json(&s, "remote.yaml", &env);
    assert!(ran(&again).is_empty(), "{again:?}");

    // One new review in one CSV object: the stages that read it run again, no others.
    let part = files.join("csv/part-1.csv");
    let mut text = std::fs::read_to_string(&part).expect("part-1.csv");
    text += &format!(
        "{},\"A review added to one object.\",\"fresh\",\"train\"\n",
        ROWS + 1
    );
    std::fs::write(&part, text).expect("write part-1.csv");
    upload("csv", "part-1.csv");
    let (changed, _) = run_json(&s, "remote.yaml", &env);
    let mut want: BTreeSet<String> = ["write-w_csv_glob", "write-w_csv_one"]
        .map(String::from)
        .into();
    if chain {
        want.insert("predict-preds".into());
    }
    assert_eq!(ran(&changed), want, "{changed:?}");
    let csv = read(&s, "lake/remote/csv_glob");
    assert_eq!(
        csv["num_rows"],
        ROWS as u64 + 1,
        "{kind}: the changed object was read"
    );
    if chain {
        let preds = read(&s, "lake/remote/preds");
        assert_eq!(
            preds["num_rows"],
            ROWS as u64 + 1,
            "the new review was predicted"
        );
    }
}

#[test]
fn s3_parquet_csv_and_json_objects_feed_every_stage_as_local_files_do() {
    let moto = Server::moto();
    let storage = s3_storage(&moto.endpoint());
    file_tables_feed_stages("s3", &moto, &storage, "s3://lake", true);
}

#[test]
fn azure_parquet_csv_and_json_objects_feed_stages_as_local_files_do() {
    let azurite = Server::azurite();
    let storage = azure_storage(&azurite.endpoint(), AZ_KEY);
    file_tables_feed_stages("azure", &azurite, &storage, "az://lake", false);
}
