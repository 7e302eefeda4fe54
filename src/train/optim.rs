//! AdamW over one flat buffer, the learning-rate schedule, and gradient clipping.
//!
//! Every parameter and every gradient is a view into one flat buffer, so a step is a single
//! fused pass (on CPU, a Rust loop over the buffers, split across cores) instead of a dozen
//! kernels per parameter; the flat gradient is also what an all-reduce wants. With bf16
//! weights the optimizer keeps fp32 master weights; on the CPU the same pass reads the bf16
//! gradients and writes the bf16 weights back, so a step allocates nothing.

use tch::{Device, Kind, Tensor, nn};

use crate::config::Schedule;
use crate::cpu::{Shared, bf16_bits, bf16_value, parallel, vectorized};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

pub(crate) struct AdamW {
    cfg: AdamWConfig,
    /// The parameters, decayed ones first, in a fixed order (by name within each group).
    params: Vec<(String, Tensor)>,
    /// The weights the model computes with (fp32 or bf16); each parameter is a view.
    flat: Tensor,
    /// fp32 weights the update applies to: `flat` itself for fp32.
    master: Option<Tensor>,
    /// Gradients, one buffer, bound after the first backward pass.
    flat_grad: Tensor,
    grads_bound: bool,
    m: Tensor,
    v: Tensor,
    /// Elements of `flat` that get weight decay (a prefix).
    decayed: usize,
    pub(crate) steps: u64,
}

/// The rows of the word-embedding matrix that this step's batches looked up. An
/// embedding's backward pass writes only the rows its ids select, so every other row's
/// gradient is exactly zero on every rank, and averaging just the looked-up rows gives the
/// dense average bit for bit. For MiniLM that halves what the all-reduce sends: the matrix
/// is 11.7M of its 22.7M parameters, and a step of 32 reviews looks up about a thousand rows.
pub(crate) struct LookedUp {
    /// Where the matrix starts in the flat buffer, and its shape.
    offset: i64,
    rows: i64,
    width: i64,
    /// `[rows]`: 1 where a batch of this step looked the row up, on this rank.
    mask: Tensor,
}

impl LookedUp {
    /// Marks the rows `ids` (token ids, any shape) look up.
    pub(crate) fn mark(&mut self, ids: &Tensor) {
        let ids = ids.reshape([-1]).to_device(self.mask.device());
        let _ = self.mask.index_fill_(0, &ids, 1.0);
    }
}

/// `all_reduce` over `part` (a view into the gradient buffer) in fp32, in place.
fn reduce_wide(
    part: &Tensor,
    all_reduce: &mut impl FnMut(&mut Tensor) -> Result<()>,
) -> Result<()> {
    if part.numel() == 0 {
        return Ok(());
    }
    if part.kind() == Kind::Float {
        return all_reduce(&mut part.shallow_clone());
    }
    let mut wide = part.to_kind(Kind::Float);
    all_reduce(&mut wide)?;
    tch::no_grad(|| part.shallow_clone().copy_(&wide));
    Ok(())
}

/// HF's rule: no weight decay on biases and LayerNorm weights.
fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("LayerNorm") || name.contains("layer_norm"))
}

impl AdamW {
    /// Moves every variable of `vs` into one flat buffer of `kind` (Float or BFloat16).
    pub(crate) fn new(vs: &nn::VarStore, cfg: AdamWConfig, kind: Kind) -> Result<Self> {
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| (!decays(&a.0), &a.0).cmp(&(!decays(&b.0), &b.0)));
        let total: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
        let decayed: i64 = params
            .iter()
            .filter(|(n, _)| decays(n))
            .map(|(_, t)| t.numel() as i64)
            .sum();
        let device = vs.device();
        // fp32 copy first, so bf16 runs keep the checkpoint's full-precision weights as masters.
        let full = Tensor::zeros([total], (Kind::Float, device));
        let mut offset = 0;
        for (_, p) in &params {
            let n = p.numel() as i64;
            let mut view = full.narrow(0, offset, n);
            tch::no_grad(|| view.copy_(&p.reshape([-1])));
            offset += n;
        }
        let (flat, master) = if kind == Kind::Float {
            (full, None)
        } else {
            (full.to_kind(kind), Some(full))
        };
        let mut offset = 0;
        for (_, p) in &mut params {
            let n = p.numel() as i64;
            p.set_data(&flat.narrow(0, offset, n).view(p.size().as_slice()));
            offset += n;
        }
        let zeros = || Tensor::zeros([total], (Kind::Float, device));
        Ok(Self {
            cfg,
            params,
            flat_grad: Tensor::zeros([total], (kind, device)),
            grads_bound: false,
            m: zeros(),
            v: zeros(),
            flat,
            master,
            decayed: decayed as usize,
            steps: 0,
        })
    }

    /// Number of parameters.
    pub(crate) fn numel(&self) -> usize {
        self.flat.numel()
    }

    /// After the first backward pass each parameter has its own gradient tensor: move it
    /// into the flat buffer, so later passes accumulate there in place.
    fn bind_grads(&mut self) -> Result<()> {
        let mut offset = 0;
        for (name, p) in &self.params {
            let n = p.numel() as i64;
            let mut g = p.grad();
            if g.defined() {
                let mut view = self
                    .flat_grad
                    .narrow(0, offset, n)
                    .view(p.size().as_slice());
                tch::no_grad(|| view.copy_(&g));
                g.set_data(&view);
            } else {
                return Err(Error::Internal(format!(
                    "parameter `{name}` got no gradient in the first step"
                )));
            }
            offset += n;
        }
        self.grads_bound = true;
        Ok(())
    }

    /// The global L2 norm of the gradients.
    pub(crate) fn grad_norm(&mut self) -> Result<f64> {
        if !self.grads_bound {
            self.bind_grads()?;
        }
        if self.flat_grad.device() == Device::Cpu {
            return Ok(sum_of_squares_cpu(&self.flat_grad).sqrt());
        }
        Ok(self.flat_grad.to_kind(Kind::Float).norm().double_value(&[]))
    }

    /// One AdamW step at `lr`, with gradients scaled by `grad_scale` (clipping).
    pub(crate) fn step(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        if !self.grads_bound {
            self.bind_grads()?;
        }
        self.steps += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.steps as i32);
        let bc2 = 1.0 - c.beta2.powi(self.steps as i32);
        let master = self.master.as_ref().unwrap_or(&self.flat).shallow_clone();
        let step = Step {
            lr,
            grad_scale,
            decayed: self.decayed,
            c,
            bc1,
            bc2,
        };
        tch::no_grad(|| {
            if master.device() == Device::Cpu {
                let model = self.master.is_some().then_some(&self.flat);
                fused_cpu(&master, &self.flat_grad, &self.m, &self.v, model, &step);
            } else {
                let grad = self.flat_grad.to_kind(Kind::Float);
                tensor_ops(&master, &grad, &self.m, &self.v, &step);
                if self.master.is_some() {
                    self.flat.copy_(&master);
                }
            }
        });
        Ok(())
    }

    pub(crate) fn zero_grad(&mut self) {
        if self.grads_bound {
            let _ = self.flat_grad.zero_();
        } else {
            for (_, p) in &mut self.params {
                p.zero_grad();
            }
        }
    }

    /// Makes this optimizer's state rank 0's, through `broadcast` (in place): the fp32
    /// weights, the model's copy of them, both moments. Data parallelism starts here.
    pub(crate) fn sync(
        &mut self,
        mut broadcast: impl FnMut(&mut Tensor) -> Result<()>,
    ) -> Result<()> {
        match &mut self.master {
            Some(master) => {
                broadcast(master)?;
                tch::no_grad(|| self.flat.copy_(master));
            }
            None => broadcast(&mut self.flat)?,
        }
        broadcast(&mut self.m)?;
        broadcast(&mut self.v)
    }

    /// The word-embedding matrix, the parameter whose name ends with `name`, to be reduced
    /// by the rows the step looked up (see [`LookedUp`]); `None` when the model has none.
    pub(crate) fn looked_up(&self, name: &str) -> Option<LookedUp> {
        let mut offset = 0;
        for (n, p) in &self.params {
            let size = p.size();
            if n.ends_with(name) && size.len() == 2 {
                let mask = Tensor::zeros([size[0]], (Kind::Float, p.device()));
                return Some(LookedUp {
                    offset,
                    rows: size[0],
                    width: size[1],
                    mask,
                });
            }
            offset += p.numel() as i64;
        }
        None
    }

    /// Averages the accumulated gradients across ranks with `all_reduce` (in place), in
    /// fp32: bf16 gradients are widened first and rounded once after. The flat buffer goes
    /// as it is, except for the word embeddings when `looked_up` is given: of those, only
    /// the rows some rank's batches looked up. Returns how many floats it reduced.
    pub(crate) fn reduce_grads(
        &mut self,
        looked_up: Option<&mut LookedUp>,
        mut all_reduce: impl FnMut(&mut Tensor) -> Result<()>,
    ) -> Result<i64> {
        if !self.grads_bound {
            self.bind_grads()?;
        }
        let total = self.flat_grad.numel() as i64;
        let Some(lu) = looked_up else {
            reduce_wide(&self.flat_grad, &mut all_reduce)?;
            return Ok(total);
        };
        // The rows any rank looked up: an average of 0/1 flags is not 0 where one did.
        all_reduce(&mut lu.mask)?;
        let rows = lu.mask.nonzero().view([-1]);
        let _ = lu.mask.zero_();
        let end = lu.offset + lu.rows * lu.width;
        reduce_wide(&self.flat_grad.narrow(0, 0, lu.offset), &mut all_reduce)?;
        reduce_wide(&self.flat_grad.narrow(0, end, total - end), &mut all_reduce)?;
        let picked = rows.numel() as i64;
        if picked > 0 {
            let mut matrix = self
                .flat_grad
                .narrow(0, lu.offset, lu.rows * lu.width)
                .view([lu.rows, lu.width]);
            let kind = matrix.kind();
            let mut wide = matrix.index_select(0, &rows).to_kind(Kind::Float);
            all_reduce(&mut wide)?;
            let _ = tch::no_grad(|| matrix.index_copy_(0, &rows, &wide.to_kind(kind)));
        }
        Ok(total - (lu.rows - picked) * lu.width + lu.rows)
    }

    /// Optimizer state for a checkpoint: fp32 weights, both moments.
    pub(crate) fn state(&self) -> Vec<(&'static str, Tensor)> {
        let weights = self
            .master
            .as_ref()
            .unwrap_or(&self.flat)
            .to_device(Device::Cpu)
            .to_kind(Kind::Float);
        vec![
            ("weights", weights),
            ("exp_avg", self.m.to_device(Device::Cpu)),
            ("exp_avg_sq", self.v.to_device(Device::Cpu)),
        ]
    }

    /// Restores what [`AdamW::state`] saved.
    pub(crate) fn restore(&mut self, state: &[(String, Tensor)], steps: u64) -> Result<()> {
        let get = |name: &str| {
            state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
                .filter(|t| t.numel() == self.flat.numel())
                .ok_or_else(|| {
                    Error::Model(format!(
                        "the checkpoint's `{name}` is missing or does not fit this model; \
                         delete the run's checkpoints/ to start over"
                    ))
                })
        };
        let (w, m, v) = (get("weights")?, get("exp_avg")?, get("exp_avg_sq")?);
        tch::no_grad(|| {
            if let Some(master) = &mut self.master {
                master.copy_(w);
            }
            self.flat.copy_(w);
            self.m.copy_(m);
            self.v.copy_(v);
        });
        self.steps = steps;
        Ok(())
    }

    /// The fp32 weights, one flat tensor (for the best-model snapshot).
    pub(crate) fn weights(&self) -> Tensor {
        self.master.as_ref().unwrap_or(&self.flat).shallow_clone()
    }

    /// Overwrites the model's weights from a flat fp32 snapshot.
    pub(crate) fn load_weights(&mut self, w: &Tensor) {
        tch::no_grad(|| {
            if let Some(master) = &mut self.master {
                master.copy_(w);
            }
            self.flat.copy_(w);
        });
    }
}

/// What one step applies, besides the buffers.
struct Step {
    lr: f64,
    grad_scale: f64,
    /// Elements, from the start, that get weight decay.
    decayed: usize,
    c: AdamWConfig,
    /// Bias corrections `1 - beta^t`.
    bc1: f64,
    bc2: f64,
}

/// Elements per task of the CPU passes: large enough that a task's overhead is nothing,
/// small enough that two threads share the work evenly.
const CHUNK: usize = 1 << 16;

/// One pass over the buffers (PyTorch's AdamW arithmetic), chunks spread over libtorch's
/// threads. `p`, `m` and `v` are fp32; the gradients `g` are fp32, or bf16 for a bf16 model,
/// whose weights (`model`) are then written in the same pass, rounded from the fp32 masters.
fn fused_cpu(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, model: Option<&Tensor>, s: &Step) {
    let n = p.numel();
    for t in [g, m, v].into_iter().chain(model) {
        assert!(
            t.numel() == n && t.is_contiguous() && t.device() == Device::Cpu,
            "optimizer buffers must be contiguous CPU tensors of one size"
        );
    }
    let c = s.c;
    let k = Coefficients {
        b1: c.beta1 as f32,
        b2: c.beta2 as f32,
        eps: c.eps as f32,
        step_size: (s.lr / s.bc1) as f32,
        bc2_sqrt: s.bc2.sqrt() as f32,
        scale: s.grad_scale as f32,
    };
    let decay = (1.0 - s.lr * c.weight_decay) as f32;
    // fp32 gradients alone, or bf16 gradients with the bf16 weights to write.
    let kinds = (g.kind(), model.map(Tensor::kind));
    assert!(
        matches!(
            kinds,
            (Kind::Float, None) | (Kind::BFloat16, Some(Kind::BFloat16))
        ),
        "optimizer buffers of kinds {kinds:?}"
    );
    let [p, m, v] = [p, m, v].map(|t| Shared(t.data_ptr() as *mut f32));
    let (g, w) = (
        g.data_ptr(),
        model.map(|t| Shared(t.data_ptr() as *mut u16)),
    );
    let (g32, g16) = (Shared(g as *mut f32), Shared(g as *mut u16));
    parallel(n.div_ceil(CHUNK), &|chunks| {
        for chunk in chunks {
            let start = chunk * CHUNK;
            let len = CHUNK.min(n - start);
            // The decayed prefix and the rest, each a branch-free loop.
            let split = s.decayed.saturating_sub(start).min(len);
            for (at, len, decay) in [(start, split, decay), (start + split, len - split, 1.0)] {
                // SAFETY: p, m, v, g (and w) are contiguous CPU buffers of n elements (checked
                // above) that this optimizer owns and nothing else touches during the step;
                // each task covers its own chunks, inside 0..n.
                unsafe {
                    let p = std::slice::from_raw_parts_mut(p.at(at), len);
                    let m = std::slice::from_raw_parts_mut(m.at(at), len);
                    let v = std::slice::from_raw_parts_mut(v.at(at), len);
                    match w {
                        Some(w) => {
                            let g = std::slice::from_raw_parts(g16.at(at), len);
                            let w = std::slice::from_raw_parts_mut(w.at(at), len);
                            adamw_bf16(p, g, m, v, w, decay, &k);
                        }
                        None => {
                            let g = std::slice::from_raw_parts(g32.at(at), len);
                            adamw_f32(p, g, m, v, decay, &k);
                        }
                    }
                }
            }
        }
    });
}

/// The sum of the squares of `g` (fp32 or bf16, contiguous, on the CPU), accumulated in
/// fp64, in one pass that allocates nothing.
fn sum_of_squares_cpu(g: &Tensor) -> f64 {
    assert!(
        g.is_contiguous() && matches!(g.kind(), Kind::Float | Kind::BFloat16),
        "gradients must be one contiguous fp32 or bf16 buffer"
    );
    let n = g.numel();
    let chunks = n.div_ceil(CHUNK);
    let mut partial = vec![0f64; chunks];
    let out = Shared(partial.as_mut_ptr());
    let (g32, g16) = (
        Shared(g.data_ptr() as *mut f32),
        Shared(g.data_ptr() as *mut u16),
    );
    let bf16 = g.kind() == Kind::BFloat16;
    parallel(chunks, &|range| {
        for chunk in range {
            let (at, len) = (chunk * CHUNK, CHUNK.min(n - chunk * CHUNK));
            // SAFETY: `g` holds n contiguous elements of its kind and is not written during
            // this pass; each chunk writes only its own slot of `partial` (chunks of them).
            unsafe {
                *out.at(chunk) = if bf16 {
                    squares_bf16(std::slice::from_raw_parts(g16.at(at), len))
                } else {
                    squares_f32(std::slice::from_raw_parts(g32.at(at), len))
                };
            }
        }
    });
    // Summed in chunk order: the same result for any number of threads.
    partial.iter().sum()
}

/// Lanes of the vectorized sums: independent accumulators the compiler keeps in registers.
const LANES: usize = 8;

#[inline(always)]
fn squares_body<T: Copy>(g: &[T], value: impl Fn(T) -> f32) -> f64 {
    let mut acc = [0f64; LANES];
    let mut blocks = g.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, &x) in acc.iter_mut().zip(block) {
            let x = f64::from(value(x));
            *a += x * x;
        }
    }
    let tail: f64 = blocks
        .remainder()
        .iter()
        .map(|&x| f64::from(value(x)).powi(2))
        .sum();
    acc.iter().sum::<f64>() + tail
}

#[inline(always)]
fn squares_f32_body(g: &[f32]) -> f64 {
    squares_body(g, |x| x)
}

#[inline(always)]
fn squares_bf16_body(g: &[u16]) -> f64 {
    squares_body(g, bf16_value)
}

vectorized! {
    /// The sum of squares of fp32 values, in fp64.
    fn squares_f32(g: &[f32]) -> f64 = squares_f32_body;
}

vectorized! {
    /// The sum of squares of bf16 values, in fp64.
    fn squares_bf16(g: &[u16]) -> f64 = squares_bf16_body;
}

struct Coefficients {
    b1: f32,
    b2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    scale: f32,
}

/// AdamW on one parameter element, as PyTorch computes it.
#[inline(always)]
fn update(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, decay: f32, k: &Coefficients) {
    let g = g * k.scale;
    *m = k.b1 * *m + (1.0 - k.b1) * g;
    *v = k.b2 * *v + (1.0 - k.b2) * g * g;
    let denom = v.sqrt() / k.bc2_sqrt + k.eps;
    *p = *p * decay - k.step_size * *m / denom;
}

#[inline(always)]
fn adamw_f32_body(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    k: &Coefficients,
) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        update(p, *g, m, v, decay, k);
    }
}

#[inline(always)]
fn adamw_bf16_body(
    p: &mut [f32],
    g: &[u16],
    m: &mut [f32],
    v: &mut [f32],
    w: &mut [u16],
    decay: f32,
    k: &Coefficients,
) {
    let rows = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
    for ((((p, g), m), v), w) in rows.zip(w.iter_mut()) {
        update(p, bf16_value(*g), m, v, decay, k);
        *w = bf16_bits(*p);
    }
}

vectorized! {
    /// AdamW over fp32 gradients.
    fn adamw_f32(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: f32, k: &Coefficients)
        = adamw_f32_body;
}

vectorized! {
    /// AdamW over bf16 gradients, writing the updated weights to `w` in bf16 as well.
    fn adamw_bf16(
        p: &mut [f32],
        g: &[u16],
        m: &mut [f32],
        v: &mut [f32],
        w: &mut [u16],
        decay: f32,
        k: &Coefficients
    ) = adamw_bf16_body;
}

/// The same arithmetic in tensor ops, for devices other than the CPU.
fn tensor_ops(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, s: &Step) {
    let c = s.c;
    let g = if s.grad_scale == 1.0 {
        g.shallow_clone()
    } else {
        g * s.grad_scale
    };
    if c.weight_decay != 0.0 {
        let _ = p
            .narrow(0, 0, s.decayed as i64)
            .g_mul_scalar_(1.0 - s.lr * c.weight_decay);
    }
    let _ = m.shallow_clone().lerp_(&g, 1.0 - c.beta1);
    let _ = v.shallow_clone().lerp_(&g.square(), 1.0 - c.beta2);
    let denom = v.sqrt() / s.bc2.sqrt() + c.eps;
    let _ = p.shallow_clone().g_sub_(&(m / denom * (s.lr / s.bc1)));
}

/// The learning rate at optimizer step `step` (0-based) of `total`, as HF's schedulers.
pub(crate) fn learning_rate(
    schedule: Schedule,
    base: f64,
    warmup: u64,
    step: u64,
    total: u64,
) -> f64 {
    if step < warmup {
        return base * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match schedule {
        Schedule::Constant => base,
        Schedule::Linear => base * (1.0 - progress).max(0.0),
        Schedule::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

#[cfg(test)]
mod tests;
