//! A linear layer with optional int8 and bf16 inference paths for fp32 models.
//!
//! [`Linear::quantize`] stores the weight as int8 with one scale per output channel
//! (symmetric, round to nearest). Each call then quantizes its input per token (one scale
//! per row, from that row's largest magnitude), multiplies int8 × int8 → int32 with
//! libtorch's `_int_mm` (oneDNN, VNNI on x86), and rescales the int32 sums to fp32 with both
//! scales before adding the fp32 bias (those two passes are lakeml's own, see
//! [`super::int8`]). No calibration data is needed: every scale comes from the weights or
//! from the row being multiplied. [`Fused`] runs several int8 layers that read the same input
//! (a layer's query, key and value) as one product, over one quantized copy of the input.
//!
//! [`Linear::use_bf16`] keeps a bf16 copy of the weight and runs the product in bf16, fp32
//! in and out: for the layers whose inputs per-token int8 cannot represent (a feed-forward
//! down-projection, whose GELU outputs have a few channels far larger than the rest).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use super::int8::{self, Q_MAX};

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

/// An int8 weight with its scales and fp32 bias, on the CPU.
#[derive(Debug)]
struct Int8Weight {
    /// `[in, out]` int8: the transpose of a contiguous `[out, in]` tensor, the layout
    /// oneDNN's int8 GEMM runs fastest on here.
    wt: Tensor,
    /// One scale per output channel.
    scale: Vec<f32>,
    /// One per output channel (zeros for a layer without bias).
    bias: Vec<f32>,
}

impl Int8Weight {
    /// From an `[out, in]` weight and its `out` bias values.
    fn new(w: &Tensor, bias: Vec<f32>) -> Self {
        let w = w.detach().to_kind(Kind::Float).to_device(Device::Cpu);
        let scale = w
            .abs()
            .amax([1].as_slice(), false)
            .clamp_min(f64::from(f32::MIN_POSITIVE))
            / f64::from(Q_MAX);
        let q = (w / scale.unsqueeze(1)).round().to_kind(Kind::Int8);
        Self {
            wt: q.tr(),
            scale: floats(&scale),
            bias,
        }
    }

    /// `x` `[..., in]` (fp32) times the weight, plus the bias (and `residual`, shaped as the
    /// output, if any): `[..., out]` fp32.
    fn forward(&self, xs: &Tensor, residual: Option<&Tensor>) -> Tensor {
        let (rows, sums, shape) = self.sums(xs);
        let residual = residual.map(|r| r.reshape([-1, self.width()]));
        int8::rescale(
            sums,
            &rows.scale,
            &self.scale,
            &self.bias,
            residual.as_ref(),
        )
        .reshape(shape)
    }

    /// The quantized `[m, in]` input, the int32 sums `[m, out]`, and the output's shape.
    fn sums(&self, xs: &Tensor) -> (int8::Rows, Tensor, Vec<i64>) {
        let mut shape = xs.size();
        let k = shape.last().copied().unwrap_or(1);
        let rows = int8::quantize_rows(&xs.reshape([-1, k]));
        let sums = rows.q.internal_int_mm(&self.wt);
        if let Some(last) = shape.last_mut() {
            *last = self.width();
        }
        (rows, sums, shape)
    }

    fn width(&self) -> i64 {
        self.scale.len() as i64
    }
}

/// A layer's bias values, zeros for a layer without one.
pub(crate) fn bias_values(l: &nn::Linear) -> Vec<f32> {
    match &l.bs {
        Some(b) => floats(b),
        None => vec![0.0; l.ws.size()[0] as usize],
    }
}

/// The values of a small fp32 tensor.
pub(crate) fn floats(t: &Tensor) -> Vec<f32> {
    let t = t
        .detach()
        .to_kind(Kind::Float)
        .to_device(Device::Cpu)
        .flatten(0, -1);
    Vec::<f32>::try_from(&t).unwrap_or_else(|e| panic!("reading a weight's values: {e}"))
}

impl Linear {
    pub(crate) fn new(inner: nn::Linear) -> Self {
        Self { inner, fast: None }
    }

    /// From now on, products run in int8 on the CPU (see the module docs). The fp32 weight
    /// stays in the VarStore; call this after the weights are loaded.
    pub(crate) fn quantize(&mut self) {
        self.fast = Some(Fast::Int8(Int8Weight::new(
            &self.inner.ws,
            bias_values(&self.inner),
        )));
    }

    /// `self.forward(xs) + residual` (shaped as the output); in int8, the residual is added
    /// in the same pass as the bias.
    pub(crate) fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Tensor {
        match &self.fast {
            Some(Fast::Int8(q)) => q.forward(xs, Some(residual)),
            _ => self.forward(xs) + residual,
        }
    }

    /// The layer as a plain `nn::Linear` (the VarStore's weight and bias), unless its
    /// products run in int8 or bf16.
    pub(crate) fn plain(&self) -> Option<&nn::Linear> {
        self.fast.is_none().then_some(&self.inner)
    }

    /// From now on, products run in bf16 with fp32 inputs, outputs and bias.
    pub(crate) fn use_bf16(&mut self) {
        let w = self.inner.ws.detach().to_kind(Kind::BFloat16);
        self.fast = Some(Fast::Bf16(w));
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        match &self.fast {
            None => self.inner.forward(xs),
            Some(Fast::Int8(q)) => q.forward(xs, None),
            Some(Fast::Bf16(w)) => {
                let mut y = xs
                    .to_kind(Kind::BFloat16)
                    .linear::<&Tensor>(w, None)
                    .to_kind(Kind::Float);
                if let Some(b) = &self.inner.bs {
                    let _ = y.g_add_(b);
                }
                y
            }
        }
    }
}

/// Several linear layers over the same input as one int8 product: the input is quantized
/// once and multiplied by their weights side by side, which also makes the product wide
/// enough to run near the int8 peak (three `[hidden, hidden]` products are each too narrow).
#[derive(Debug)]
pub(crate) struct Fused<const N: usize> {
    weight: Int8Weight,
    /// Each layer's output width, in order.
    widths: [i64; N],
}

impl<const N: usize> Fused<N> {
    /// `layers` (their fp32 weights, whatever path they run) as one int8 product.
    pub(crate) fn int8(layers: [&Linear; N]) -> Self {
        let ws: Vec<&Tensor> = layers.iter().map(|l| &l.inner.ws).collect();
        let bias = layers.iter().flat_map(|l| bias_values(&l.inner)).collect();
        Self {
            weight: Int8Weight::new(&Tensor::cat(&ws, 0), bias),
            widths: layers.map(|l| l.inner.ws.size()[0]),
        }
    }

    /// Each layer's output for `xs` `[..., in]`, in order (views of one product).
    pub(crate) fn forward(&self, xs: &Tensor) -> [Tensor; N] {
        let y = self.weight.forward(xs, None);
        let mut start = 0;
        self.widths.map(|width| {
            let part = y.narrow(-1, start, width);
            start += width;
            part
        })
    }
}

/// A feed-forward block with exact GELU between its products, for int8 inference: the
/// up-projection in int8 with the GELU fused into its rescaling, which writes bf16 (see
/// [`int8::rescale_gelu_bf16`]); the down-projection in bf16 (see [`Linear::use_bf16`]), its
/// bias and the block's residual added in one pass as it turns fp32.
#[derive(Debug)]
pub(crate) struct FeedForward {
    up: Int8Weight,
    /// `[out, in]` bf16.
    down: Tensor,
    down_bias: Vec<f32>,
}

impl FeedForward {
    /// Switches a feed-forward block with activation `act` to int8 inference: fused into a
    /// `FeedForward` for exact GELU (returned), else `up` in int8 and `down` in bf16 (see the
    /// module docs), run one by one.
    pub(crate) fn quantize(act: &str, up: &mut Linear, down: &mut Linear) -> Option<Self> {
        if act == "gelu" {
            return Some(Self::int8_gelu(up, down));
        }
        up.quantize();
        down.use_bf16();
        None
    }

    /// `up` and `down` (their fp32 weights), with GELU between them.
    fn int8_gelu(up: &Linear, down: &Linear) -> Self {
        Self {
            up: Int8Weight::new(&up.inner.ws, bias_values(&up.inner)),
            down: down.inner.ws.detach().to_kind(Kind::BFloat16),
            down_bias: bias_values(&down.inner),
        }
    }

    /// `down(gelu(up(xs))) + residual`, `[..., out]` fp32 (`residual` shaped so too).
    pub(crate) fn forward(&self, xs: &Tensor, residual: &Tensor) -> Tensor {
        let (rows, sums, _) = self.up.sums(xs);
        let inner = int8::rescale_gelu_bf16(&sums, &rows.scale, &self.up.scale, &self.up.bias);
        let y = inner.linear::<&Tensor>(&self.down, None);
        let shape = residual.size();
        int8::add_bias_residual(
            &y,
            &self.down_bias,
            &residual.reshape([-1, self.down.size()[0]]),
        )
        .reshape(shape)
    }
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
    fn fused_layers_give_each_layers_own_int8_output() {
        tch::manual_seed(8);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut layers: Vec<Linear> = (0..3)
            .map(|i| {
                Linear::new(nn::linear(
                    vs.root() / i,
                    64,
                    48 + 16 * i,
                    Default::default(),
                ))
            })
            .collect();
        let fused = Fused::int8([&layers[0], &layers[1], &layers[2]]);
        let x = Tensor::randn([2, 5, 64], (Kind::Float, Device::Cpu));
        let parts = tch::no_grad(|| fused.forward(&x));
        for (layer, part) in layers.iter_mut().zip(&parts) {
            layer.quantize();
            let own = tch::no_grad(|| layer.forward(&x));
            assert_eq!(part.size(), own.size());
            // Same per-channel scales and the same quantized input: the same int32 sums.
            assert!(part.allclose(&own, 0.0, 0.0, false));
        }
    }

    #[test]
    fn adding_the_residual_in_the_int8_pass_is_adding_it_after() {
        let (_vs, mut l) = layer(32, 24);
        l.quantize();
        let x = Tensor::randn([3, 4, 32], (Kind::Float, Device::Cpu));
        let r = Tensor::randn([3, 4, 24], (Kind::Float, Device::Cpu));
        let (fused, after) = tch::no_grad(|| (l.forward_add(&x, &r), l.forward(&x) + &r));
        assert!(fused.allclose(&after, 1e-6, 1e-6, false));
    }

    #[test]
    fn the_int8_feed_forward_block_stays_within_the_quantization_error_of_fp32() {
        tch::manual_seed(9);
        let vs = nn::VarStore::new(Device::Cpu);
        let up = Linear::new(nn::linear(vs.root() / "up", 384, 1536, Default::default()));
        let down = Linear::new(nn::linear(
            vs.root() / "down",
            1536,
            384,
            Default::default(),
        ));
        let x = Tensor::randn([2, 9, 384], (Kind::Float, Device::Cpu));
        let residual = Tensor::randn([2, 9, 384], (Kind::Float, Device::Cpu));
        let exact = tch::no_grad(|| down.forward(&up.forward(&x).gelu("none")) + &residual);
        let block = FeedForward::int8_gelu(&up, &down);
        let approx = tch::no_grad(|| block.forward(&x, &residual));
        assert_eq!(
            (approx.size(), approx.kind()),
            (vec![2, 9, 384], Kind::Float)
        );
        let rel =
            f64::try_from((&approx - &exact).norm() / (&exact - &residual).norm()).expect("scalar");
        // int8 up-projection (about 1%) and bf16 activations and down-projection (0.4%).
        assert!(rel < 0.02 && rel > 0.0, "relative error {rel}");
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
