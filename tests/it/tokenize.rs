//! The tokenize and write stages on small tables: every bad-input policy, the fingerprint
//! cache, time travel, and the table read back by `deltalake`.

use std::sync::Arc;

use arrow::array::{BinaryArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};

use crate::common::{Scratch, minilm, python, tokenize_yaml};

/// A pipeline over `data.jsonl` with a tokenize stage whose extra settings are `extra`.
fn pipeline(s: &Scratch, rows: &str, extra: &str) {
    s.write("data.jsonl", rows);
    s.write("p.yaml", &tokenize_yaml("{ json: data.jsonl }", extra));
}

fn table(s: &Scratch, name: &str) -> serde_json::Value {
    python(
        "read_delta.py",
        &[s.path().join("lake").join(name).to_str().unwrap()],
    )
}

#[test]
fn null_text_is_an_error_naming_the_row_by_default_and_skipped_when_asked() {
    let s = Scratch::new();
    let rows = "{\"id\": 1, \"text\": \"good\"}\n{\"id\": 2, \"text\": null}\n";
    pipeline(&s, rows, "");
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(
        err.contains("row id 2: text column `text` is null"),
        "{err}"
    );
    assert!(
        !s.path().join("lake/out/_delta_log").exists(),
        "a failed run left a table"
    );

    pipeline(&s, rows, "      on_null: skip\n");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_out"], 1);
    assert_eq!(reports[0]["rows_by_outcome"]["skipped_null"], 1);
    let t = table(&s, "out");
    assert_eq!(
        t["rows"][0]["input_ids"],
        serde_json::json!([101, 2204, 102])
    );
}

#[test]
fn empty_text_is_kept_as_special_tokens_and_counted_or_skipped_or_an_error() {
    let s = Scratch::new();
    let rows = "{\"id\": 1, \"text\": \"\"}\n{\"id\": 2, \"text\": \"  \"}\n{\"id\": 3, \"text\": \"ok\"}\n";
    pipeline(&s, rows, "");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_by_outcome"]["kept_empty"], 2);
    let t = table(&s, "out");
    assert_eq!(t["rows"][0]["input_ids"], serde_json::json!([101, 102]));
    assert_eq!(t["rows"][1]["length"], 2);

    pipeline(&s, rows, "      on_empty: skip\n");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_out"], 1);
    assert_eq!(reports[0]["rows_by_outcome"]["skipped_empty"], 2);

    pipeline(&s, rows, "      on_empty: error\n");
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(err.contains("row id 1: column `text` is empty"), "{err}");
    // The failed run left the table at its last committed version.
    assert_eq!(table(&s, "out")["version"], 1);
}

#[test]
fn overlong_text_is_truncated_skipped_or_an_error() {
    let s = Scratch::new();
    let rows = "{\"id\": 7, \"text\": \"one two three four five six seven eight nine ten\"}\n\
                {\"id\": 8, \"text\": \"short\"}\n";
    pipeline(&s, rows, "      max_length: 6\n");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_by_outcome"]["truncated"], 1);
    let t = table(&s, "out");
    // [CLS] one two three four [SEP]
    assert_eq!(
        t["rows"][0]["input_ids"],
        serde_json::json!([101, 2028, 2048, 2093, 2176, 102])
    );

    pipeline(&s, rows, "      max_length: 6\n      on_overlong: skip\n");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_out"], 1);
    assert_eq!(reports[0]["rows_by_outcome"]["skipped_overlong"], 1);

    pipeline(&s, rows, "      max_length: 6\n      on_overlong: error\n");
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(
        err.contains("row id 7: 12 tokens is more than max_length"),
        "{err}"
    );
}

/// A Parquet file whose `text` column is binary, with one value that is not UTF-8.
fn binary_parquet(s: &Scratch) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Binary, true),
    ]));
    let texts: Vec<Option<&[u8]>> = vec![Some(b"fine"), Some(b"bad \xff\xfe bytes"), Some(b"ok")];
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int64Array::from(vec![1, 2, 3])),
            Arc::new(BinaryArray::from(texts)),
        ],
    )
    .unwrap();
    let file = std::fs::File::create(s.path().join("bin.parquet")).unwrap();
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, schema, None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

#[test]
fn invalid_utf8_in_binary_text_is_an_error_or_skipped_or_replaced() {
    let s = Scratch::new();
    binary_parquet(&s);
    let yaml = |policy: &str| tokenize_yaml("{ parquet: bin.parquet }", policy);
    s.write("p.yaml", &yaml(""));
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(
        err.contains("row id 2: column `text` is not valid UTF-8 (bad byte at offset 4)"),
        "{err}"
    );

    s.write("p.yaml", &yaml("      on_invalid_utf8: skip\n"));
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_out"], 2);
    assert_eq!(reports[0]["rows_by_outcome"]["skipped_invalid_utf8"], 1);

    s.write("p.yaml", &yaml("      on_invalid_utf8: replace\n"));
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(reports[0]["rows_out"], 3);
    assert_eq!(reports[0]["rows_by_outcome"]["replaced_invalid_utf8"], 1);
}

#[test]
fn invalid_utf8_in_csv_is_an_error_naming_the_table_and_line() {
    let s = Scratch::new();
    std::fs::write(
        s.path().join("bad.csv"),
        b"id,text\n1,fine\n2,bad \xff here\n",
    )
    .unwrap();
    s.write("p.yaml", &tokenize_yaml("{ csv: bad.csv }", ""));
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    insta::assert_snapshot!(format!("exit {code}\n{err}"));
    assert!(!s.path().join("lake/out/_delta_log").exists());
}

#[test]
fn string_labels_map_to_sorted_ids_or_to_the_given_order() {
    let s = Scratch::new();
    let rows = "{\"id\": 1, \"text\": \"a\", \"label\": \"rotten\"}\n\
                {\"id\": 2, \"text\": \"b\", \"label\": \"fresh\"}\n";
    pipeline(&s, rows, "      label: label\n");
    s.run_ok(&["p.yaml"]);
    let t = table(&s, "out");
    assert_eq!(t["rows"][0]["label"], 1);
    assert_eq!(t["rows"][1]["label"], 0);

    pipeline(
        &s,
        rows,
        "      label: label\n      labels: [rotten, fresh]\n",
    );
    s.run_ok(&["p.yaml"]);
    let t = table(&s, "out");
    assert_eq!(t["rows"][0]["label"], 0);

    pipeline(&s, rows, "      label: label\n      labels: [fresh]\n");
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(
        err.contains("row id 1: label `rotten` in column `label` is not one of"),
        "{err}"
    );

    let null_label = "{\"id\": 1, \"text\": \"a\", \"label\": null}\n\
                      {\"id\": 2, \"text\": \"b\", \"label\": \"fresh\"}\n";
    pipeline(&s, null_label, "      label: label\n");
    let (_, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert!(
        err.contains("row id 1: label column `label` is null"),
        "{err}"
    );
}

#[test]
fn tokenized_table_is_reused_until_data_tokenizer_or_settings_change() {
    let s = Scratch::new();
    let rows = "{\"id\": 1, \"text\": \"hello world\"}\n";
    pipeline(&s, rows, "      max_length: 16\n");
    let first = s.run_ok(&["p.yaml"]);
    assert_eq!(first[0]["cached"], false);
    let hit = s.run_ok(&["p.yaml"]);
    assert_eq!(hit[0]["cached"], true, "same inputs and settings must hit");
    assert_eq!(hit[0]["version"], 0);

    // Settings changed: miss.
    pipeline(&s, rows, "      max_length: 8\n");
    let miss = s.run_ok(&["p.yaml"]);
    assert_eq!(miss[0]["cached"], false);
    assert_eq!(miss[0]["version"], 1);

    // Data changed (a new row): miss.
    std::thread::sleep(std::time::Duration::from_millis(20));
    pipeline(
        &s,
        "{\"id\": 1, \"text\": \"hello world\"}\n{\"id\": 2, \"text\": \"x\"}\n",
        "      max_length: 8\n",
    );
    let miss = s.run_ok(&["p.yaml"]);
    assert_eq!(miss[0]["cached"], false);
    assert_eq!(miss[0]["rows_out"], 2);

    // Tokenizer changed (a copy with one vocab entry renamed): miss.
    let tok = std::fs::read_to_string(minilm().join("tokenizer.json")).unwrap();
    s.write(
        "tok/tokenizer.json",
        &tok.replacen("\"hello\"", "\"hallo\"", 1),
    );
    s.write(
        "p.yaml",
        "name: t\ntables:\n  src: { json: data.jsonl }\n  out: { delta: lake/out }\n\
         stages:\n  - tokenize:\n      from: src\n      tokenizer: tok\n      to: out\n      max_length: 8\n",
    );
    let miss = s.run_ok(&["p.yaml"]);
    assert_eq!(miss[0]["cached"], false, "a different tokenizer must miss");
    let t = table(&s, "out");
    // `hello` (7592) is gone from the vocabulary: WordPiece now splits it ("hell" "##o").
    assert_eq!(t["rows"][0]["input_ids"][1], 3109, "{}", t["rows"][0]);
}

#[test]
fn write_stage_modes_time_travel_and_source_versions() {
    let s = Scratch::new();
    s.write("a.csv", "id,text\n1,first\n");
    let yaml = |mode: &str, extra_table: &str| {
        format!(
            "name: w\ntables:\n  src: {{ csv: a.csv }}\n  t: {{ delta: lake/t }}\n{extra_table}\
             stages:\n  - write:\n      from: src\n      to: t\n      mode: {mode}\n"
        )
    };
    s.write("p.yaml", &yaml("create", ""));
    let r = s.run_ok(&["p.yaml"]);
    assert_eq!(
        (r[0]["version"].as_i64(), r[0]["rows_out"].as_i64()),
        (Some(0), Some(1))
    );

    // create on an existing table: a config error before any work.
    let out = s.pipeline(&["run", "p.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(s.stderr(&out).contains("table `t` already exists"));

    // Commit timestamps have millisecond resolution: leave a clear gap around `between`.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let between = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    s.write("p.yaml", &yaml("append", ""));
    let r = s.run_ok(&["p.yaml"]);
    assert_eq!(r[0]["version"], 1);
    assert_eq!(table(&s, "t")["num_rows"], 2);

    // Appending other columns is refused before any work.
    s.write("b.csv", "id,body\n1,x\n");
    s.write(
        "p.yaml",
        "name: w\ntables:\n  src: { csv: b.csv }\n  t: { delta: lake/t }\n\
         stages:\n  - write:\n      from: src\n      to: t\n      mode: append\n",
    );
    let out = s.pipeline(&["run", "p.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        s.stderr(&out).contains("do not match table `t` for append"),
        "{}",
        s.stderr(&out)
    );

    // Time travel by timestamp: a moment between version 0 and version 1 reads version 0.
    let history = table(&s, "t")["history"].clone();
    assert_eq!(history.as_array().map(Vec::len), Some(2), "{history}");
    s.write(
        "p.yaml",
        &format!(
            "name: w\ntables:\n  old: {{ delta: lake/t, timestamp: \"{between}\" }}\n  \
             copy: {{ delta: lake/ts_copy }}\nstages:\n  - write:\n      from: old\n      to: copy\n"
        ),
    );
    let r = s.run_ok(&["p.yaml"]);
    assert_eq!(
        r[0]["rows_out"], 1,
        "timestamp {between} should read version 0"
    );

    // Time travel: version 0 still has one row; the table now has two.
    s.write(
        "p.yaml",
        "name: w\ntables:\n  old: { delta: lake/t, version: 0 }\n  copy: { delta: lake/copy }\n\
         stages:\n  - write:\n      from: old\n      to: copy\n",
    );
    let r = s.run_ok(&["p.yaml"]);
    assert_eq!(r[0]["rows_out"], 1);
    let copy = table(&s, "copy");
    assert_eq!(copy["rows"][0]["text"], "first");
    assert_eq!(copy["num_rows"], 1);
}

#[test]
fn text_pairs_truncate_longest_first_as_transformers_does() {
    let s = Scratch::new();
    let rows = [
        (
            "a short premise",
            "and a much longer hypothesis that needs cutting down",
        ),
        ("one two three four five six seven eight", "tiny"),
        ("", "empty first side"),
    ];
    let jsonl: String = rows
        .iter()
        .enumerate()
        .map(|(i, (a, b))| format!("{}\n", serde_json::json!({"id": i, "text": a, "pair": b})))
        .collect();
    pipeline(&s, &jsonl, "      text_pair: pair\n      max_length: 10\n");
    let reports = s.run_ok(&["p.yaml"]);
    assert_eq!(
        reports[0]["rows_by_outcome"]["truncated"], 2,
        "{}",
        reports[0]
    );
    let want = python(
        "reference_ids.py",
        &[
            minilm().to_str().unwrap(),
            "10",
            s.path().join("data.jsonl").to_str().unwrap(),
        ],
    );
    let got: Vec<serde_json::Value> = table(&s, "out")["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["input_ids"].clone())
        .collect();
    assert_eq!(serde_json::Value::from(got), want);
}

#[test]
fn negative_integer_labels_are_an_error_naming_the_row() {
    let s = Scratch::new();
    let rows =
        "{\"id\": 1, \"text\": \"a\", \"label\": 0}\n{\"id\": 2, \"text\": \"b\", \"label\": -1}\n";
    pipeline(&s, rows, "      label: label\n");
    let (code, err) = s.failing(&["run", "--quiet", "p.yaml"]).outcome();
    assert_eq!(code, 1);
    assert!(
        err.contains("row id 2: label -1 in column `label` is negative"),
        "{err}"
    );
}

#[test]
fn parquet_tables_read_a_directory_or_a_glob_of_files() {
    let s = Scratch::new();
    std::fs::create_dir_all(s.path().join("parts")).unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    for (part, ids) in [("a", vec![1, 2]), ("b", vec![3])] {
        let texts: Vec<String> = ids.iter().map(|i| format!("review {i}")).collect();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(arrow::array::StringArray::from(texts)),
            ],
        )
        .unwrap();
        let file = std::fs::File::create(s.path().join(format!("parts/{part}.parquet"))).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, schema.clone(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    for (source, rows) in [
        ("parts", 3),
        ("parts/*.parquet", 3),
        ("parts/b*.parquet", 1),
    ] {
        s.write(
            "p.yaml",
            &format!(
                "name: t\ntables:\n  src: {{ parquet: \"{source}\" }}\n  out: {{ delta: lake/out }}\n\
                 stages:\n  - write:\n      from: src\n      to: out\n"
            ),
        );
        // --force: the directory and the first glob name the same files (a cache hit).
        let r = s.run_ok(&["p.yaml", "--force"]);
        assert_eq!(r[0]["cached"], false);
        assert_eq!(r[0]["rows_out"], rows, "{source}: {}", r[0]);
    }
}
