//! CLI error wording and exit codes, under snapshot tests: every mistake in a pipeline file
//! is reported (exit 2) before any work starts, naming the file and the field or line.

use crate::common::{Scratch, minilm, pipeline_command, tokenize_yaml};

/// Writes `yaml` (with `{MINILM}` filled in) and a small CSV, runs `pipeline run`, returns
/// "exit N" and stderr.
fn run_bad(yaml: &str) -> String {
    let s = Scratch::new();
    s.write(
        "reviews.csv",
        "id,text,label\n1,great film,fresh\n2,dull,rotten\n",
    );
    s.write(
        "p.yaml",
        &yaml.replace("{MINILM}", &minilm().display().to_string()),
    );
    let (code, err) = s.failing(&["run", "p.yaml"]).outcome();
    assert!(
        !s.path().join("lake").exists(),
        "a pipeline that failed validation wrote something"
    );
    format!("exit {code}\n{err}")
}

const GOOD_TABLES: &str =
    "name: t\ntables:\n  reviews: { csv: reviews.csv }\n  out: { delta: lake/out }\n";

#[test]
fn unknown_key_is_named_with_its_line() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - tokenize:\n      from: reviews\n      tokenizer: {{MINILM}}\n      to: out\n      max_lenght: 64\n"
    )));
}

#[test]
fn unknown_stage_kind_lists_the_known_ones() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - tokenise:\n      from: reviews\n"
    )));
}

#[test]
fn missing_input_file_is_named() {
    insta::assert_snapshot!(run_bad(
        "name: t\ntables:\n  reviews: { csv: nowhere.csv }\n  out: { delta: lake/out }\nstages:\n  - write:\n      from: reviews\n      to: out\n"
    ));
}

#[test]
fn missing_table_in_sql_is_named() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - write:\n      sql: SELECT * FROM reviewz\n      to: out\n"
    )));
}

#[test]
fn missing_text_column_lists_the_columns() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - tokenize:\n      from: reviews\n      tokenizer: {{MINILM}}\n      text: body\n      to: out\n"
    )));
}

#[test]
fn text_column_of_the_wrong_type_says_to_cast() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - tokenize:\n      from: reviews\n      tokenizer: {{MINILM}}\n      text: id\n      to: out\n"
    )));
}

#[test]
fn unset_environment_variable_is_named_with_its_line() {
    insta::assert_snapshot!(run_bad(
        "name: t\ntables:\n  reviews: { csv: ${LAKEML_TEST_SURELY_UNSET}/r.csv }\nstages: []\n"
    ));
}

#[test]
fn undeclared_output_table_lists_the_declared_ones() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - write:\n      from: reviews\n      to: outt\n"
    )));
}

#[test]
fn missing_tokenizer_is_named() {
    insta::assert_snapshot!(run_bad(&format!(
        "{GOOD_TABLES}stages:\n  - tokenize:\n      from: reviews\n      tokenizer: no/such/model\n      to: out\n"
    )));
}

#[test]
fn later_stage_is_checked_against_what_an_earlier_stage_will_write() {
    // `out` does not exist yet; the tokenize stage reads it and names a column it won't have.
    insta::assert_snapshot!(run_bad(
        "name: t\ntables:\n  reviews: { csv: reviews.csv }\n  out: { delta: lake/out }\n  \
         tok: { delta: lake/tok }\nstages:\n  - write:\n      sql: SELECT id, text FROM reviews\n      \
         to: out\n  - tokenize:\n      from: out\n      tokenizer: {MINILM}\n      label: label\n      \
         to: tok\n"
    ));
}

#[test]
fn missing_pipeline_file_is_a_usage_error() {
    let s = Scratch::new();
    let out = s.pipeline(&["run", "nope.yaml"]);
    insta::assert_snapshot!(format!(
        "exit {}\n{}",
        out.status.code().unwrap_or(-1),
        s.stderr(&out)
    ));
}

#[test]
fn validate_accepts_a_good_file_without_writing_anything() {
    let s = Scratch::new();
    s.write("reviews.csv", "id,text,label\n1,great film,fresh\n");
    s.write(
        "p.yaml",
        &format!(
            "{GOOD_TABLES}  tok: {{ delta: lake/tok }}\nstages:\n  - write:\n      from: reviews\n      \
             to: out\n  - tokenize:\n      from: out\n      tokenizer: {}\n      label: label\n      \
             to: tok\n",
            minilm().display()
        ),
    );
    let out = s.pipeline(&["validate", "p.yaml"]);
    assert!(out.status.success(), "{}", s.stderr(&out));
    insta::assert_snapshot!(String::from_utf8_lossy(&out.stdout));
    assert!(!s.path().join("lake").exists());
}

/// Regression: `pipeline runs FILE | head` panicked when `head` had gone (println! on a
/// closed pipe). The reader here is gone before the command writes: it ends quietly, exit 0.
#[test]
fn a_closed_stdout_ends_the_command_quietly_instead_of_panicking() {
    let s = Scratch::new();
    s.write("reviews.csv", "id,text,label\n1,great film,fresh\n");
    s.write(
        "p.yaml",
        &format!("{GOOD_TABLES}stages:\n  - write:\n      from: reviews\n      to: out\n"),
    );
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = pipeline_command()
        .args(["validate", "p.yaml"])
        .current_dir(s.path())
        .stdout(writer)
        .output()
        .expect("run pipeline validate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_row_error_is_in_the_stage_words_and_says_the_table_is_unchanged() {
    // delta-rs flattens errors raised inside a stage's stream into strings; the user must
    // still see the stage's own message, not "Generic DeltaTable error: External error".
    let s = Scratch::new();
    s.write(
        "d.jsonl",
        "{\"id\": 1, \"text\": \"good\"}\n{\"id\": 2, \"text\": null}\n",
    );
    s.write("p.yaml", &tokenize_yaml("{ json: d.jsonl }", ""));
    let out = s.pipeline(&["run", "p.yaml"]);
    insta::assert_snapshot!(format!(
        "exit {}\n{}",
        out.status.code().unwrap_or(-1),
        s.stderr(&out)
    ));
}

#[test]
fn info_reports_the_linked_libtorch_which_is_the_pinned_version() {
    let out = Scratch::new().pipeline(&["info"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // tch 0.24 binds libtorch 2.11.0 exactly (Cargo.toml, scripts/env.sh).
    assert!(text.contains("libtorch 2.11.0"), "{text}");
    assert!(text.contains("torch intra-op threads: "), "{text}");
    // The torch venv has NCCL's and CUDA's headers (scripts/env.sh), so the build compiled
    // NCCL's half of the c10d shim.
    assert!(
        text.contains("data parallelism (c10d): gloo (CPU), nccl (CUDA)"),
        "{text}"
    );
}

#[test]
fn info_names_the_fp32_gemm_path_and_no_mkl_override_restores_mkls_own() {
    let s = Scratch::new();
    let path = |args: &[&str]| {
        let out = s.pipeline(args);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{}", s.stderr(&out));
        assert!(text.contains("GFLOP/s"), "{text}");
        text.lines()
            .find_map(|l| l.strip_prefix("fp32 GEMM: "))
            .unwrap_or_else(|| panic!("no fp32 GEMM line: {text}"))
            .to_string()
    };
    let (on, off) = (path(&["info"]), path(&["--no-mkl-override", "info"]));
    // --json: the same facts for scripts (the benchmarks read their GEMM peaks from it).
    let out = s.pipeline(&["info", "--json"]);
    assert!(out.status.success(), "{}", s.stderr(&out));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in ["fp32_gflops", "bf16_gflops", "int8_gops"] {
        assert!(
            info["gemm"][key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {info}"
        );
    }
    assert!(info["gemm"]["int8_dot_products"].is_boolean(), "{info}");
    if on.contains("has no MKL") {
        return; // a libtorch built without MKL: nothing to override
    }
    // MKL asked the binary (the exported answer is linked in) in both runs.
    assert!(
        on.starts_with("MKL, ") && off.starts_with("MKL, "),
        "{on} / {off}"
    );
    if on.contains("Intel CPU") {
        assert_eq!(on, off, "on an Intel CPU the switch changes nothing");
    } else {
        assert!(on.contains("fast path by feature dispatch"), "{on}");
        assert!(off.contains("generic path"), "{off}");
    }
}
