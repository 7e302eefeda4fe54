//! Vector functions in SQL: `cosine_similarity(a, b)`, `cosine_distance(a, b)`,
//! `inner_product(a, b)` and `l2_distance(a, b)` over vectors stored as
//! `FixedSizeList<Float32, d>` or `List<Float32>`. Lists of other numbers (the literal
//! `[0.1, 0.2]` is a list of float64) are cast to float32 first.
//!
//! A NULL vector gives NULL; two vectors of different lengths are an error that names both;
//! a NULL element inside a vector is an error. A constant argument (the query vector of a
//! search) is read once, never expanded to one copy per row. The kernel runs in AVX2 + FMA
//! where the CPU has them (AVX-512 CPUs too: a scan is bound by memory, not lanes), else in
//! portable code. `ORDER BY cosine_distance(v, [...]) LIMIT k` is DataFusion's
//! top-k, which keeps k rows instead of sorting the table.

use std::sync::Arc;

use arrow::array::{Array, AsArray, Float32Array, Float64Array};
use arrow::datatypes::{DataType, Field};
use datafusion::common::{exec_err, plan_err};
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::prelude::SessionContext;

/// What a function computes from a pair of vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Metric {
    CosineSimilarity,
    CosineDistance,
    InnerProduct,
    L2Distance,
}

impl Metric {
    const ALL: [Metric; 4] = [
        Metric::CosineSimilarity,
        Metric::CosineDistance,
        Metric::InnerProduct,
        Metric::L2Distance,
    ];

    fn name(self) -> &'static str {
        match self {
            Metric::CosineSimilarity => "cosine_similarity",
            Metric::CosineDistance => "cosine_distance",
            Metric::InnerProduct => "inner_product",
            Metric::L2Distance => "l2_distance",
        }
    }

    /// The value from the sums of one pair. A cosine with a zero vector is NaN, as in
    /// pgvector: it sorts after every number.
    fn value(self, s: Sums) -> f64 {
        let cosine = || f64::from(s.ab) / (f64::from(s.aa) * f64::from(s.bb)).sqrt();
        match self {
            Metric::CosineSimilarity => cosine(),
            Metric::CosineDistance => 1.0 - cosine(),
            Metric::InnerProduct => f64::from(s.ab),
            Metric::L2Distance => f64::from(s.ab).sqrt(),
        }
    }
}

/// Σab, Σa² and Σb² of one pair (for L2, Σ(a-b)² in `ab`), in float32 over 16 lanes.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    ab: f32,
    aa: f32,
    bb: f32,
}

/// The sums in 16 independent float32 lanes, added up at the end; L2 sums the squared
/// differences directly, which stays accurate when a ≈ b. The portable version.
fn sums_portable(a: &[f32], b: &[f32], l2: bool) -> Sums {
    const LANES: usize = 16;
    let (mut ab, mut aa, mut bb) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            if l2 {
                let d = x[l] - y[l];
                ab[l] += d * d;
            } else {
                ab[l] += x[l] * y[l];
                aa[l] += x[l] * x[l];
                bb[l] += y[l] * y[l];
            }
        }
    }
    let mut s = Sums {
        ab: ab.iter().sum(),
        aa: aa.iter().sum(),
        bb: bb.iter().sum(),
    };
    for (&x, &y) in ra.iter().zip(rb) {
        if l2 {
            s.ab += (x - y) * (x - y);
        } else {
            s.ab += x * y;
            s.aa += x * x;
            s.bb += y * y;
        }
    }
    s
}

/// [`sums_portable`] in AVX2 + FMA, the same 16 lanes (two registers per sum). Written
/// with intrinsics: left to the auto-vectorizer, the three interleaved sums came out as
/// shuffles and stack spills, and a search scanned 3.4 GB/s of a 30 GB/s machine.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sums_avx2(a: &[f32], b: &[f32], l2: bool) -> Sums {
    use std::arch::x86_64::{
        __m256, _mm_add_ps, _mm_cvtss_f32, _mm_hadd_ps, _mm256_add_ps, _mm256_castps256_ps128,
        _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_sub_ps,
    };
    #[target_feature(enable = "avx2,fma")]
    fn total(x: __m256, y: __m256) -> f32 {
        let v = _mm256_add_ps(x, y);
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let q = _mm_hadd_ps(q, q);
        _mm_cvtss_f32(_mm_hadd_ps(q, q))
    }
    let n = a.len().min(b.len());
    let full = n - n % 16;
    let (mut ab0, mut ab1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut aa0, mut aa1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut bb0, mut bb1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 <= full <= both lengths, so the four 8-float loads are in bounds.
        let (x0, x1, y0, y1) = unsafe {
            (
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
            )
        };
        if l2 {
            let (d0, d1) = (_mm256_sub_ps(x0, y0), _mm256_sub_ps(x1, y1));
            ab0 = _mm256_fmadd_ps(d0, d0, ab0);
            ab1 = _mm256_fmadd_ps(d1, d1, ab1);
        } else {
            ab0 = _mm256_fmadd_ps(x0, y0, ab0);
            ab1 = _mm256_fmadd_ps(x1, y1, ab1);
            aa0 = _mm256_fmadd_ps(x0, x0, aa0);
            aa1 = _mm256_fmadd_ps(x1, x1, aa1);
            bb0 = _mm256_fmadd_ps(y0, y0, bb0);
            bb1 = _mm256_fmadd_ps(y1, y1, bb1);
        }
        i += 16;
    }
    let head = Sums {
        ab: total(ab0, ab1),
        aa: total(aa0, aa1),
        bb: total(bb0, bb1),
    };
    if full == n {
        return head;
    }
    let tail = sums_portable(&a[full..n], &b[full..n], l2);
    Sums {
        ab: head.ab + tail.ab,
        aa: head.aa + tail.aa,
        bb: head.bb + tail.bb,
    }
}

/// Σab, Σa², Σb² (or Σ(a-b)²) of one pair, on the fastest path this CPU has.
fn sums(a: &[f32], b: &[f32], l2: bool) -> Sums {
    #[cfg(target_arch = "x86_64")]
    // std caches the detection: each check is one load.
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { sums_avx2(a, b, l2) };
    }
    sums_portable(a, b, l2)
}

/// One argument: a column of vectors, or one vector for every row.
struct Vectors {
    /// Where each row's values start and end, read once per batch (a per-row downcast of
    /// the list cost a tenth of a search's time).
    rows: Rows,
    /// The rows that are NULL (a NULL literal: all of them).
    nulls: Option<arrow::buffer::NullBuffer>,
    values: Float32Array,
    constant: bool,
}

/// The layout of a list column's rows.
enum Rows {
    /// `len` values per row (a slice of the column slices its values too).
    Fixed(usize),
    Offsets(arrow::buffer::OffsetBuffer<i32>),
    LargeOffsets(arrow::buffer::OffsetBuffer<i64>),
    /// A NULL literal.
    Null,
}

impl Vectors {
    fn new(name: &str, arg: &ColumnarValue) -> Result<Self> {
        let (list, constant) = match arg {
            ColumnarValue::Array(a) => (Arc::clone(a), false),
            ColumnarValue::Scalar(s) => (s.to_array_of_size(1)?, true),
        };
        let (rows, values) = match list.data_type() {
            DataType::FixedSizeList(_, n) => {
                let len = usize::try_from(*n).unwrap_or(0);
                (Rows::Fixed(len), list.as_fixed_size_list().values())
            }
            DataType::List(_) => {
                let l = list.as_list::<i32>();
                (Rows::Offsets(l.offsets().clone()), l.values())
            }
            DataType::LargeList(_) => {
                let l = list.as_list::<i64>();
                (Rows::LargeOffsets(l.offsets().clone()), l.values())
            }
            // A NULL literal: every row is NULL.
            DataType::Null => {
                return Ok(Self {
                    rows: Rows::Null,
                    nulls: None,
                    values: Float32Array::from(Vec::<f32>::new()),
                    constant,
                });
            }
            other => return exec_err!("{name}: expected a list of float32, got {other}"),
        };
        let Some(values) = values.as_primitive_opt::<arrow::datatypes::Float32Type>() else {
            return exec_err!(
                "{name}: expected a list of float32, got {}",
                list.data_type()
            );
        };
        Ok(Self {
            rows,
            nulls: list.logical_nulls(),
            values: values.clone(),
            constant,
        })
    }

    /// Row `i`'s vector; `None` when it is NULL.
    fn get(&self, i: usize) -> Option<std::ops::Range<usize>> {
        let i = if self.constant { 0 } else { i };
        if self.nulls.as_ref().is_some_and(|n| n.is_null(i)) {
            return None;
        }
        match &self.rows {
            Rows::Fixed(len) => Some(i * len..(i + 1) * len),
            Rows::Offsets(o) => Some(o[i] as usize..o[i + 1] as usize),
            Rows::LargeOffsets(o) => Some(o[i] as usize..o[i + 1] as usize),
            Rows::Null => None,
        }
    }

    fn slice(&self, name: &str, range: std::ops::Range<usize>) -> Result<&[f32]> {
        if self.values.null_count() > 0 && range.clone().any(|j| self.values.is_null(j)) {
            return exec_err!("{name}: a vector has a NULL element; vectors hold numbers only");
        }
        Ok(&self.values.values()[range])
    }
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct VectorFunction {
    metric: Metric,
    signature: Signature,
}

/// A list type's element type, if it is a list.
fn element(t: &DataType) -> Option<&DataType> {
    match t {
        DataType::FixedSizeList(f, _) | DataType::List(f) | DataType::LargeList(f) => {
            Some(f.data_type())
        }
        _ => None,
    }
}

impl ScalarUDFImpl for VectorFunction {
    fn name(&self) -> &str {
        self.metric.name()
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float64)
    }

    /// Lists of any numbers become lists of float32 (nullable elements, as DataFusion's
    /// literals have them); the list kind (fixed-size or not) is kept.
    fn coerce_types(&self, args: &[DataType]) -> Result<Vec<DataType>> {
        let name = self.name();
        if args.len() != 2 {
            return plan_err!("{name}: takes two vectors, got {} arguments", args.len());
        }
        args.iter()
            .map(|t| {
                let float = Arc::new(Field::new_list_field(DataType::Float32, true));
                match (t, element(t)) {
                    (DataType::Null, _) => Ok(DataType::Null),
                    (_, Some(e)) if e.is_numeric() || *e == DataType::Null => Ok(match t {
                        DataType::FixedSizeList(_, n) => DataType::FixedSizeList(float, *n),
                        DataType::LargeList(_) => DataType::LargeList(float),
                        _ => DataType::List(float),
                    }),
                    _ => plan_err!(
                        "{name}: takes vectors (lists of float32, such as an `embedding` \
                         column or [0.1, 0.2]), got {t}"
                    ),
                }
            })
            .collect()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let name = self.name();
        let [a, b] = args.args.as_slice() else {
            return exec_err!("{name}: takes two vectors");
        };
        let (a, b) = (Vectors::new(name, a)?, Vectors::new(name, b)?);
        let rows = if a.constant && b.constant {
            1
        } else {
            args.number_rows
        };
        let l2 = self.metric == Metric::L2Distance;
        let mut out = Vec::with_capacity(rows);
        for i in 0..rows {
            let (Some(ra), Some(rb)) = (a.get(i), b.get(i)) else {
                out.push(None);
                continue;
            };
            if ra.len() != rb.len() {
                return exec_err!(
                    "{name}: the vectors have {} and {} dimensions; both sides need the same",
                    ra.len(),
                    rb.len()
                );
            }
            let s = sums(a.slice(name, ra)?, b.slice(name, rb)?, l2);
            out.push(Some(self.metric.value(s)));
        }
        let array = Float64Array::from(out);
        Ok(if a.constant && b.constant {
            ColumnarValue::Scalar(datafusion::scalar::ScalarValue::try_from_array(&array, 0)?)
        } else {
            ColumnarValue::Array(Arc::new(array))
        })
    }
}

/// Adds the vector functions to a session.
pub(crate) fn register(ctx: &SessionContext) {
    for metric in Metric::ALL {
        ctx.register_udf(ScalarUDF::from(VectorFunction {
            metric,
            signature: Signature::user_defined(Volatility::Immutable),
        }));
    }
}

#[cfg(test)]
mod tests;
