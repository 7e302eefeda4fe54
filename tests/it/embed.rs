//! The `embed` stage on real data (Rotten Tomatoes, MiniLM) against sentence-transformers'
//! `model.encode` of the same texts and model: every pooling mode sentence-transformers
//! configures, a model without its files, Matryoshka truncation; exactly once on rerun; a
//! nearest-neighbour search in SQL equal to numpy's, in `pipeline sql` and over Flight SQL
//! with `embed('...')`; `lakeml_spark.embed` from Spark with failover; bad settings refused.

use std::path::Path;

use crate::common::{INGEST, Scratch, ingest, ingest_yaml, minilm, python};

const ROWS: usize = 60;

/// A copy of MiniLM with sentence-transformers' `modules.json` and a Pooling module that
/// turns `mode` on, and a `Normalize` module when `normalize`.
fn st_model(dir: &Path, mode: &str, normalize: bool) {
    std::fs::create_dir_all(dir.join("1_Pooling")).expect("mkdir");
    for entry in std::fs::read_dir(minilm()).expect("minilm").flatten() {
        if entry.path().is_file() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        }
    }
    let mut modules = vec![
        r#"{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}"#
            .to_string(),
        r#"{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}"#
            .to_string(),
    ];
    if normalize {
        std::fs::create_dir_all(dir.join("2_Normalize")).expect("mkdir");
        modules.push(
            r#"{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}"#
                .to_string(),
        );
    }
    std::fs::write(
        dir.join("modules.json"),
        format!("[{}]", modules.join(", ")),
    )
    .expect("write");
    let on = |m: &str| if m == mode { "true" } else { "false" };
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        format!(
            r#"{{"word_embedding_dimension": 384, "pooling_mode_cls_token": {}, "pooling_mode_mean_tokens": {}, "pooling_mode_max_tokens": {}, "pooling_mode_mean_sqrt_len_tokens": {}, "pooling_mode_weightedmean_tokens": false, "pooling_mode_lasttoken": {}, "include_prompt": true}}"#,
            on("cls"),
            on("mean"),
            on("max"),
            on("mean_sqrt_len"),
            on("lasttoken")
        ),
    )
    .expect("write");
}

/// (table, model directory, dims, normalize, precision) of each embed stage of the test's
/// pipeline.
fn cases(s: &Scratch) -> Vec<(String, String, usize, bool, &'static str)> {
    let fixture = |name: &str| s.path().join(name).display().to_string();
    vec![
        (
            "mean_norm".into(),
            fixture("st_mean_norm"),
            384,
            true,
            "fp32",
        ),
        (
            "plain".into(),
            minilm().display().to_string(),
            384,
            false,
            "fp32",
        ),
        ("cls".into(), fixture("st_cls"), 384, false, "fp32"),
        ("max".into(), fixture("st_max"), 384, false, "fp32"),
        (
            "sqrt".into(),
            fixture("st_mean_sqrt_len"),
            384,
            false,
            "fp32",
        ),
        ("last".into(), fixture("st_lasttoken"), 384, false, "fp32"),
        ("short".into(), fixture("st_mean_norm"), 128, true, "fp32"),
        ("half".into(), fixture("st_mean_norm"), 384, true, "bf16"),
        // Stored as int8 with a scale per row (`quantize: int8`).
        ("packed".into(), fixture("st_mean_norm"), 384, true, "fp32"),
    ]
}

#[test]
fn embeddings_match_sentence_transformers_for_every_pooling_and_search_finds_numpys_nearest() {
    let s = Scratch::new();
    s.write(INGEST, &ingest_yaml());
    ingest(&s, ROWS);
    st_model(&s.path().join("st_mean_norm"), "mean", true);
    for mode in ["cls", "max", "mean_sqrt_len", "lasttoken"] {
        st_model(&s.path().join(format!("st_{mode}")), mode, false);
    }
    let cases = cases(&s);
    let mut yaml = String::from("name: e\ntables:\n  reviews: { delta: lake/reviews }\n");
    for (table, ..) in &cases {
        yaml += &format!("  {table}: {{ delta: lake/{table} }}\n");
    }
    yaml += "stages:\n";
    for (table, model, dims, _, precision) in &cases {
        let dims = if *dims == 384 {
            String::new()
        } else {
            format!(", dims: {dims}")
        };
        let quantize = if table == "packed" {
            ", quantize: int8"
        } else {
            ""
        };
        yaml += &format!(
            "  - embed: {{ from: reviews, model: '{model}', keep: [truth], to: {table}{dims}, \
             precision: {precision}{quantize} }}\n"
        );
    }
    s.write("e.yaml", &yaml);
    let reports = s.run_ok(&["e.yaml"]);
    assert_eq!(reports.len(), cases.len());
    let pooling: Vec<&str> = reports
        .iter()
        .map(|r| r["pooling"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        pooling[0],
        "modules.json: mean pooling, normalized; 384 dims, normalized"
    );
    assert!(
        pooling[1].starts_with("default: mean pooling"),
        "{pooling:?}"
    );
    assert_eq!(
        pooling[6],
        "modules.json: mean pooling, normalized; 128 dims, normalized"
    );
    assert_eq!(
        pooling[8],
        "modules.json: mean pooling, normalized; 384 dims, normalized, stored as int8 with a \
         scale per row"
    );
    assert!(
        reports
            .iter()
            .all(|r| r["kind"] == "embed" && r["rows_out"] == ROWS as u64),
        "{reports:?}"
    );

    let spec: Vec<serde_json::Value> = cases
        .iter()
        .map(|(table, model, dims, normalize, _)| {
            serde_json::json!({
                "table": s.path().join("lake").join(table),
                "model": model,
                "dims": dims,
                "normalize": normalize,
            })
        })
        .collect();
    let reviews = s.path().join("lake/reviews");
    let compared = python(
        "embed_reference.py",
        &[
            reviews.to_str().expect("utf-8"),
            &serde_json::Value::from(spec).to_string(),
        ],
    );
    for (case, (table, _, dims, normalize, precision)) in
        compared.as_array().expect("cases").iter().zip(&cases)
    {
        assert_eq!(case["rows"], ROWS as u64, "{table}: {case}");
        assert_eq!(case["ids_equal"], true, "{table}");
        // Delta has no fixed-size arrays: a list of `dims` floats (or int8s).
        let element = if table == "packed" { "int8" } else { "float" };
        assert_eq!(
            case["type"],
            format!("list<element: {element} not null>"),
            "{table}"
        );
        assert_eq!(case["lengths"], serde_json::json!([dims]), "{table}");
        let cosine = case["min_cosine"].as_f64().unwrap_or_default();
        let diff = case["max_abs_diff"].as_f64().unwrap_or(f64::MAX);
        if table == "packed" {
            // Each value rounded to 1/254 of its row's largest |value| (about 0.2 here).
            assert!(cosine >= 0.9999, "{table}: min cosine {cosine}");
            assert!(diff <= 2e-3, "{table}: max |Δ| {diff}");
            eprintln!("int8 storage: min cosine {cosine}, max |Δ| {diff}");
        } else if *precision == "fp32" {
            // fp32 against PyTorch fp32: the same vectors to float32 rounding.
            assert!(cosine >= 0.99999, "{table}: min cosine {cosine}");
            assert!(diff <= 1e-4, "{table}: max |Δ| {diff}");
        } else {
            // bf16 weights and activations (8-bit mantissa) against fp32.
            assert!(cosine >= 0.999, "{table}: min cosine {cosine}");
        }
        if *normalize {
            // int8 values are normalized before rounding: their norm is 1 to about 1e-3.
            let within = if table == "packed" { 2e-3 } else { 1e-5 };
            let norms = &case["norms"];
            assert!(
                (norms[0].as_f64().unwrap_or_default() - 1.0).abs() < within
                    && (norms[1].as_f64().unwrap_or_default() - 1.0).abs() < within,
                "{table}: {norms}"
            );
        }
    }

    // bf16 runs only on a CPU with bf16 dot products; elsewhere the stage says so and runs
    // fp32 (emulated bf16 is several times slower than fp32).
    let native_bf16 = std::fs::read_to_string("/proc/cpuinfo")
        .is_ok_and(|c| c.contains(" avx512_bf16") || c.contains(" amx_bf16"));
    assert_eq!(
        reports[7]["precision"],
        if native_bf16 { "bf16" } else { "fp32" },
        "{:?}",
        reports[7]
    );
    assert_eq!(reports[0]["precision"], "fp32");
    // bf16's neighbours: every row as a query, its 10 nearest by bf16 vectors against fp32's.
    // Measured 98.8% on an AVX512-BF16 CPU (7 of 600 neighbours differ, all near rank 10);
    // the issue's goal is 99%, not met: sentence-transformers' own bf16 gets 98.0-99.0% on
    // such measures (see docs/embeddings.md). This guards against a regression below 98%.
    let half = &compared[7];
    let overlap = half["top10_overlap_with_fp32"].as_f64().unwrap_or_default();
    assert!(overlap >= 0.98, "bf16 top-10 overlap with fp32: {half}");
    eprintln!(
        "bf16: min cosine to fp32 {}, to sentence-transformers fp32 {}, top-10 overlap {overlap}",
        half["min_cosine_to_fp32"], half["min_cosine"]
    );

    // Exact search in SQL: the query's 5 nearest neighbours by cosine distance, as numpy.
    let first = &compared[0];
    let query: Vec<String> = first["query"]
        .as_array()
        .expect("query")
        .iter()
        .map(|v| format!("{}", v.as_f64().unwrap_or_default()))
        .collect();
    let sql = format!(
        "SELECT id FROM mean_norm ORDER BY cosine_distance(embedding, [{}]), id LIMIT 5",
        query.join(", ")
    );
    // The ids `pipeline sql FILE SQL` prints.
    let sql_ids = |file: &str, sql: &str| -> Vec<u64> {
        let out = s.pipeline(&["sql", file, sql]);
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().trim_matches('|').trim().parse().ok())
            .collect()
    };
    let ids = sql_ids("e.yaml", &sql);
    let nearest: Vec<u64> = first["nearest"]
        .as_array()
        .expect("nearest")
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .collect();
    assert_eq!(ids, nearest);
    assert_eq!(ids[0], 7);

    // `pipeline serve`, through ADBC's Flight SQL driver: `<model>_embed(text)` gives the
    // stage's vectors, and a search embeds its query text once and finds numpy's nearest,
    // over the table held in memory (`serve.memory`).
    s.write(
        "serve.yaml",
        &format!(
            "name: served\ntables:\n  reviews: {{ delta: lake/reviews }}\n  \
             mean_norm: {{ delta: lake/mean_norm }}\n\
             serve:\n  listen: 127.0.0.1:0\n  auth: {{ tokens: ['${{LAKEML_TOKEN}}'] }}\n  \
             memory: [mean_norm]\n  models:\n    minilm: {{ path: '{}' }}\n",
            s.path().join("st_mean_norm").display()
        ),
    );
    let served = crate::serving::Server::start(&s, "serve.yaml");
    let query = |sql: &str| {
        let out = python(
            "flight_query.py",
            &[&served.uri, "--token", crate::serving::TOKEN, sql],
        );
        out["results"][0]["rows"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| panic!("{sql}: {out}"))
    };
    let worst = query(
        "SELECT min(c) FROM (SELECT cosine_similarity(e.embedding, minilm_embed(r.text)) AS c \
         FROM mean_norm e JOIN reviews r ON e.id = r.id) t",
    );
    let worst = worst[0][0].as_f64().unwrap_or_default();
    assert!(
        worst >= 0.99999,
        "served vectors vs the stage's: min cosine {worst}"
    );
    let text = query("SELECT text FROM reviews WHERE id = 7")[0][0]
        .as_str()
        .expect("text")
        .replace('\'', "''");
    // The served search's `k` nearest ids to the text of id 7.
    let search = |k: usize| -> Vec<u64> {
        query(&format!(
            "SELECT id FROM mean_norm ORDER BY cosine_distance(embedding, embed('{text}')), \
             id LIMIT {k}"
        ))
        .iter()
        .filter_map(|r| r[0].as_u64())
        .collect()
    };
    assert_eq!(search(5), nearest, "served search");
    assert!(
        served
            .stderr()
            .contains("table `mean_norm` in memory: 60 rows"),
        "{}",
        served.stderr()
    );

    // The same search in `pipeline sql`, with no server: the file's `serve.models` run in
    // the process. A file without them says where `embed()` comes from.
    s.write(
        "search.yaml",
        &format!(
            "name: search\ntables:\n  mean_norm: {{ delta: lake/mean_norm }}\n\
             serve:\n  models:\n    minilm: '{}'\n",
            s.path().join("st_mean_norm").display()
        ),
    );
    let top5 = format!(
        "SELECT id FROM mean_norm ORDER BY cosine_distance(embedding, embed('{text}')), id \
         LIMIT 5"
    );
    assert_eq!(
        sql_ids("search.yaml", &top5),
        nearest,
        "pipeline sql search"
    );
    let out = s.pipeline(&["sql", "e.yaml", "SELECT embed('great acting')"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("serve.models"),
        "{stderr}"
    );

    // lakeml_spark.embed from Spark local[2], a dead endpoint first: every review gets the
    // stage's vector, through the failover.
    let out = std::process::Command::new(crate::common::env_path("LAKEML_PYTHON"))
        .arg(crate::common::repo().join("tests/py/spark_embed.py"))
        .args([
            served.uri.as_str(),
            crate::serving::TOKEN,
            s.path().join("lake/reviews").to_str().expect("utf-8"),
            s.path().join("lake/mean_norm").to_str().expect("utf-8"),
        ])
        .env("PYTHONPATH", crate::common::repo().join("python/src"))
        .current_dir(s.path())
        .output()
        .expect("spark_embed.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "spark_embed.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spark: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("json");
    let ids: Vec<u64> = (1..=ROWS as u64).collect();
    assert_eq!(spark["ids"], serde_json::json!(ids), "{spark}");
    assert_eq!(spark["type"], "array<float>", "{spark}");
    let cosine = spark["min_cosine"].as_f64().unwrap_or_default();
    assert!(cosine >= 0.99999, "Spark vs the stage: min cosine {cosine}");

    // A new version of the table in memory is read again: a copy of id 7 as id 999 is
    // found next to it.
    s.write(
        "append.yaml",
        "name: append\ntables:\n  mean_norm: { delta: lake/mean_norm }\nstages:\n  - write:\n      \
         sql: SELECT CAST(999 AS BIGINT) AS id, embedding, model_version, run_id, embedded_at, \
         truth FROM mean_norm WHERE id = 7\n      to: mean_norm\n      mode: append\n",
    );
    s.run_ok(&["append.yaml"]);
    assert_eq!(search(2), [7, 999], "search after an append");
    assert!(
        served
            .stderr()
            .contains("table `mean_norm` in memory: 61 rows"),
        "{}",
        served.stderr()
    );
    served.stop();

    // A rerun over the same source version writes nothing.
    let again = s.run_ok(&["e.yaml"]);
    assert!(again.iter().all(|r| r["cached"] == true), "{again:?}");

    // Bad settings: exit 2, naming the field.
    for (extra, want) in [
        ("dims: 400", "stages[0].embed.dims: 400 is out of range"),
        (
            "labels: [a, b]",
            "stages[0].embed.labels: applies to predict stages",
        ),
    ] {
        s.write(
            "bad.yaml",
            &format!(
                "name: bad\ntables:\n  reviews: {{ delta: lake/reviews }}\n  out: {{ delta: lake/out }}\n\
                 stages:\n  - embed: {{ from: reviews, model: '{}', to: out, {extra} }}\n",
                minilm().display()
            ),
        );
        let out = s.pipeline(&["run", "bad.yaml"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(want), "{stderr}");
    }
    assert!(!s.path().join("lake/out").exists());
}
