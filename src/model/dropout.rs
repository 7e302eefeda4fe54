//! Dropout with its mask drawn by lakeml's own pass on the CPU.
//!
//! libtorch's CPU dropout draws its mask with `bernoulli_`, a serial loop over a Mersenne
//! Twister (one thread, while the rest of the OpenMP team waits), then divides it by the keep
//! probability in a second pass: about 6% of a bf16 training step here, more in wall time.
//! Here the mask comes from a counter-based hash, in one vectorized pass on libtorch's
//! threads: element `i` is dropped when `hash(seed, i)` falls under `p` of the 32-bit range.
//! The seed is drawn from libtorch's generator, so masks depend on `tch::manual_seed` as
//! before (a resumed run draws the same masks), and the mask is applied as libtorch does: `x *
//! mask`, the mask holding 0 or `1 / (1 - p)` in `x`'s dtype, so the gradient is `grad *
//! mask`. On other devices libtorch's own (fused) dropout runs.

use tch::{Device, Kind, Tensor};

use crate::cpu::{Shared, bf16_bits, parallel, vectorized};

/// Dropout with probability `p` when training, the identity otherwise.
pub(crate) fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p <= 0.0 {
        return x.shallow_clone();
    }
    if x.device() != Device::Cpu || !matches!(x.kind(), Kind::Float | Kind::BFloat16) || p >= 1.0 {
        return x.dropout(p, true);
    }
    x * mask(x, p, draw_seed())
}

/// A 64-bit seed from libtorch's CPU generator (so `tch::manual_seed` fixes it).
fn draw_seed() -> u64 {
    let halves = Tensor::randint(1 << 32, [2], (Kind::Int64, Device::Cpu));
    let [lo, hi] = [0, 1].map(|i| halves.int64_value(&[i]) as u64);
    lo | hi << 32
}

/// A tensor shaped and typed as `x` (fp32 or bf16, on the CPU) of 0 (dropped, probability
/// `p`) and `1 / (1 - p)` (kept), from `seed`.
fn mask(x: &Tensor, p: f64, seed: u64) -> Tensor {
    let out = Tensor::empty(x.size(), (x.kind(), Device::Cpu));
    let n = out.numel();
    // Dropped when the hash is below `threshold`: p of the 2^32 values.
    let threshold = (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
    let keys = Keys {
        k0: seed as u32,
        k1: (seed >> 32) as u32,
        threshold,
    };
    // As libtorch's `noise.div_(1 - p)`: the scale rounded to the mask's dtype.
    let scale = (1.0 / (1.0 - p)) as f32;
    const CHUNK: usize = 1 << 14;
    let base = out.data_ptr();
    let bf16 = x.kind() == Kind::BFloat16;
    let (w32, w16) = (Shared(base as *mut f32), Shared(base as *mut u16));
    parallel(n.div_ceil(CHUNK), &|chunks| {
        for chunk in chunks {
            let (at, len) = (chunk * CHUNK, CHUNK.min(n - chunk * CHUNK));
            // SAFETY: `out` was just allocated, contiguous, with n elements of its kind, and
            // nothing else refers to it yet; each chunk writes only its own elements.
            unsafe {
                if bf16 {
                    let out = std::slice::from_raw_parts_mut(w16.at(at), len);
                    mask_bf16(at as u64, out, &keys, bf16_bits(scale));
                } else {
                    let out = std::slice::from_raw_parts_mut(w32.at(at), len);
                    mask_f32(at as u64, out, &keys, scale);
                }
            }
        }
    });
    out
}

struct Keys {
    k0: u32,
    k1: u32,
    threshold: u32,
}

/// Chris Wellons' `lowbias32` integer hash: 32-bit multiplies and shifts only, so that it
/// vectorizes.
#[inline(always)]
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// Whether element `i` is kept: two rounds of the hash, keyed by both halves of the seed.
#[inline(always)]
fn kept(i: u64, k: &Keys) -> bool {
    let h = lowbias32(lowbias32(i as u32 ^ k.k0) ^ (i >> 32) as u32 ^ k.k1);
    h >= k.threshold
}

#[inline(always)]
fn mask_f32_body(start: u64, out: &mut [f32], k: &Keys, scale: f32) {
    for (i, o) in (start..).zip(out.iter_mut()) {
        *o = if kept(i, k) { scale } else { 0.0 };
    }
}

#[inline(always)]
fn mask_bf16_body(start: u64, out: &mut [u16], k: &Keys, scale: u16) {
    for (i, o) in (start..).zip(out.iter_mut()) {
        *o = if kept(i, k) { scale } else { 0 };
    }
}

vectorized! {
    /// Mask elements `start..start + out.len()` in fp32.
    fn mask_f32(start: u64, out: &mut [f32], k: &Keys, scale: f32) = mask_f32_body;
}

vectorized! {
    /// Mask elements `start..start + out.len()` in bf16 (`scale` as bf16 bits).
    fn mask_bf16(start: u64, out: &mut [u16], k: &Keys, scale: u16) = mask_bf16_body;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).expect("values")
    }

    #[test]
    fn drops_p_of_the_elements_and_scales_the_rest() {
        let n = 1 << 20;
        for kind in [Kind::Float, Kind::BFloat16] {
            for p in [0.1, 0.5] {
                let m = values(&mask(&Tensor::ones([n], (kind, Device::Cpu)), p, 42));
                let scale = Tensor::from_slice(&[(1.0 / (1.0 - p)) as f32]).to_kind(kind);
                let scale = values(&scale)[0];
                assert!(
                    m.iter().all(|&v| v == 0.0 || v == scale),
                    "{kind:?}: 0 or {scale}"
                );
                let dropped = m.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
                // The binomial standard deviation is at most 0.0005 here; allow 5 of them.
                assert!(
                    (dropped - p).abs() < 0.0025,
                    "{kind:?} p={p}: dropped {dropped}"
                );
            }
        }
    }

    #[test]
    fn neighbours_and_seeds_are_independent() {
        let n = 1 << 20;
        let p = 0.3;
        let x = Tensor::ones([n], (Kind::Float, Device::Cpu));
        let a: Vec<bool> = values(&mask(&x, p, 7)).iter().map(|&v| v == 0.0).collect();
        let b: Vec<bool> = values(&mask(&x, p, 8)).iter().map(|&v| v == 0.0).collect();
        let both = |pairs: &mut dyn Iterator<Item = (bool, bool)>| {
            pairs.filter(|&(x, y)| x && y).count() as f64 / n as f64
        };
        // Dropped together: p² for independent draws (0.09), within 5 standard deviations.
        for (what, rate) in [
            (
                "neighbours",
                both(&mut a.iter().copied().zip(a.iter().copied().skip(1))),
            ),
            (
                "two seeds",
                both(&mut a.iter().copied().zip(b.iter().copied())),
            ),
        ] {
            assert!((rate - p * p).abs() < 0.0015, "{what}: {rate}");
        }
        assert_eq!(
            a,
            values(&mask(&x, p, 7))
                .iter()
                .map(|&v| v == 0.0)
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_seed_follows_torch_manual_seed_and_eval_is_the_identity() {
        let x = Tensor::randn([64, 33], (Kind::Float, Device::Cpu));
        tch::manual_seed(3);
        let a = dropout(&x, 0.1, true);
        tch::manual_seed(3);
        let b = dropout(&x, 0.1, true);
        assert!(a.equal(&b), "same seed, same mask");
        assert!(!a.equal(&dropout(&x, 0.1, true)), "the next draw differs");
        assert!(dropout(&x, 0.1, false).equal(&x));
        assert!(dropout(&x, 0.0, true).equal(&x));
    }

    #[test]
    fn the_gradient_is_the_mask() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let x = Tensor::randn([40, 17], (Kind::Float, Device::Cpu))
                .to_kind(kind)
                .set_requires_grad(true);
            tch::manual_seed(9);
            let y = dropout(&x, 0.25, true);
            y.sum(Kind::Float).backward();
            // Where kept, y = x * scale, and the gradient is the scale; where dropped, both 0.
            let (y, x, g) = (values(&y), values(&x), values(&x.grad()));
            let scale = values(&Tensor::from_slice(&[1.0f32 / 0.75]).to_kind(kind))[0];
            for ((y, x), g) in y.iter().zip(&x).zip(&g) {
                if *g == 0.0 {
                    assert_eq!(*y, 0.0);
                } else {
                    assert_eq!(*g, scale, "{kind:?}");
                    let want =
                        values(&(Tensor::from_slice(&[*x]).to_kind(kind) * f64::from(scale)));
                    assert_eq!(*y, want[0], "{kind:?}");
                }
            }
        }
    }
}
