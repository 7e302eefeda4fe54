//! The vector functions through SQL, against float64 references computed here.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float32Array, Float64Array, Int64Array, RecordBatch};
use arrow::array::{FixedSizeListArray, ListArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Schema};
use datafusion::prelude::SessionContext;

/// Deterministic vectors in [-1, 1) (a 64-bit LCG), so failures reproduce.
fn vectors(rows: usize, dims: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..rows)
        .map(|_| {
            (0..dims)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
                })
                .collect()
        })
        .collect()
}

fn reference(metric: &str, a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    match metric {
        "cosine_similarity" => dot / (na * nb),
        "cosine_distance" => 1.0 - dot / (na * nb),
        "inner_product" => dot,
        "l2_distance" => a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum::<f64>()
            .sqrt(),
        other => panic!("no metric {other}"),
    }
}

/// A session with the table `t(id, v, w)`: `v` a FixedSizeList<Float32, dims> with row 3
/// NULL, `w` the same vectors as a List<Float32>.
fn session(rows: &[Vec<f32>]) -> SessionContext {
    let dims = rows[0].len();
    let values = Float32Array::from(rows.concat());
    let item = Arc::new(Field::new_list_field(DataType::Float32, true));
    let nulls: Vec<bool> = (0..rows.len()).map(|i| i != 3).collect();
    let fixed = FixedSizeListArray::new(
        item.clone(),
        dims as i32,
        Arc::new(values.clone()),
        Some(nulls.into()),
    );
    let list = ListArray::new(
        item,
        OffsetBuffer::from_lengths(rows.iter().map(Vec::len)),
        Arc::new(values),
        None,
    );
    let ids = Int64Array::from_iter_values(0..rows.len() as i64);
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", fixed.data_type().clone(), true),
            Field::new("w", list.data_type().clone(), true),
        ])),
        vec![Arc::new(ids) as ArrayRef, Arc::new(fixed), Arc::new(list)],
    )
    .expect("batch");
    let ctx = crate::catalog::session();
    ctx.register_batch("t", batch).expect("register");
    ctx
}

fn literal(v: &[f32]) -> String {
    let parts: Vec<String> = v.iter().map(|x| format!("{x:?}")).collect();
    format!("[{}]", parts.join(", "))
}

async fn column(ctx: &SessionContext, sql: &str) -> Vec<Option<f64>> {
    let batches = ctx
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    batches
        .iter()
        .flat_map(|b| {
            let a = b
                .column(b.num_columns() - 1)
                .as_any()
                .downcast_ref::<Float64Array>()
                .expect("float64")
                .clone();
            (0..a.len())
                .map(|i| a.is_valid(i).then(|| a.value(i)))
                .collect::<Vec<_>>()
        })
        .collect()
}

async fn error(ctx: &SessionContext, sql: &str) -> String {
    match ctx.sql(sql).await {
        Err(e) => e.to_string(),
        Ok(df) => match df.collect().await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{sql}: expected an error"),
        },
    }
}

const METRICS: [&str; 4] = [
    "cosine_similarity",
    "cosine_distance",
    "inner_product",
    "l2_distance",
];

#[tokio::test]
async fn every_metric_matches_a_float64_reference_on_fixed_and_variable_lists() {
    // 384 dimensions (MiniLM's) and 21 (16 lanes and a remainder).
    for dims in [384, 21] {
        let rows = vectors(50, dims, dims as u64);
        let query = &vectors(1, dims, 7)[0];
        let ctx = session(&rows);
        for metric in METRICS {
            for col in ["v", "w"] {
                let sql = format!(
                    "SELECT id, {metric}({col}, {}) FROM t ORDER BY id",
                    literal(query)
                );
                let got = column(&ctx, &sql).await;
                assert_eq!(got.len(), rows.len());
                for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
                    if i == 3 && col == "v" {
                        assert_eq!(*g, None, "a NULL vector gives NULL");
                        continue;
                    }
                    let want = reference(metric, row, query);
                    let g = g.unwrap_or_else(|| panic!("{sql}: row {i} is NULL"));
                    // float32 sums over ≤ 384 products of values in [-1, 1).
                    assert!(
                        (g - want).abs() <= 2e-5 * want.abs().max(1.0),
                        "{metric}({col}) dims {dims} row {i}: {g} vs {want}"
                    );
                }
            }
        }
        // Column against column, and constant against constant.
        let got = column(&ctx, "SELECT id, l2_distance(v, w) FROM t ORDER BY id").await;
        assert!(got.iter().enumerate().all(|(i, g)| if i == 3 {
            g.is_none()
        } else {
            *g == Some(0.0)
        }));
        let one = column(&ctx, "SELECT cosine_similarity([1, 0], [0.0, 2.0])").await;
        assert_eq!(one, vec![Some(0.0)]);
    }
}

#[tokio::test]
async fn nulls_give_null_and_bad_arguments_are_errors_that_say_why() {
    let rows = vectors(5, 3, 1);
    let ctx = session(&rows);
    assert_eq!(
        column(&ctx, "SELECT inner_product(NULL, [1.0, 2.0])").await,
        vec![None]
    );
    let e = error(&ctx, "SELECT id, cosine_distance(v, [1.0, 2.0]) FROM t").await;
    assert!(
        e.contains("cosine_distance") && e.contains("3 and 2 dimensions"),
        "{e}"
    );
    let e = error(&ctx, "SELECT l2_distance(id, v) FROM t").await;
    assert!(
        e.contains("l2_distance") && e.contains("takes vectors"),
        "{e}"
    );
    let e = error(&ctx, "SELECT inner_product([1.0, NULL], [1.0, 2.0])").await;
    assert!(e.contains("NULL element"), "{e}");
    let zero = column(&ctx, "SELECT cosine_similarity([0.0, 0.0], [1.0, 2.0])").await;
    assert!(zero[0].is_some_and(f64::is_nan), "{zero:?}");
}

#[tokio::test]
async fn nearest_neighbours_are_a_top_k_equal_to_brute_force() {
    let rows = vectors(2000, 64, 3);
    let query = &vectors(1, 64, 9)[0];
    let ctx = session(&rows);
    let sql = format!(
        "SELECT id, cosine_distance(v, {q}) AS d FROM t ORDER BY d, id LIMIT 10",
        q = literal(query)
    );
    let plan = ctx
        .sql(&format!("EXPLAIN {sql}"))
        .await
        .expect("explain")
        .collect()
        .await
        .expect("explain");
    let text = arrow::util::pretty::pretty_format_batches(&plan)
        .expect("format")
        .to_string();
    assert!(text.contains("TopK(fetch=10)"), "not a top-k:\n{text}");
    let batches = ctx
        .sql(&sql)
        .await
        .expect("sql")
        .collect()
        .await
        .expect("run");
    let got: Vec<i64> = batches
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("ids")
                .values()
                .to_vec()
        })
        .collect();
    let mut want: Vec<(f64, i64)> = rows
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(i, r)| (reference("cosine_distance", r, query), i as i64))
        .collect();
    want.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let want: Vec<i64> = want.iter().take(10).map(|(_, id)| *id).collect();
    assert_eq!(got, want);
}

#[test]
fn the_kernel_this_cpu_runs_equals_the_portable_one_at_every_length() {
    // On x86_64 with AVX2 this compares the intrinsics with the portable lanes, remainders
    // (lengths that are not a multiple of 16) included.
    for n in 0..50 {
        let (a, b) = (&vectors(1, n, 3)[0], &vectors(1, n, 4)[0]);
        for l2 in [false, true] {
            let (fast, portable) = (super::sums(a, b, l2), super::sums_portable(a, b, l2));
            for (f, p) in [
                (fast.ab, portable.ab),
                (fast.aa, portable.aa),
                (fast.bb, portable.bb),
            ] {
                assert!(
                    (f - p).abs() <= 1e-5 * p.abs().max(1.0),
                    "n {n} l2 {l2}: {fast:?} vs {portable:?}"
                );
            }
        }
    }
}
