//! Inference attention over short sequences in one pass per sequence, on CPUs with AVX-512.
//!
//! As tensor ops, a short sequence's attention is mostly overhead: its queries, keys and
//! values are copied out of the `[batch, seq, heads × dim]` projections into per-head
//! batches for `bmm`, its ~30-key score rows are too short for libtorch's softmax loop, and
//! the context is copied back into `[batch, seq, hidden]` for the output projection. Here
//! each task takes one sequence straight from the projections, reading its rows whole: it
//! loads the keys (transposed) and values of every head into fp32 scratch that stays in
//! cache, then for each head computes the queries' scaled, masked scores, their softmax and
//! the weighted sums of values in fp32, and writes that head's columns of the context rows,
//! in the model's dtype. Tasks run on libtorch's OpenMP team. For inference: nothing tracks
//! gradients.

use tch::{Device, Kind, Tensor};

use crate::cpu::{Shared, bf16_bits, bf16_value, exp_neg, parallel};

/// Vector width (16 fp32 lanes: one AVX-512 register).
const LANES: usize = 16;

/// Queries computed together, so that their independent sums keep the vector units busy
/// where one query's sums would wait on each other.
const QUERY_BLOCK: usize = 4;

/// Keys per block of a score row, and channels per block of a context row: two vectors.
/// [`QUERY_BLOCK`] queries' blocks are 8 vector accumulators, which stay in registers.
const BLOCK: usize = 2 * LANES;

/// Score padding past the last key: far below any score, so that its exponential is 0.
const PAD: f32 = -1e30;

/// Whether this CPU runs [`attention`] (AVX-512).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An element of the projections and the context: fp32, or bf16 as its bits.
trait Element: Copy {
    fn value(self) -> f32;
    fn from_value(x: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_value(x: f32) -> Self {
        x
    }
}

impl Element for u16 {
    #[inline(always)]
    fn value(self) -> f32 {
        bf16_value(self)
    }
    #[inline(always)]
    fn from_value(x: f32) -> Self {
        bf16_bits(x)
    }
}

/// Multi-head attention of `q` `[batch, queries, hidden]` over `k` and `v`
/// `[batch, keys, hidden]` (fp32 or bf16, all one kind, on the CPU; each row contiguous, rows
/// at any stride, such as column ranges of one fused projection), with the additive mask
/// `bias` (`[batch, 1, 1, keys]`, see [`super::attention_bias`]) and scores scaled by
/// `scale`: the context `[batch, queries, hidden]`, contiguous, in the inputs' kind.
/// Only where [`available`].
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    heads: usize,
    scale: f32,
) -> Tensor {
    assert!(available(), "short attention needs AVX-512");
    let kind = q.kind();
    let rows = |x: &Tensor| match x.stride().last() {
        Some(1) => x.shallow_clone(),
        _ => x.contiguous(),
    };
    let (q, k, v) = (rows(q), rows(k), rows(v));
    let (qs, ks) = (q.size(), k.size());
    assert!(
        qs.len() == 3
            && ks.len() == 3
            && v.size() == ks
            && qs[0] == ks[0]
            && qs[2] == ks[2]
            && qs[1] > 0
            && ks[1] > 0
            && [&k, &v].iter().all(|x| x.kind() == kind)
            && [&q, &k, &v].iter().all(|x| x.device() == Device::Cpu)
            && matches!(kind, Kind::Float | Kind::BFloat16)
            && (ks[2] as usize).is_multiple_of(heads),
        "short attention wants fp32 or bf16 CPU projections of one kind, got {qs:?} {kind:?}, \
         {ks:?} {:?}, {:?} {:?}",
        k.kind(),
        v.size(),
        v.kind()
    );
    let (batch, queries, keys, hidden) = (
        qs[0] as usize,
        qs[1] as usize,
        ks[1] as usize,
        qs[2] as usize,
    );
    let bias =
        Vec::<f32>::try_from(bias.to_kind(Kind::Float).reshape([-1])).expect("an fp32 CPU bias");
    assert_eq!(bias.len(), batch * keys, "the mask does not fit the keys");
    let shape = Shape {
        batch,
        queries,
        keys,
        hidden,
        dim: hidden / heads,
        heads,
        q: strides(&q),
        k: strides(&k),
        v: strides(&v),
        scale,
    };
    let ctx = Tensor::empty(
        [batch as i64, queries as i64, hidden as i64],
        (kind, Device::Cpu),
    );
    if kind == Kind::BFloat16 {
        run::<u16>(&shape, [&q, &k, &v], &bias, &ctx);
    } else {
        run::<f32>(&shape, [&q, &k, &v], &bias, &ctx);
    }
    ctx
}

/// The (batch, row) strides of a `[batch, rows, hidden]` tensor, in elements.
fn strides(x: &Tensor) -> [usize; 2] {
    let s = x.stride();
    [s[0] as usize, s[1] as usize]
}

/// Sizes and strides of one [`attention`] call.
struct Shape {
    batch: usize,
    queries: usize,
    keys: usize,
    hidden: usize,
    /// Channels per head.
    dim: usize,
    heads: usize,
    q: [usize; 2],
    k: [usize; 2],
    v: [usize; 2],
    scale: f32,
}

impl Shape {
    /// Key counts rounded up to whole blocks: the length of a score row.
    fn padded_keys(&self) -> usize {
        self.keys.div_ceil(BLOCK) * BLOCK
    }

    /// Channel counts rounded up to whole blocks: the length of a value row.
    fn padded_dim(&self) -> usize {
        self.dim.div_ceil(BLOCK) * BLOCK
    }
}

/// One sequence: its queries, keys and values (each a run of rows of which the first
/// `hidden` elements are the sequence's), and its mask.
struct Sequence<'a, E> {
    q: &'a [E],
    k: &'a [E],
    v: &'a [E],
    bias: &'a [f32],
}

/// A thread's fp32 working memory, zero past the real keys and channels: one sequence's
/// keys, transposed head by head (`dim` rows of [`Shape::padded_keys`] per head), its values
/// head by head (`keys` rows of [`Shape::padded_dim`] per head), its mask padded with
/// [`PAD`], and for a block of queries, their rows and score rows.
struct Scratch {
    keys_t: Vec<f32>,
    values: Vec<f32>,
    bias: Vec<f32>,
    queries: Vec<f32>,
    scores: Vec<f32>,
}

impl Scratch {
    fn new(shape: &Shape) -> Self {
        let (kp, dp) = (shape.padded_keys(), shape.padded_dim());
        Self {
            keys_t: vec![0.0; shape.heads * shape.dim * kp],
            values: vec![0.0; shape.heads * shape.keys * dp],
            bias: vec![0.0; kp],
            queries: vec![0.0; QUERY_BLOCK * shape.dim],
            scores: vec![0.0; QUERY_BLOCK * kp],
        }
    }
}

/// One task per sequence: it reads the sequence's rows whole (in order, which the
/// hardware prefetches well) and writes its context rows, which no other task touches.
fn run<E: Element>(shape: &Shape, [q, k, v]: [&Tensor; 3], bias: &[f32], ctx: &Tensor) {
    let Shape {
        batch,
        queries,
        keys,
        hidden,
        ..
    } = *shape;
    // The elements a sequence's rows span, from its first.
    let span = |[_, row]: [usize; 2], rows: usize| (rows - 1) * row + hidden;
    let base = |x: &Tensor| Shared(x.data_ptr() as *mut E);
    let (q_base, k_base, v_base, out) = (base(q), base(k), base(v), base(ctx));
    parallel(batch, &|tasks| {
        let mut scratch = Scratch::new(shape);
        for b in tasks {
            // SAFETY: each slice starts at sequence b's first element and spans its rows,
            // inside the tensor (its sizes and strides were checked above); the inputs are
            // only read.
            let part = |base: Shared<E>, s: [usize; 2], n: usize| unsafe {
                std::slice::from_raw_parts(base.at(b * s[0]) as *const E, span(s, n))
            };
            let sequence = Sequence {
                q: part(q_base, shape.q, queries),
                k: part(k_base, shape.k, keys),
                v: part(v_base, shape.v, keys),
                bias: &bias[b * keys..(b + 1) * keys],
            };
            // SAFETY: `ctx` is a contiguous [batch, queries, hidden] tensor, of which only
            // this task writes sequence b's rows.
            let out = unsafe {
                std::slice::from_raw_parts_mut(out.at(b * queries * hidden), queries * hidden)
            };
            load(shape, &sequence, &mut scratch);
            for h in 0..shape.heads {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `attention` checked that the CPU has AVX-512.
                unsafe {
                    x86::head(shape, h, &sequence, &mut scratch, out)
                };
            }
        }
    });
}

/// Loads a sequence's keys (transposed, head by head), values and mask into `s`, zero or
/// [`PAD`] past the real keys and channels.
#[inline(always)]
fn load<E: Element>(shape: &Shape, seq: &Sequence<E>, s: &mut Scratch) {
    let Shape {
        keys, dim, heads, ..
    } = *shape;
    let (kp, dp) = (shape.padded_keys(), shape.padded_dim());
    for j in 0..keys {
        let k = &seq.k[j * shape.k[1]..][..heads * dim];
        for (c, &x) in k.iter().enumerate() {
            s.keys_t[c * kp + j] = x.value();
        }
        let v = &seq.v[j * shape.v[1]..][..heads * dim];
        for (h, v) in v.chunks_exact(dim).enumerate() {
            let row = &mut s.values[(h * keys + j) * dp..][..dp];
            for (y, &x) in row.iter_mut().zip(v) {
                *y = x.value();
            }
            row[dim..].fill(0.0);
        }
    }
    if keys < kp {
        for row in s.keys_t.chunks_exact_mut(kp) {
            row[keys..].fill(0.0);
        }
    }
    s.bias[..keys].copy_from_slice(seq.bias);
    s.bias[keys..].fill(PAD);
}

/// Softmax of `x` (whose length is a multiple of [`LANES`]), in place.
#[inline(always)]
fn softmax(x: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_storeu_ps,
    };

    use super::{BLOCK, Element, LANES, QUERY_BLOCK, Scratch, Sequence, Shape, softmax};

    /// Head `h` of a sequence (loaded into `s`): its columns of the context rows `out`
    /// (`queries` rows of `hidden`). Queries go [`QUERY_BLOCK`] at a time; for each, a block
    /// of [`BLOCK`] scores, then a block of [`BLOCK`] context channels, is summed in
    /// registers.
    #[target_feature(enable = "avx512f")]
    pub(super) fn head<E: Element>(
        shape: &Shape,
        h: usize,
        seq: &Sequence<E>,
        s: &mut Scratch,
        out: &mut [E],
    ) {
        let Shape {
            queries,
            keys,
            hidden,
            dim,
            scale,
            ..
        } = *shape;
        let (kp, dp) = (shape.padded_keys(), shape.padded_dim());
        let q_row = shape.q[1];
        let keys_t = &s.keys_t[h * dim * kp..][..dim * kp];
        let values = &s.values[h * keys * dp..][..keys * dp];
        for first in (0..queries).step_by(QUERY_BLOCK) {
            // Past the last query, the block repeats it; those rows are not written.
            for (i, q) in s.queries.chunks_exact_mut(dim).enumerate() {
                let r = (first + i).min(queries - 1);
                for (y, &x) in q.iter_mut().zip(&seq.q[r * q_row + h * dim..][..dim]) {
                    *y = x.value() * scale;
                }
            }
            for block in (0..kp).step_by(BLOCK) {
                let acc = sums(&s.queries, dim, &keys_t[block..], kp, dim);
                for i in 0..QUERY_BLOCK {
                    let row = &mut s.scores[i * kp + block..][..BLOCK];
                    store(row, acc[2 * i], acc[2 * i + 1]);
                    for (x, &b) in row.iter_mut().zip(&s.bias[block..block + BLOCK]) {
                        *x += b;
                    }
                }
            }
            for row in s.scores.chunks_exact_mut(kp) {
                softmax(row);
            }
            for block in (0..dp).step_by(BLOCK) {
                let acc = sums(&s.scores, kp, &values[block..], dp, keys);
                let columns = h * dim + block..h * dim + dim.min(block + BLOCK);
                for i in 0..QUERY_BLOCK.min(queries - first) {
                    let mut ctx = [0f32; BLOCK];
                    store(&mut ctx, acc[2 * i], acc[2 * i + 1]);
                    let row = &mut out[(first + i) * hidden..][columns.clone()];
                    for (y, &x) in row.iter_mut().zip(&ctx) {
                        *y = E::from_value(x);
                    }
                }
            }
        }
    }

    /// For each of a block's [`QUERY_BLOCK`] queries `i`, the sum over `n < count` of
    /// `weights[i * stride + n]` times the first [`BLOCK`] elements of row `n` of `rows`
    /// (rows `row` apart), as two vectors each: a block of scores (weights: the queries'
    /// channels; rows: the transposed keys) or of context channels (weights: the
    /// probabilities; rows: the values).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sums(
        weights: &[f32],
        stride: usize,
        rows: &[f32],
        row: usize,
        count: usize,
    ) -> [__m512; 2 * QUERY_BLOCK] {
        let mut acc = [_mm512_setzero_ps(); 2 * QUERY_BLOCK];
        for n in 0..count {
            let r = &rows[n * row..][..BLOCK];
            // SAFETY: `r` holds BLOCK = 2 × LANES elements.
            let (r0, r1) = unsafe {
                (
                    _mm512_loadu_ps(r.as_ptr()),
                    _mm512_loadu_ps(r.as_ptr().add(LANES)),
                )
            };
            for i in 0..QUERY_BLOCK {
                let w = _mm512_set1_ps(weights[i * stride + n]);
                acc[2 * i] = _mm512_fmadd_ps(w, r0, acc[2 * i]);
                acc[2 * i + 1] = _mm512_fmadd_ps(w, r1, acc[2 * i + 1]);
            }
        }
        acc
    }

    /// Two vectors into the first [`BLOCK`] elements of `row`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store(row: &mut [f32], a: __m512, b: __m512) {
        let row = &mut row[..BLOCK];
        // SAFETY: `row` holds BLOCK = 2 × LANES elements.
        unsafe {
            _mm512_storeu_ps(row.as_mut_ptr(), a);
            _mm512_storeu_ps(row.as_mut_ptr().add(LANES), b);
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention_bias;

    /// libtorch's eager attention in fp32: `softmax(q kᵀ · scale + bias) v`, per head.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, heads: i64) -> Tensor {
        let split = |x: &Tensor| {
            let s = x.size();
            x.to_kind(Kind::Float)
                .reshape([s[0], s[1], heads, s[2] / heads])
                .transpose(1, 2)
        };
        let (qh, kh, vh) = (split(q), split(k), split(v));
        let d = qh.size()[3];
        let scores = qh.matmul(&kh.transpose(2, 3)) / (d as f64).sqrt() + bias.to_kind(Kind::Float);
        let ctx = scores.softmax(-1, Kind::Float).matmul(&vh).transpose(1, 2);
        let s = q.size();
        ctx.reshape([s[0], s[1], s[2]])
    }

    #[test]
    fn matches_libtorchs_attention_over_a_fused_projection() {
        tch::manual_seed(21);
        let batch = 3;
        // Heads of 16 channels (less than a block) and of 64 (two blocks).
        for ((heads, hidden), kind) in [(4, 64), (2, 128)]
            .into_iter()
            .flat_map(|shape| [(shape, Kind::Float), (shape, Kind::BFloat16)])
        {
            // Shorter than one vector, whole vectors, and a ragged length.
            for keys in [5, 32, 37] {
                // Query, key and value as column ranges of one [batch, keys, 3 × hidden]
                // product, as a fused projection gives them.
                let qkv = (Tensor::randn([batch, keys, 3 * hidden], (Kind::Float, Device::Cpu))
                    * 2.0)
                    .to_kind(kind);
                let [q, k, v] = [0, 1, 2].map(|i| qkv.narrow(2, i * hidden, hidden));
                // Sequence b keeps its first keys - 2b keys.
                let lengths = Tensor::from_slice(&[keys, keys - 2, keys - 4]);
                let mask = Tensor::arange(keys, (Kind::Int64, Device::Cpu))
                    .unsqueeze(0)
                    .lt_tensor(&lengths.unsqueeze(1));
                let bias = attention_bias(&mask, kind);
                let scale = 1.0 / ((hidden / heads) as f32).sqrt();
                let want = reference(&q, &k, &v, &bias, heads);
                // Every query, and the first alone (a classifier's last layer).
                for queries in [keys, 1] {
                    let q = q.narrow(1, 0, queries);
                    let got = attention(&q, &k, &v, &bias, heads as usize, scale);
                    assert_eq!(
                        (got.size(), got.kind(), got.is_contiguous()),
                        (vec![batch, queries, hidden], kind, true)
                    );
                    let want = want.narrow(1, 0, queries);
                    // Each element within a tolerance relative to its size: fp32, summation
                    // order; bf16, the inputs are the same bf16 values and the arithmetic is
                    // fp32, so only the output's rounding (half an ulp: 2^-9 relative).
                    let relative = if kind == Kind::Float {
                        1e-5
                    } else {
                        2f64.powi(-8)
                    };
                    let excess =
                        ((got.to_kind(Kind::Float) - &want).abs() - want.abs() * relative - 1e-6)
                            .max()
                            .double_value(&[]);
                    assert!(
                        excess <= 0.0,
                        "{kind:?}, {heads} heads of {hidden}, {keys} keys, {queries} queries: past the \
                         tolerance by {excess}"
                    );
                }
            }
        }
    }

    #[test]
    fn masked_keys_are_ignored() {
        tch::manual_seed(22);
        let (heads, hidden, keys) = (2, 16, 9);
        let [q, k, v] =
            [0, 1, 2].map(|_| Tensor::randn([1, keys, hidden], (Kind::Float, Device::Cpu)));
        let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0, 0]).unsqueeze(0);
        let bias = attention_bias(&mask, Kind::Float);
        let full = attention(&q, &k, &v, &bias, heads, 0.5);
        // Whatever the padded keys and values hold, the context is that of the six real ones.
        let (k2, v2) = (k.copy(), v.copy());
        let _ = k2.narrow(1, 6, 3).fill_(1e4);
        let _ = v2.narrow(1, 6, 3).fill_(-1e4);
        let changed = attention(&q, &k2, &v2, &bias, heads, 0.5);
        assert!(full.allclose(&changed, 0.0, 0.0, false));
        let short = attention(
            &q,
            &k.narrow(1, 0, 6),
            &v.narrow(1, 0, 6),
            &attention_bias(&mask.narrow(1, 0, 6), Kind::Float),
            heads,
            0.5,
        );
        assert!(full.allclose(&short, 1e-6, 1e-6, false));
    }
}
