//! The int8 path's own CPU passes around libtorch's int8 product.
//!
//! libtorch has the int8 × int8 → int32 product (`_int_mm`: oneDNN, VNNI on x86), but as
//! tensor ops everything around it is a series of full passes over memory: quantizing an
//! input per row takes five (abs, amax, divide, round, cast), and turning the int32 sums into
//! fp32 with both scales and the bias two more over a result as large as the product's. For
//! a feed-forward layer those passes took as long as the product itself. Here each is one:
//! - [`quantize_rows`] reads a row twice while it is in cache (largest magnitude, then
//!   round to int8) and writes int8;
//! - [`rescale`] turns the int32 sums into fp32 in place (same size), with both scales, the
//!   bias and optionally a residual added, so a layer's `dense(x) + residual` is one pass.
//!
//! The passes run on libtorch's own OpenMP threads, the team that has just run the product
//! and is still spinning ([`crate::cpu::parallel`]).

use tch::{Device, Kind, Tensor};

use crate::cpu::{Shared, bf16_bits, bf16_value, erf, parallel, round_to_int, vectorized};

/// The largest int8 magnitude a scale maps to (symmetric: -127..=127, -128 unused).
pub(crate) const Q_MAX: f32 = 127.0;

/// A `[m, k]` fp32 input quantized per row: `x[i] ≈ q[i] * scale[i]`.
pub(crate) struct Rows {
    /// `[m, k]` int8.
    pub q: Tensor,
    /// One scale per row; NaN for a row that holds a NaN or an infinity, so that the
    /// product's row comes out NaN as the fp32 product's would.
    pub scale: Vec<f32>,
}

/// Symmetric per-row int8 of `x` (`[m, k]`, fp32, on the CPU): each row's scale maps its
/// largest magnitude to 127, values round to nearest (ties to even). A row of zeros gets the
/// smallest positive scale, not 0/0.
pub(crate) fn quantize_rows(x: &Tensor) -> Rows {
    let x = cpu_f32(x).contiguous();
    let (m, k) = matrix(&x);
    let q = Tensor::empty([m as i64, k as i64], (Kind::Int8, Device::Cpu));
    let mut scale = vec![0f32; m];
    if m * k > 0 {
        // SAFETY: `x` is a contiguous fp32 CPU tensor of m × k elements, only read here; `q`
        // was just allocated with m × k int8 elements and nothing else refers to it yet.
        let (xs, qs) = unsafe {
            (
                std::slice::from_raw_parts(x.data_ptr() as *const f32, m * k),
                std::slice::from_raw_parts_mut(q.data_ptr() as *mut i8, m * k),
            )
        };
        let out = Shared(qs.as_mut_ptr());
        let scales = Shared(scale.as_mut_ptr());
        parallel(m, &|rows| {
            for i in rows {
                // SAFETY: each row index belongs to exactly one range, so the writes to row
                // i of `q` and to `scale[i]` never overlap another thread's.
                let (row_q, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(out.at(i * k), k),
                        &mut *scales.at(i),
                    )
                };
                *s = quantize_row(&xs[i * k..(i + 1) * k], row_q);
            }
        });
    }
    Rows { q, scale }
}

/// `acc` (`[m, n]` int32 sums of [`Rows`] times int8 weight columns) as fp32
/// `acc[i][j] * row[i] * col[j] + bias[j] (+ residual[i][j])`, written over `acc`'s own
/// memory and returned as an fp32 view of it. `residual`, if any, is `[m, n]` fp32.
pub(crate) fn rescale(
    acc: Tensor,
    row: &[f32],
    col: &[f32],
    bias: &[f32],
    residual: Option<&Tensor>,
) -> Tensor {
    let (acc, m, n) = checked_sums(&acc, row, col, bias);
    let residual = residual.map(|r| {
        let r = cpu_f32(r).contiguous();
        assert!(r.numel() == m * n, "the residual does not fit the sums");
        r
    });
    if m * n > 0 {
        // SAFETY: `acc` is a contiguous int32 CPU tensor of m × n elements that this function
        // owns (`_int_mm`'s fresh output); `residual` a contiguous fp32 one of as many, only
        // read. int32 and fp32 have the same size, so each element is rewritten in place.
        let (sums, res) = unsafe {
            (
                Shared(acc.data_ptr() as *mut i32),
                residual
                    .as_ref()
                    .map(|r| std::slice::from_raw_parts(r.data_ptr() as *const f32, m * n)),
            )
        };
        parallel(m, &|rows| {
            for i in rows {
                // SAFETY: each row index belongs to exactly one range.
                let out = unsafe { std::slice::from_raw_parts_mut(sums.at(i * n), n) };
                rescale_row(out, row[i], col, bias, res.map(|r| &r[i * n..(i + 1) * n]));
            }
        });
    }
    acc.view_dtype(Kind::Float)
}

/// Like [`rescale`], then exact GELU (`0.5 x (1 + erf(x / √2))`), rounded to bf16 in a new
/// `[m, n]` tensor: a feed-forward up-projection whose output feeds a bf16 product, without
/// an fp32 activation in between.
pub(crate) fn rescale_gelu_bf16(acc: &Tensor, row: &[f32], col: &[f32], bias: &[f32]) -> Tensor {
    let (acc, m, n) = checked_sums(acc, row, col, bias);
    let out = Tensor::empty([m as i64, n as i64], (Kind::BFloat16, Device::Cpu));
    if m * n > 0 {
        // SAFETY: `acc` is a contiguous int32 CPU tensor of m × n elements, only read; `out`
        // was just allocated with m × n bf16 (16-bit) elements and nothing else refers to it.
        let (sums, dst) = unsafe {
            (
                std::slice::from_raw_parts(acc.data_ptr() as *const i32, m * n),
                Shared(out.data_ptr() as *mut u16),
            )
        };
        parallel(m, &|rows| {
            for i in rows {
                // SAFETY: each row index belongs to exactly one range.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst.at(i * n), n) };
                rescale_gelu_row(&sums[i * n..(i + 1) * n], row[i], col, bias, dst);
            }
        });
    }
    out
}

/// `y` (`[m, n]` bf16, a bf16 product's output) as fp32, plus `bias` (`[n]`) and `residual`
/// (`[m, n]` fp32), in a new fp32 tensor: the end of a feed-forward block in one pass.
pub(crate) fn add_bias_residual(y: &Tensor, bias: &[f32], residual: &Tensor) -> Tensor {
    let y = y.contiguous();
    let (m, n) = matrix(&y);
    assert!(
        y.kind() == Kind::BFloat16 && y.device() == Device::Cpu,
        "expected a bf16 product on the CPU"
    );
    let residual = cpu_f32(residual).contiguous();
    assert!(
        bias.len() == n && residual.numel() == m * n,
        "the bias or the residual does not fit the product"
    );
    let out = Tensor::empty([m as i64, n as i64], (Kind::Float, Device::Cpu));
    if m * n > 0 {
        // SAFETY: `y` (bf16) and `residual` (fp32) are contiguous CPU tensors of m × n
        // elements, only read; `out` was just allocated with m × n fp32 elements and nothing
        // else refers to it.
        let (ys, rs, dst) = unsafe {
            (
                std::slice::from_raw_parts(y.data_ptr() as *const u16, m * n),
                std::slice::from_raw_parts(residual.data_ptr() as *const f32, m * n),
                Shared(out.data_ptr() as *mut f32),
            )
        };
        parallel(m, &|rows| {
            for i in rows {
                let span = i * n..(i + 1) * n;
                // SAFETY: each row index belongs to exactly one range.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst.at(i * n), n) };
                add_bias_residual_row(&ys[span.clone()], bias, &rs[span], dst);
            }
        });
    }
    out
}

/// `acc` (int32 sums on the CPU) made contiguous, with its rows and columns, checked
/// against the row scales, column scales and bias that go with it.
fn checked_sums(acc: &Tensor, row: &[f32], col: &[f32], bias: &[f32]) -> (Tensor, usize, usize) {
    let acc = acc.contiguous();
    let (m, n) = matrix(&acc);
    assert!(
        acc.kind() == Kind::Int && acc.device() == Device::Cpu,
        "int8 sums must be int32 on the CPU"
    );
    assert!(
        row.len() == m && col.len() == n && bias.len() == n,
        "scales do not fit the sums"
    );
    (acc, m, n)
}

fn cpu_f32(x: &Tensor) -> Tensor {
    assert!(
        x.device() == Device::Cpu,
        "the int8 path runs on the CPU only"
    );
    x.to_kind(Kind::Float)
}

/// Rows and columns of a 2-d tensor.
fn matrix(x: &Tensor) -> (usize, usize) {
    let size = x.size();
    assert!(size.len() == 2, "expected a matrix, got shape {size:?}");
    (size[0] as usize, size[1] as usize)
}

vectorized! {
    /// Largest magnitude of `x`, then `x` rounded to int8 in `q`; returns the scale.
    fn quantize_row(x: &[f32], q: &mut [i8]) -> f32 = quantize_row_body;
}

/// Written so that the compiler vectorizes both loops: 16 independent lanes of maxima (and of
/// `x * 0`, which turns NaN for a NaN or an infinity), then a rounding without any
/// float-to-integer conversion (see [`round_to_int`]).
#[inline(always)]
fn quantize_row_body(x: &[f32], q: &mut [i8]) -> f32 {
    const LANES: usize = 16;
    let mut max = [0f32; LANES];
    let mut poison = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        if let Ok(c) = <&[f32; LANES]>::try_from(c) {
            for l in 0..LANES {
                let a = c[l].abs();
                max[l] = if a > max[l] { a } else { max[l] };
                poison[l] += c[l] * 0.0;
            }
        }
    }
    let mut amax = 0f32;
    let mut bad = 0f32;
    for (&a, &p) in max.iter().zip(&poison) {
        amax = if a > amax { a } else { amax };
        bad += p;
    }
    for &v in rest {
        amax = amax.max(v.abs());
        bad += v * 0.0;
    }
    if bad.is_nan() {
        q.fill(0);
        return f32::NAN;
    }
    let amax = amax.max(f32::MIN_POSITIVE);
    let inv = Q_MAX / amax;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * inv| ≤ 127, so the integer fits an i8.
        *q = round_to_int(v * inv) as i8;
    }
    amax / Q_MAX
}

vectorized! {
    /// One row of [`rescale`].
    fn rescale_row(out: &mut [i32], s: f32, col: &[f32], bias: &[f32], residual: Option<&[f32]>)
        = rescale_row_body;
}

#[inline(always)]
fn rescale_row_body(out: &mut [i32], s: f32, col: &[f32], bias: &[f32], residual: Option<&[f32]>) {
    let n = out.len();
    let (col, bias) = (&col[..n], &bias[..n]);
    match residual {
        Some(r) => {
            let r = &r[..n];
            for j in 0..n {
                out[j] = ((out[j] as f32 * (s * col[j]) + bias[j]) + r[j]).to_bits() as i32;
            }
        }
        None => {
            for j in 0..n {
                out[j] = (out[j] as f32 * (s * col[j]) + bias[j]).to_bits() as i32;
            }
        }
    }
}

vectorized! {
    /// One row of [`rescale_gelu_bf16`].
    fn rescale_gelu_row(sums: &[i32], s: f32, col: &[f32], bias: &[f32], out: &mut [u16])
        = rescale_gelu_row_body;
}

#[inline(always)]
fn rescale_gelu_row_body(sums: &[i32], s: f32, col: &[f32], bias: &[f32], out: &mut [u16]) {
    let n = out.len();
    let (sums, col, bias) = (&sums[..n], &col[..n], &bias[..n]);
    for j in 0..n {
        let x = sums[j] as f32 * (s * col[j]) + bias[j];
        out[j] = bf16_bits(0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)));
    }
}

vectorized! {
    /// One row of [`add_bias_residual`].
    fn add_bias_residual_row(y: &[u16], bias: &[f32], residual: &[f32], out: &mut [f32])
        = add_bias_residual_row_body;
}

#[inline(always)]
fn add_bias_residual_row_body(y: &[u16], bias: &[f32], residual: &[f32], out: &mut [f32]) {
    let n = out.len();
    let (y, bias, residual) = (&y[..n], &bias[..n], &residual[..n]);
    for j in 0..n {
        out[j] = (bf16_value(y[j]) + bias[j]) + residual[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::exp_neg;

    fn randn(shape: &[i64], seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(shape, (Kind::Float, Device::Cpu))
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).expect("values")
    }

    /// Random int32 sums `[m, n]`, row and column scales, a bias, as `_int_mm` and the
    /// layers would give them.
    fn sums(m: i64, n: i64) -> (Tensor, Vec<f32>, Vec<f32>, Vec<f32>) {
        tch::manual_seed(11);
        let acc = Tensor::randint_low(-60_000, 60_000, [m, n], (Kind::Int, Device::Cpu));
        let row = values(&(randn(&[m], 1).abs() * 0.01 + 1e-3));
        let col = values(&(randn(&[n], 2).abs() * 0.002 + 1e-4));
        let bias = values(&randn(&[n], 3));
        (acc, row, col, bias)
    }

    /// `acc * row * col + bias` in fp32 tensor ops.
    fn reference(acc: &Tensor, row: &[f32], col: &[f32], bias: &[f32]) -> Tensor {
        acc.to_kind(Kind::Float) * Tensor::from_slice(row).unsqueeze(1) * Tensor::from_slice(col)
            + Tensor::from_slice(bias)
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        f64::try_from(
            (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
                .abs()
                .max(),
        )
        .expect("scalar")
    }

    #[test]
    fn rows_quantize_as_the_tensor_ops_do() {
        // 100 columns: six 16-wide chunks and a remainder of 4.
        let x = randn(&[37, 100], 5) * 3.0;
        let rows = quantize_rows(&x);
        assert_eq!(rows.q.size(), [37, 100]);
        assert_eq!(rows.q.kind(), Kind::Int8);
        let scale = x.abs().amax([1].as_slice(), true) / f64::from(Q_MAX);
        let expected = (&x / &scale).round();
        for (got, want) in rows.scale.iter().zip(values(&scale)) {
            assert!((got - want).abs() <= want * 1e-6, "scale {got} vs {want}");
        }
        // Multiplying by 127 / max instead of dividing by max / 127 may round a value that
        // sits on a half the other way: one step, rarely.
        let q = rows.q.to_kind(Kind::Float);
        assert!(max_abs_diff(&q, &expected) <= 1.0);
        let off = i64::try_from(q.ne_tensor(&expected).sum(Kind::Int64)).expect("count");
        assert!(off <= 3, "{off} of 3,700 values rounded differently");
        // Every row's largest magnitude maps to ±127.
        let top = values(&q.abs().amax([1].as_slice(), false));
        assert!(top.iter().all(|&t| t == 127.0), "{top:?}");
    }

    #[test]
    fn zero_rows_get_the_smallest_scale_and_nan_or_infinite_rows_a_nan_one() {
        let x = Tensor::from_slice(&[0f32, 0.0, 0.0, 1.0, f32::NAN, 2.0, f32::INFINITY, 1.0, 3.0])
            .view([3, 3]);
        let rows = quantize_rows(&x);
        assert_eq!(rows.scale[0], f32::MIN_POSITIVE / Q_MAX);
        assert!(rows.scale[1].is_nan() && rows.scale[2].is_nan());
        assert_eq!(values(&rows.q.get(0)), [0.0, 0.0, 0.0]);
        // The NaN scale makes the product's row NaN, as the fp32 product's would be.
        let acc = Tensor::ones([3, 2], (Kind::Int, Device::Cpu));
        let y = rescale(acc, &rows.scale, &[1.0, 1.0], &[0.0, 0.0], None);
        assert!(values(&y.get(1)).iter().all(|v| v.is_nan()));
        assert!(values(&y.get(0)).iter().all(|v| v.is_finite()));
    }

    #[test]
    fn rescaling_gives_the_fp32_formula_in_place() {
        let (acc, row, col, bias) = sums(33, 70);
        let expected = reference(&acc, &row, &col, &bias);
        let ptr = acc.data_ptr();
        let y = rescale(acc.shallow_clone(), &row, &col, &bias, None);
        assert_eq!((y.kind(), y.size()), (Kind::Float, vec![33, 70]));
        assert_eq!(y.data_ptr(), ptr, "not rescaled in place");
        // Same arithmetic, grouped differently: within a few fp32 roundings.
        let tol = 1e-6 * f64::try_from(expected.abs().max()).expect("scalar");
        assert!(max_abs_diff(&y, &expected) <= tol);

        let (acc, ..) = sums(33, 70);
        let residual = randn(&[33, 70], 9);
        let expected = reference(&acc, &row, &col, &bias) + &residual;
        let y = rescale(acc, &row, &col, &bias, Some(&residual));
        let tol = 1e-6 * f64::try_from(expected.abs().max()).expect("scalar");
        assert!(max_abs_diff(&y, &expected) <= tol);
    }

    #[test]
    fn gelu_rescaling_matches_torch_exact_gelu_to_one_bf16_step() {
        let (acc, row, col, bias) = sums(21, 150);
        let y = rescale_gelu_bf16(&acc, &row, &col, &bias);
        assert_eq!((y.kind(), y.size()), (Kind::BFloat16, vec![21, 150]));
        let pre = reference(&acc, &row, &col, &bias);
        let exact = pre.gelu("none");
        // Both sides round to bf16 (8 significant bits): at most one step (2^-7 relative)
        // apart where the two erf approximations straddle a rounding boundary, plus their own
        // difference (erf to 5e-7, times |x| / 2), which only shows where GELU is nearly 0.
        let diff =
            (y.to_kind(Kind::Float) - exact.to_kind(Kind::BFloat16).to_kind(Kind::Float)).abs();
        let step = exact.abs() * 2f64.powi(-7) + pre.abs() * 5e-7;
        let worst = i64::try_from((&diff - &step).flatten(0, -1).argmax(0, false)).expect("i");
        let at = |t: &Tensor| values(&t.to_kind(Kind::Float).flatten(0, -1))[worst as usize];
        assert!(
            bool::try_from(diff.le_tensor(&step).all()).expect("bool"),
            "at x = {}: {} vs GELU {}",
            at(&pre),
            at(&y),
            at(&exact)
        );
        // And against fp32 GELU: bf16 rounding only.
        let rel =
            f64::try_from((y.to_kind(Kind::Float) - &exact).norm() / exact.norm()).expect("scalar");
        assert!(rel < 4e-3, "relative error {rel}");
    }

    #[test]
    fn erf_and_exp_follow_the_reference_functions() {
        let xs: Vec<f32> = (-6000..=6000).map(|i| i as f32 / 1000.0).collect();
        let reference = values(&Tensor::from_slice(&xs).to_kind(Kind::Double).erf());
        let worst = xs
            .iter()
            .zip(reference)
            .map(|(&x, want)| (erf(x) - want).abs())
            .fold(0f32, f32::max);
        // Abramowitz and Stegun's bound is 1.5e-7; fp32 arithmetic adds a few roundings.
        assert!(worst < 5e-7, "erf is off by up to {worst}");
        for &x in &[0.0f32, 1e-3, 0.5, 1.0, 7.25, 30.0, 86.9] {
            let want = (-f64::from(x)).exp();
            let got = f64::from(exp_neg(x));
            assert!(
                (got - want).abs() <= want * 3e-7,
                "exp(-{x}) = {got} vs {want}"
            );
        }
        assert_eq!(exp_neg(90.0), 0.0);
        assert_eq!(exp_neg(f32::INFINITY), 0.0);
    }

    #[test]
    fn bias_and_residual_join_a_bf16_product_exactly() {
        let y = randn(&[5, 40], 4).to_kind(Kind::BFloat16);
        let bias = values(&randn(&[40], 6));
        let residual = randn(&[5, 40], 7);
        let out = add_bias_residual(&y, &bias, &residual);
        let expected = y.to_kind(Kind::Float) + Tensor::from_slice(&bias) + &residual;
        assert_eq!(max_abs_diff(&out, &expected), 0.0);
    }
}
