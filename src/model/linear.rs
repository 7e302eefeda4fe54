//! A linear layer with optional int8 and bf16 inference paths for fp32 models.
//!
//! [`Linear::quantize`] stores the weight as int8 with one scale per output channel
//! (symmetric, round to nearest). Each call then quantizes its input per token (one scale
//! per row, from that row's largest magnitude), multiplies int8 × int8 → int32 with
//! libtorch's `_int_mm` (oneDNN, VNNI on x86), and rescales the int32 sums to fp32 with both
//! scales before adding the fp32 bias. No calibration data is needed: every scale comes from
//! the weights or from the row being multiplied.
//!
//! [`Linear::use_bf16`] keeps a bf16 copy of the weight and runs the product in bf16, fp32
//! in and out: for the layers whose inputs per-token int8 cannot represent (a feed-forward
//! down-projection, whose GELU outputs have a few channels far larger than the rest).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// The largest int8 magnitude a scale maps to (symmetric: -127..=127, -128 unused).
const Q_MAX: f64 = 127.0;

/// `nn::Linear` (its variables stay in the VarStore, trained and saved as usual), with an
/// int8 or bf16 path for inference once [`Linear::quantize`] or [`Linear::use_bf16`] has
/// run.
#[derive(Debug)]
pub(crate) struct Linear {
    inner: nn::Linear,
    fast: Option<Fast>,
}

#[derive(Debug)]
enum Fast {
    Int8(Int8Weight),
    /// `[out, in]` bf16.
    Bf16(Tensor),
}

#[derive(Debug)]
struct Int8Weight {
    /// `[in, out]` int8: the transpose of a contiguous `[out, in]` tensor, the layout
    /// oneDNN's int8 GEMM runs fastest on here.
    wt: Tensor,
    /// `[out]` fp32: one scale per output channel.
    scale: Tensor,
}

impl Linear {
    pub(crate) fn new(inner: nn::Linear) -> Self {
        Self { inner, fast: None }
    }

    /// From now on, products run in int8 (see the module docs). The fp32 weight stays in the
    /// VarStore; call this after the weights are loaded.
    pub(crate) fn quantize(&mut self) {
        let w = self.inner.ws.detach().to_kind(Kind::Float);
        let scale = w
            .abs()
            .amax([1].as_slice(), false)
            .clamp_min(f64::from(f32::MIN_POSITIVE))
            / Q_MAX;
        let q = (w / scale.unsqueeze(1)).round().to_kind(Kind::Int8);
        self.fast = Some(Fast::Int8(Int8Weight { wt: q.tr(), scale }));
    }

    /// From now on, products run in bf16 with fp32 inputs, outputs and bias.
    pub(crate) fn use_bf16(&mut self) {
        let w = self.inner.ws.detach().to_kind(Kind::BFloat16);
        self.fast = Some(Fast::Bf16(w));
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let q = match &self.fast {
            None => return self.inner.forward(xs),
            Some(Fast::Bf16(w)) => {
                let mut y = xs
                    .to_kind(Kind::BFloat16)
                    .linear::<&Tensor>(w, None)
                    .to_kind(Kind::Float);
                if let Some(b) = &self.inner.bs {
                    let _ = y.g_add_(b);
                }
                return y;
            }
            Some(Fast::Int8(q)) => q,
        };
        let mut shape = xs.size();
        let k = shape.last().copied().unwrap_or(1);
        let x = xs.reshape([-1, k]).to_kind(Kind::Float);
        let (xq, x_scale) = quantize_rows(&x);
        // Two passes over the `[m, n]` sums (memory-bound, as long as the product itself for
        // a feed-forward layer): int32 × channel scales → fp32, then bias + that × token
        // scales, in place.
        let mut y = xq.internal_int_mm(&q.wt).g_mul(&q.scale);
        match &self.inner.bs {
            Some(b) => {
                let _ = b.addcmul_out(&y, &y, &x_scale);
            }
            None => {
                let _ = y.g_mul_(&x_scale);
            }
        }
        if let Some(last) = shape.last_mut() {
            *last = q.scale.size()[0];
        }
        y.reshape(shape)
    }
}

/// Symmetric per-row int8: `x ≈ q * scale` with `q` `[m, k]` int8, `scale` `[m, 1]` fp32.
fn quantize_rows(x: &Tensor) -> (Tensor, Tensor) {
    let scale = x
        .abs()
        .amax([1].as_slice(), true)
        .clamp_min(f64::from(f32::MIN_POSITIVE))
        / Q_MAX;
    let mut q = x / &scale;
    let _ = q.round_();
    (q.to_kind(Kind::Int8), scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn layer(input: i64, output: i64) -> (nn::VarStore, Linear) {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let inner = nn::linear(vs.root() / "l", input, output, Default::default());
        (vs, Linear::new(inner))
    }

    /// The output of a seeded `[input -> output]` layer on Gaussian `[batch, rows, input]`
    /// inputs after `switch`, and its relative error (Frobenius) against the fp32 output.
    fn switched(shape: [i64; 3], output: i64, switch: impl FnOnce(&mut Linear)) -> (Tensor, f64) {
        let (_vs, mut l) = layer(shape[2], output);
        let x = Tensor::randn(shape, (Kind::Float, Device::Cpu));
        let exact = tch::no_grad(|| l.forward(&x));
        switch(&mut l);
        let approx = tch::no_grad(|| l.forward(&x));
        let rel = f64::try_from((&approx - &exact).norm() / exact.norm()).expect("scalar");
        (approx, rel)
    }

    #[test]
    fn int8_products_stay_within_the_quantization_error_of_fp32() {
        let (approx, rel) = switched([3, 17, 384], 1536, Linear::quantize);
        assert_eq!(approx.size(), [3, 17, 1536]);
        assert_eq!(approx.kind(), Kind::Float);
        // Relative error of the whole product: int8 with per-channel and per-token scales
        // keeps it near 1% for Gaussian inputs; 2% leaves room, and anything broken
        // (a wrong scale axis, a missing bias, a transposed weight) is far above it.
        assert!(rel < 0.02, "relative error {rel}");
        assert!(rel > 0.0, "the int8 path was not taken");
    }

    #[test]
    fn bf16_products_stay_within_bf16_rounding_of_fp32() {
        let (approx, rel) = switched([2, 9, 1536], 384, Linear::use_bf16);
        assert_eq!(approx.size(), [2, 9, 384]);
        assert_eq!(approx.kind(), Kind::Float);
        // bf16 keeps 8 significant bits of each input: about 0.4% relative error.
        assert!(rel < 0.01 && rel > 0.0, "relative error {rel}");
    }

    #[test]
    fn a_row_of_zeros_and_a_single_row_are_fine() {
        let (_vs, mut l) = layer(8, 4);
        l.quantize();
        let x = Tensor::cat(
            &[
                Tensor::zeros([1, 8], (Kind::Float, Device::Cpu)),
                Tensor::ones([1, 8], (Kind::Float, Device::Cpu)),
            ],
            0,
        );
        let y = tch::no_grad(|| l.forward(&x));
        let bias = l.inner.bs.as_ref().expect("bias").detach();
        // A zero row gives exactly the bias (its scale is clamped, not 0/0).
        assert_eq!(
            f64::try_from((y.get(0) - &bias).abs().max()).expect("scalar"),
            0.0
        );
        let one = tch::no_grad(|| l.forward(&x.get(1)));
        assert_eq!(one.size(), [4]);
        assert!(one.allclose(&y.get(1), 0.0, 0.0, false));
    }
}
