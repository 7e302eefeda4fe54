//! Inference attention's scale, mask and softmax in one pass over the scores.
//!
//! As tensor ops, a short sequence's attention probabilities took three passes besides the
//! product: the additive mask broadcast to a full `[batch × heads, queries, keys]` copy for
//! `baddbmm`, the product's scaling and addition, then libtorch's softmax, whose rows here
//! are ~30 keys: too short for its vector loop, so most of each row went through scalar
//! `expf` (4.4% of a bf16 prediction). Here each row is read once into fp32, padded to whole
//! vectors, and written back as probabilities, in place, on libtorch's OpenMP team.

use tch::{Device, Kind, Tensor};

use crate::cpu::{Shared, bf16_bits, bf16_value, exp_neg, parallel, vectorized};

/// The longest row [`masked_softmax_`] takes (inference attention's short path keeps
/// sequences below this).
pub(crate) const MAX_KEYS: usize = 512;

/// Vector width of the row loops (16 fp32 lanes: one AVX-512 register).
const LANES: usize = 16;

/// `softmax(scale · scores + bias[batch])` over the last dimension of `scores`
/// (`[batch × heads, queries, keys]`, fp32 or bf16, contiguous, on the CPU), in place;
/// `bias` is `[batch, keys]` (the attention mask's additive form) and `heads` says which
/// batch a row belongs to. For inference: the result does not track gradients.
pub(crate) fn masked_softmax_(scores: &Tensor, bias: &Tensor, heads: usize, scale: f32) {
    let size = scores.size();
    let kind = scores.kind();
    assert!(
        size.len() == 3
            && scores.is_contiguous()
            && scores.device() == Device::Cpu
            && matches!(kind, Kind::Float | Kind::BFloat16),
        "masked softmax wants contiguous fp32 or bf16 CPU scores, got {size:?} {kind:?}"
    );
    let (rows_per_batch, keys) = (heads * size[1] as usize, size[2] as usize);
    let rows = size[0] as usize * size[1] as usize;
    assert!(keys <= MAX_KEYS, "{keys} keys is past the short path");
    let bias =
        Vec::<f32>::try_from(bias.to_kind(Kind::Float).reshape([-1])).expect("an fp32 CPU bias");
    assert!(
        bias.len() * rows_per_batch == rows * keys,
        "the bias does not fit the scores"
    );
    let base = scores.data_ptr();
    let (s32, s16) = (Shared(base as *mut f32), Shared(base as *mut u16));
    let bf16 = kind == Kind::BFloat16;
    parallel(rows, &|range| {
        let mut x = [0f32; MAX_KEYS];
        let padded = keys.div_ceil(LANES) * LANES;
        for r in range {
            let batch = r / rows_per_batch;
            let bias = &bias[batch * keys..(batch + 1) * keys];
            let x = &mut x[..padded];
            // SAFETY: `scores` holds rows × keys contiguous elements of its kind, and each
            // row is read and written by this task only.
            unsafe {
                if bf16 {
                    let row = std::slice::from_raw_parts_mut(s16.at(r * keys), keys);
                    softmax_bf16(row, bias, scale, x);
                } else {
                    let row = std::slice::from_raw_parts_mut(s32.at(r * keys), keys);
                    softmax_f32(row, bias, scale, x);
                }
            }
        }
    });
}

/// Softmax of `x` (`scale · row + bias`, padded to whole vectors with a value whose
/// exponential is 0), normalized in place; `keys` of them are real.
#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let mut max = [f32::MIN; LANES];
    for block in x.chunks_exact(LANES) {
        for (m, &v) in max.iter_mut().zip(block) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = max.iter().fold(f32::MIN, |a, &b| if b > a { b } else { a });
    let mut sum = [0f32; LANES];
    for block in x.chunks_exact_mut(LANES) {
        for (s, v) in sum.iter_mut().zip(block) {
            *v = exp_neg(max - *v);
            *s += *v;
        }
    }
    let inv = 1.0 / sum.iter().sum::<f32>();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Padding past the last key: far below any score, so that its exponential is 0.
const PAD: f32 = -1e30;

#[inline(always)]
fn softmax_f32_body(row: &mut [f32], bias: &[f32], scale: f32, x: &mut [f32]) {
    x.fill(PAD);
    for ((x, &s), &b) in x.iter_mut().zip(row.iter()).zip(bias) {
        *x = s * scale + b;
    }
    softmax_body(x);
    row.copy_from_slice(&x[..row.len()]);
}

#[inline(always)]
fn softmax_bf16_body(row: &mut [u16], bias: &[f32], scale: f32, x: &mut [f32]) {
    x.fill(PAD);
    for ((x, &s), &b) in x.iter_mut().zip(row.iter()).zip(bias) {
        *x = bf16_value(s) * scale + b;
    }
    softmax_body(x);
    for (out, &p) in row.iter_mut().zip(x.iter()) {
        *out = bf16_bits(p);
    }
}

vectorized! {
    /// One fp32 row of [`masked_softmax_`], through the scratch row `x`.
    fn softmax_f32(row: &mut [f32], bias: &[f32], scale: f32, x: &mut [f32]) = softmax_f32_body;
}

vectorized! {
    /// One bf16 row of [`masked_softmax_`], through the fp32 scratch row `x`.
    fn softmax_bf16(row: &mut [u16], bias: &[f32], scale: f32, x: &mut [f32]) = softmax_bf16_body;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention_bias;

    /// Scores `[batch × heads, queries, keys]` and a mask with padded keys.
    fn inputs(kind: Kind, keys: i64) -> (Tensor, Tensor) {
        tch::manual_seed(21);
        let (batch, heads, queries) = (3, 4, 5);
        let scores = (Tensor::randn([batch * heads, queries, keys], (Kind::Float, Device::Cpu))
            * 4.0)
            .to_kind(kind);
        // Row b keeps its first keys - 2b keys.
        let lengths = Tensor::from_slice(&[keys, keys - 2, keys - 4]);
        let mask = Tensor::arange(keys, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .lt_tensor(&lengths.unsqueeze(1));
        (scores, attention_bias(&mask, kind))
    }

    #[test]
    fn matches_libtorchs_scaled_masked_softmax() {
        for kind in [Kind::Float, Kind::BFloat16] {
            // Shorter than one vector, whole vectors, and a ragged length.
            for keys in [5, 32, 37] {
                let (scores, bias) = inputs(kind, keys);
                let (bh, t) = (scores.size()[0], scores.size()[1]);
                let heads = 4;
                let batch = bh / heads;
                let want = (scores.to_kind(Kind::Float).view([batch, heads, t, keys]) * 0.125
                    + bias.to_kind(Kind::Float))
                .softmax(-1, Kind::Float)
                .view([bh, t, keys]);
                let got = scores.copy();
                masked_softmax_(&got, &bias.view([batch, keys]), heads as usize, 0.125);
                let diff = (got.to_kind(Kind::Float) - &want)
                    .abs()
                    .max()
                    .double_value(&[]);
                // fp32: the exponential's 1e-7; bf16: the output's rounding (2^-9 of 1).
                let tolerance = if kind == Kind::Float { 1e-6 } else { 2e-3 };
                assert!(
                    diff <= tolerance,
                    "{kind:?}, {keys} keys: max |diff| {diff}"
                );
                // Masked keys get exactly 0, and rows sum to 1.
                let last = got.to_kind(Kind::Float).narrow(0, bh - 1, 1);
                assert_eq!(
                    last.narrow(2, keys - 4, 4).abs().max().double_value(&[]),
                    0.0
                );
                let sums =
                    got.to_kind(Kind::Float)
                        .sum_dim_intlist([-1].as_slice(), false, Kind::Float);
                assert!(
                    (sums - 1.0).abs().max().double_value(&[]) < 1e-2,
                    "{kind:?}"
                );
            }
        }
    }
}
