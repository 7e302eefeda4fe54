//! Float (fp32 or bf16) inference of a post-norm encoder layer (BERT's, DistilBERT's) on
//! the CPU, with lakeml's own passes between libtorch's products.
//!
//! As tensor ops, each of a layer's six products is an `addmm`: libtorch first copies the
//! bias into every row of the output, then runs the GEMM adding to it, and the residual add,
//! LayerNorm and GELU that follow are one more full pass each (in a bf16 predict profile the
//! bias copies, LayerNorm and residual add were about 4% of the time, against 70% for the
//! products). Here the products run without their bias, and each bias joins a pass that is
//! there anyway:
//! - the query, key and value biases are added as the attention pass loads its rows
//!   ([`super::attend`]);
//! - [`bias_residual_norm`]: a projection's bias, the residual and the LayerNorm, in one pass
//!   that reads each row once and keeps it in fp32 until the normalized output is written;
//! - [`bias_gelu_`]: the up-projection's bias and exact GELU, in place.
//!
//! Arithmetic is fp32; bf16 is rounded once, on output, where the tensor ops rounded after
//! each op. The passes run on libtorch's own OpenMP team ([`parallel`]).

use tch::nn;
use tch::{Device, Kind, Tensor};

use super::linear::{bias_values, floats};
use super::{Linear, activation, attend, attention, queries};
use crate::cpu::{Element, Shared, erf, has_avx512, parallel, vectorized};

/// Vector width the row loops are written for (16 fp32 lanes: one AVX-512 register).
const LANES: usize = 16;

/// The parts of a post-norm encoder layer, `norm2(x' + down(act(up(x')))) where
/// x' = norm1(x + out(attention(q(x), k(x), v(x))))`.
pub(crate) struct EncoderLayer<'a> {
    pub qkv: [&'a Linear; 3],
    /// The three weights as one, if fused (see [`super::Classifier::fuse_qkv`]).
    pub qkv_weight: Option<&'a Tensor>,
    pub out: &'a Linear,
    pub attn_norm: &'a nn::LayerNorm,
    pub up: &'a Linear,
    pub down: &'a Linear,
    pub out_norm: &'a nn::LayerNorm,
    pub heads: i64,
    pub act: &'a str,
    pub eps: f64,
}

/// The layer's linear layers as plain `nn::Linear`s: their weights and biases as the
/// VarStore holds them (none switched to int8 or bf16 products).
struct Plain<'a> {
    qkv: [&'a nn::Linear; 3],
    out: &'a nn::Linear,
    up: &'a nn::Linear,
    down: &'a nn::Linear,
}

impl EncoderLayer<'_> {
    /// Query, key and value's weights side by side, `[3 × hidden, hidden]` (see
    /// [`super::Classifier::fuse_qkv`]); none if any of them runs in int8 or bf16.
    pub(crate) fn fused_weight(qkv: [&Linear; 3]) -> Option<Tensor> {
        let [q, k, v] = qkv.map(|l| l.plain().map(|l| &l.ws));
        Some(Tensor::cat(&[q?, k?, v?], 0).detach())
    }

    /// Whether [`EncoderLayer::infer`] runs `x`: float inference on the CPU (no gradient
    /// needed), with every product on the layer's own fp32 or bf16 variables.
    pub(crate) fn runs(&self, x: &Tensor, train: bool) -> bool {
        !train
            && !x.requires_grad()
            && x.device() == Device::Cpu
            && matches!(x.kind(), Kind::Float | Kind::BFloat16)
            && self.plain().is_some()
            && [self.attn_norm, self.out_norm]
                .iter()
                .all(|n| n.ws.is_some() && n.bs.is_some())
    }

    fn plain(&self) -> Option<Plain<'_>> {
        let [q, k, v] = self.qkv;
        Some(Plain {
            qkv: [q.plain()?, k.plain()?, v.plain()?],
            out: self.out.plain()?,
            up: self.up.plain()?,
            down: self.down.plain()?,
        })
    }

    /// The layer's output for `x` `[batch, seq, hidden]` with the additive attention mask
    /// `mask` (see [`super::attention_bias`]); only the first token's when `first_only`
    /// (see [`queries`]). Only where [`EncoderLayer::runs`].
    pub(crate) fn infer(&self, x: &Tensor, mask: &Tensor, first_only: bool) -> Tensor {
        let p = self
            .plain()
            .expect("EncoderLayer::infer needs plain float layers");
        let product = |l: &nn::Linear, x: &Tensor| x.linear::<&Tensor>(&l.ws, None);
        let input = queries(x, first_only);
        let hidden = x.size()[2];
        let [q, k, v] = match self.qkv_weight {
            // One product, whose column ranges the attention reads in place; a last layer
            // computes its first tokens' queries alone, and the keys and values together.
            Some(w) if first_only => {
                let kv = x.linear::<&Tensor>(&w.narrow(0, hidden, 2 * hidden), None);
                [
                    input.linear::<&Tensor>(&w.narrow(0, 0, hidden), None),
                    kv.narrow(2, 0, hidden),
                    kv.narrow(2, hidden, hidden),
                ]
            }
            Some(w) => {
                let qkv = x.linear::<&Tensor>(w, None);
                [0, 1, 2].map(|i| qkv.narrow(2, i * hidden, hidden))
            }
            None => {
                let [q, k, v] = p.qkv;
                [product(q, &input), product(k, x), product(v, x)]
            }
        };
        let [qb, kb, vb] = p.qkv.map(bias_values);
        let scale = 1.0 / ((hidden / self.heads) as f64).sqrt();
        let ctx = if attend::runs(&q, &k) {
            attend::attention(
                &q,
                &k,
                &v,
                Some([&qb, &kb, &vb]),
                mask,
                self.heads as usize,
                scale as f32,
            )
        } else {
            let add = |t: Tensor, b: &[f32]| t + Tensor::from_slice(b).to_kind(x.kind());
            attention(
                &add(q, &qb),
                &add(k, &kb),
                &add(v, &vb),
                mask,
                self.heads,
                0.0,
                false,
            )
        };
        let eps = self.eps as f32;
        let x = bias_residual_norm(
            &product(p.out, &ctx),
            &bias_values(p.out),
            &input,
            self.attn_norm,
            eps,
        );
        let inner = product(p.up, &x);
        let inner = if self.act == "gelu" {
            bias_gelu_(&inner, &bias_values(p.up));
            inner
        } else {
            let b = Tensor::from_slice(&bias_values(p.up)).to_kind(inner.kind());
            activation(self.act, &(inner + b))
        };
        bias_residual_norm(
            &product(p.down, &inner),
            &bias_values(p.down),
            &x,
            self.out_norm,
            eps,
        )
    }
}

/// `norm(y + bias + residual)` over the last dimension: `y` a product without its bias
/// (`[..., n]`, fp32 or bf16, on the CPU), `bias` its `n` bias values, `residual` shaped and
/// typed as `y`, `norm` a LayerNorm over `n` with weight and bias. A new tensor of `y`'s
/// shape and kind.
pub(crate) fn bias_residual_norm(
    y: &Tensor,
    bias: &[f32],
    residual: &Tensor,
    norm: &nn::LayerNorm,
    eps: f32,
) -> Tensor {
    let (y, residual) = (y.contiguous(), residual.contiguous());
    let (m, n) = rows(&y);
    let kind = y.kind();
    let [weight, shift] = [&norm.ws, &norm.bs].map(|t| floats(t.as_ref().expect("an affine norm")));
    assert!(
        residual.size() == y.size()
            && residual.kind() == kind
            && residual.device() == Device::Cpu
            && [bias.len(), weight.len(), shift.len()] == [n; 3],
        "a residual norm wants a residual shaped as the product ({:?}), and {n} bias and norm \
         values; got {:?} {:?}, {} bias, {} norm",
        y.size(),
        residual.size(),
        residual.kind(),
        bias.len(),
        weight.len()
    );
    let out = y.empty_like();
    let norm = Norm {
        bias,
        weight: &weight,
        shift: &shift,
        eps,
    };
    if kind == Kind::BFloat16 {
        for_rows::<u16>(m, n, [&y, &residual], &out, &|[y, r], tmp, out| {
            norm_bf16(y, r, &norm, tmp, out)
        });
    } else {
        for_rows::<f32>(m, n, [&y, &residual], &out, &|[y, r], tmp, out| {
            norm_f32(y, r, &norm, tmp, out)
        });
    }
    out
}

/// `y = gelu(y + bias)` (exact GELU), in place: `y` a contiguous product without its bias
/// (`[..., n]`, fp32 or bf16, on the CPU), `bias` its `n` values.
pub(crate) fn bias_gelu_(y: &Tensor, bias: &[f32]) {
    assert!(
        y.is_contiguous(),
        "bias_gelu_ works on a contiguous product"
    );
    let (m, n) = rows(y);
    assert_eq!(bias.len(), n, "the bias does not fit the product");
    if y.kind() == Kind::BFloat16 {
        for_rows_mut::<u16>(m, n, y, &|row| gelu_row(row, bias));
    } else {
        for_rows_mut::<f32>(m, n, y, &|row| gelu_row(row, bias));
    }
}

/// One row of [`bias_gelu_`]: AVX-512 where the CPU has it, else the compiler's vectors.
fn gelu_row<E: GeluElement>(row: &mut [E], bias: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512 F, BW and VL (checked just above).
        return unsafe { x86::gelu_row(row, bias) };
    }
    E::portable_gelu_row(row, bias);
}

/// An element type with a compiled-for-the-CPU portable GELU row.
trait GeluElement: Element {
    fn portable_gelu_row(row: &mut [Self], bias: &[f32]);
}

impl GeluElement for f32 {
    fn portable_gelu_row(row: &mut [f32], bias: &[f32]) {
        gelu_f32(row, bias)
    }
}

impl GeluElement for u16 {
    fn portable_gelu_row(row: &mut [u16], bias: &[f32]) {
        gelu_bf16(row, bias)
    }
}

/// Rows and row length of a float CPU tensor of at least one dimension.
fn rows(y: &Tensor) -> (usize, usize) {
    let size = y.size();
    assert!(
        !size.is_empty()
            && y.device() == Device::Cpu
            && matches!(y.kind(), Kind::Float | Kind::BFloat16),
        "expected a float CPU tensor, got {size:?} {:?} on {:?}",
        y.kind(),
        y.device()
    );
    let n = *size.last().unwrap_or(&1) as usize;
    (y.numel().checked_div(n).unwrap_or(0), n)
}

/// Runs `f` over the `m` rows of `n` elements of two contiguous inputs and of `out`, a
/// third tensor, with an fp32 row of scratch per thread.
#[allow(clippy::type_complexity)]
fn for_rows<E: Element>(
    m: usize,
    n: usize,
    inputs: [&Tensor; 2],
    out: &Tensor,
    f: &(dyn Fn([&[E]; 2], &mut [f32], &mut [E]) + Sync),
) {
    if m * n == 0 {
        return;
    }
    let [a, b] = inputs.map(|t| Shared(t.data_ptr() as *mut E));
    let dst = Shared(out.data_ptr() as *mut E);
    parallel(m, &|range| {
        let mut tmp = vec![0f32; n];
        for i in range {
            // SAFETY: the inputs and `out` are distinct contiguous CPU tensors of m × n
            // elements of type E (checked by the callers); the inputs are only read, and row
            // i of `out` is written by this task only.
            let (x, y, o) = unsafe {
                (
                    std::slice::from_raw_parts(a.at(i * n) as *const E, n),
                    std::slice::from_raw_parts(b.at(i * n) as *const E, n),
                    std::slice::from_raw_parts_mut(dst.at(i * n), n),
                )
            };
            f([x, y], &mut tmp, o);
        }
    });
}

/// Runs `f` over the `m` rows of `n` elements of the contiguous tensor `y`, in place.
fn for_rows_mut<E: Element>(m: usize, n: usize, y: &Tensor, f: &(dyn Fn(&mut [E]) + Sync)) {
    if m * n == 0 {
        return;
    }
    let dst = Shared(y.data_ptr() as *mut E);
    parallel(m, &|range| {
        for i in range {
            // SAFETY: `y` is a contiguous CPU tensor of m × n elements of type E (checked by
            // the caller), of which row i is touched by this task only.
            f(unsafe { std::slice::from_raw_parts_mut(dst.at(i * n), n) });
        }
    });
}

/// A residual norm's per-column values.
struct Norm<'a> {
    bias: &'a [f32],
    weight: &'a [f32],
    shift: &'a [f32],
    eps: f32,
}

vectorized! {
    fn norm_f32(y: &[f32], r: &[f32], norm: &Norm, tmp: &mut [f32], out: &mut [f32])
        = norm_row::<f32>;
}

vectorized! {
    fn norm_bf16(y: &[u16], r: &[u16], norm: &Norm, tmp: &mut [f32], out: &mut [u16])
        = norm_row::<u16>;
}

/// One row of [`bias_residual_norm`]: the sum into `tmp`, then its mean and variance (two
/// passes over `tmp`, in cache), then the normalized row.
#[inline(always)]
fn norm_row<E: Element>(y: &[E], r: &[E], norm: &Norm, tmp: &mut [f32], out: &mut [E]) {
    let n = out.len();
    let (y, r, tmp) = (&y[..n], &r[..n], &mut tmp[..n]);
    let (bias, weight, shift) = (&norm.bias[..n], &norm.weight[..n], &norm.shift[..n]);
    for j in 0..n {
        tmp[j] = y[j].value() + bias[j] + r[j].value();
    }
    let mean = lane_sum(tmp, |x| x) / n as f32;
    let var = lane_sum(tmp, |x| (x - mean) * (x - mean)) / n as f32;
    let rstd = 1.0 / (var + norm.eps).sqrt();
    for j in 0..n {
        out[j] = E::from_value((tmp[j] - mean) * rstd * weight[j] + shift[j]);
    }
}

/// The sum of `f` over `x`, in [`LANES`] independent partial sums (which vectorize).
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for chunk in chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    acc.iter().sum::<f32>() + rest
}

vectorized! {
    fn gelu_f32(row: &mut [f32], bias: &[f32]) = portable_gelu::<f32>;
}

vectorized! {
    fn gelu_bf16(row: &mut [u16], bias: &[f32]) = portable_gelu::<u16>;
}

/// One row of [`bias_gelu_`] on any CPU ([`erf`]).
#[inline(always)]
fn portable_gelu<E: Element>(row: &mut [E], bias: &[f32]) {
    let bias = &bias[..row.len()];
    for (y, &b) in row.iter_mut().zip(bias) {
        let x = y.value() + b;
        *y = E::from_value(0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::_mm512_add_ps;

    use crate::cpu::Element;
    use crate::cpu::avx512::{LANES, gelu, read, write};

    /// One row of [`super::bias_gelu_`], 16 lanes at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) fn gelu_row<E: Element>(row: &mut [E], bias: &[f32]) {
        let n = row.len();
        let bias = &bias[..n];
        for c in (0..n).step_by(LANES) {
            let count = (n - c).min(LANES);
            // SAFETY: `count` elements from c in `row` and in `bias`.
            unsafe {
                let x = _mm512_add_ps(
                    read(row[c..].as_ptr(), count),
                    read(bias[c..].as_ptr(), count),
                );
                write(row[c..].as_mut_ptr(), gelu(x), count);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `got` within a tolerance of `want` (fp32) relative to each element's size: `relative`
    /// of it, plus `absolute`.
    fn assert_close(got: &Tensor, want: &Tensor, relative: f64, absolute: f64, what: &str) {
        let excess = ((got.to_kind(Kind::Float) - want).abs() - want.abs() * relative - absolute)
            .max()
            .double_value(&[]);
        assert!(excess <= 0.0, "{what}: past the tolerance by {excess}");
    }

    fn norm(n: i64) -> (nn::VarStore, nn::LayerNorm) {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut norm = super::super::layer_norm(vs.root() / "norm", n, 1e-12);
        tch::no_grad(|| {
            norm.ws
                .as_mut()
                .expect("weight")
                .copy_(&(Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.5 + 1.0));
            norm.bs
                .as_mut()
                .expect("bias")
                .copy_(&Tensor::randn([n], (Kind::Float, Device::Cpu)));
        });
        (vs, norm)
    }

    #[test]
    fn the_residual_norm_is_libtorchs_layer_norm_of_the_sum() {
        tch::manual_seed(31);
        // A row of whole vectors, and one with a remainder.
        for n in [64, 37] {
            let (mut vs, norm) = norm(n);
            for kind in [Kind::Float, Kind::BFloat16] {
                vs.set_kind(kind);
                let [y, r] = [0, 1].map(|_| {
                    (Tensor::randn([3, 5, n], (Kind::Float, Device::Cpu)) * 3.0 + 1.0).to_kind(kind)
                });
                let b = Tensor::randn([n], (Kind::Float, Device::Cpu));
                let bias = floats(&b);
                let got = tch::no_grad(|| bias_residual_norm(&y, &bias, &r, &norm, 1e-12));
                assert_eq!((got.size(), got.kind()), (y.size(), kind));
                // The reference: the same inputs in fp32, libtorch's ops.
                let f = |t: &Tensor| t.to_kind(Kind::Float);
                let want = (f(&y) + &b + f(&r)).layer_norm(
                    [n],
                    norm.ws.as_ref().map(f).as_ref(),
                    norm.bs.as_ref().map(f).as_ref(),
                    1e-12,
                    false,
                );
                // fp32: summation order; bf16: the output's rounding (half an ulp, 2^-9).
                let relative = if kind == Kind::Float {
                    1e-5
                } else {
                    2f64.powi(-8)
                };
                assert_close(
                    &got,
                    &want,
                    relative,
                    1e-5,
                    &format!("{kind:?}, {n} columns"),
                );
            }
        }
    }

    #[test]
    fn the_bias_gelu_is_libtorchs_exact_gelu_of_the_sum() {
        tch::manual_seed(32);
        for kind in [Kind::Float, Kind::BFloat16] {
            let y = (Tensor::randn([4, 7, 53], (Kind::Float, Device::Cpu)) * 3.0).to_kind(kind);
            let b = Tensor::randn([53], (Kind::Float, Device::Cpu));
            let want = (y.to_kind(Kind::Float) + &b).gelu("none");
            let got = y.copy();
            bias_gelu_(&got, &floats(&b));
            // fp32: erf to 1.5e-7 absolute; bf16: the output's rounding.
            let relative = if kind == Kind::Float {
                1e-6
            } else {
                2f64.powi(-8)
            };
            assert_close(&got, &want, relative, 1e-6, &format!("{kind:?}"));
        }
    }

    #[test]
    fn the_avx512_gelu_matches_the_portable_one() {
        if !has_avx512() {
            return;
        }
        tch::manual_seed(33);
        // Wide values, and the edges: zeros, tiny and huge inputs, and infinity.
        let mut xs = Vec::<f32>::try_from(Tensor::randn([1000], (Kind::Float, Device::Cpu)) * 4.0)
            .expect("values");
        xs.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            20.0,
            -20.0,
            1e30,
            -1e30,
            f32::INFINITY,
        ]);
        let bias = vec![0.0; xs.len()];
        let (mut a, mut b) = (xs.clone(), xs.clone());
        // SAFETY: AVX-512 F, BW and VL are available (checked above).
        unsafe { x86::gelu_row(&mut a, &bias) };
        gelu_f32(&mut b, &bias);
        for ((x, a), b) in xs.iter().zip(&a).zip(&b) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0) || a == b,
                "gelu({x}): {a} against {b}"
            );
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let (_vs, norm) = norm(8);
        let y = Tensor::zeros([2, 8], (Kind::Float, Device::Cpu));
        let r = Tensor::zeros([2, 7], (Kind::Float, Device::Cpu));
        let refused =
            std::panic::catch_unwind(|| bias_residual_norm(&y, &[0.0; 8], &r, &norm, 1e-5));
        assert!(refused.is_err());
    }
}
