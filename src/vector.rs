//! Vector functions in SQL: `cosine_similarity(a, b)`, `cosine_distance(a, b)`,
//! `inner_product(a, b)` and `l2_distance(a, b)` over vectors stored as
//! `FixedSizeList<Float32, d>` or `List<Float32>`. Lists of other numbers (the literal
//! `[0.1, 0.2]` is a list of float64) are cast to float32 first.
//!
//! A NULL vector gives NULL; two vectors of different lengths are an error that names both;
//! a NULL element inside a vector is an error. A constant argument (the query vector of a
//! search) is read once, never expanded to one copy per row. The kernel is compiled for
//! AVX-512, for AVX2 + FMA and for the baseline, and the fastest the CPU has runs
//! ([`crate::cpu::vectorized`]). `ORDER BY cosine_distance(v, [...]) LIMIT k` is DataFusion's
//! top-k, which keeps k rows instead of sorting the table.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Float32Array, Float64Array};
use arrow::datatypes::{DataType, Field};
use datafusion::common::{exec_err, plan_err};
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::prelude::SessionContext;

use crate::cpu::vectorized;

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

/// The sums over 16 independent lanes, which the compiler turns into vector registers; L2
/// sums the squared differences directly, which stays accurate when a ≈ b.
#[inline(always)]
fn sums_body(a: &[f32], b: &[f32], l2: bool) -> Sums {
    const LANES: usize = 16;
    let (mut ab, mut aa, mut bb) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        if let (Ok(x), Ok(y)) = (<&[f32; LANES]>::try_from(x), <&[f32; LANES]>::try_from(y)) {
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

vectorized! {
    /// [`sums_body`] for the CPU it runs on.
    fn sums(a: &[f32], b: &[f32], l2: bool) -> Sums = sums_body;
}

/// One argument: a column of vectors, or one vector for every row.
struct Vectors {
    list: ArrayRef,
    values: Float32Array,
    constant: bool,
}

impl Vectors {
    fn new(name: &str, arg: &ColumnarValue) -> Result<Self> {
        let (list, constant) = match arg {
            ColumnarValue::Array(a) => (Arc::clone(a), false),
            ColumnarValue::Scalar(s) => (s.to_array_of_size(1)?, true),
        };
        let values = match list.data_type() {
            DataType::FixedSizeList(..) => list.as_fixed_size_list().values(),
            DataType::List(_) => list.as_list::<i32>().values(),
            DataType::LargeList(_) => list.as_list::<i64>().values(),
            // A NULL literal: every row is NULL.
            DataType::Null => {
                return Ok(Self {
                    values: Float32Array::from(Vec::<f32>::new()),
                    list,
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
            values: values.clone(),
            list,
            constant,
        })
    }

    /// Row `i`'s vector; `None` when it is NULL.
    fn get(&self, i: usize) -> Option<std::ops::Range<usize>> {
        let i = if self.constant { 0 } else { i };
        if self.list.is_null(i) || self.list.data_type() == &DataType::Null {
            return None;
        }
        Some(match self.list.data_type() {
            DataType::FixedSizeList(_, n) => {
                let start = self.list.as_fixed_size_list().value_offset(i) as usize;
                start..start + *n as usize
            }
            DataType::List(_) => {
                let o = self.list.as_list::<i32>().value_offsets();
                o[i] as usize..o[i + 1] as usize
            }
            DataType::LargeList(_) => {
                let o = self.list.as_list::<i64>().value_offsets();
                o[i] as usize..o[i + 1] as usize
            }
            _ => return None,
        })
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
