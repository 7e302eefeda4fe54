//! AdamW over one flat buffer, the learning-rate schedule, and gradient clipping.
//!
//! Every parameter and every gradient is a view into one flat buffer, so a step is a single
//! fused pass (on CPU, a Rust loop over the buffers, split across cores) instead of a dozen
//! kernels per parameter; the flat gradient is also what an all-reduce wants. With bf16
//! weights the optimizer keeps fp32 master weights and copies them back after each step.

use rayon::prelude::*;
use tch::{Device, Kind, Tensor, nn};

use crate::config::Schedule;
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
        let norm = self.flat_grad.to_kind(Kind::Float).norm().double_value(&[]);
        Ok(norm)
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
        let grad = if self.flat_grad.kind() == Kind::Float {
            self.flat_grad.shallow_clone()
        } else {
            self.flat_grad.to_kind(Kind::Float)
        };
        tch::no_grad(|| {
            if master.device() == Device::Cpu {
                fused_cpu(
                    &master,
                    &grad,
                    &self.m,
                    &self.v,
                    self.decayed,
                    lr,
                    grad_scale,
                    c,
                    bc1,
                    bc2,
                );
            } else {
                tensor_ops(
                    &master,
                    &grad,
                    &self.m,
                    &self.v,
                    self.decayed,
                    lr,
                    grad_scale,
                    c,
                    bc1,
                    bc2,
                );
            }
            if self.master.is_some() {
                self.flat.copy_(&master);
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

/// One pass over the buffers (PyTorch's AdamW arithmetic), chunks spread over the cores.
#[allow(clippy::too_many_arguments)]
fn fused_cpu(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    decayed: usize,
    lr: f64,
    grad_scale: f64,
    c: AdamWConfig,
    bc1: f64,
    bc2: f64,
) {
    let n = p.numel();
    // SAFETY: all four are contiguous fp32 CPU tensors of n elements that this optimizer
    // owns, and nothing else reads or writes them during the step.
    let (p, g, m, v) = unsafe {
        (
            std::slice::from_raw_parts_mut(p.data_ptr() as *mut f32, n),
            std::slice::from_raw_parts(g.data_ptr() as *const f32, n),
            std::slice::from_raw_parts_mut(m.data_ptr() as *mut f32, n),
            std::slice::from_raw_parts_mut(v.data_ptr() as *mut f32, n),
        )
    };
    let k = Coefficients {
        b1: c.beta1 as f32,
        b2: c.beta2 as f32,
        eps: c.eps as f32,
        step_size: (lr / bc1) as f32,
        bc2_sqrt: bc2.sqrt() as f32,
        scale: grad_scale as f32,
    };
    let decay = (1.0 - lr * c.weight_decay) as f32;
    const CHUNK: usize = 1 << 16;
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, (((p, g), m), v))| {
            // The decayed prefix and the rest, each a branch-free loop.
            let split = decayed.saturating_sub(chunk * CHUNK).min(p.len());
            let (p0, p1) = p.split_at_mut(split);
            let (m0, m1) = m.split_at_mut(split);
            let (v0, v1) = v.split_at_mut(split);
            adamw_slice(p0, &g[..split], m0, v0, decay, &k);
            adamw_slice(p1, &g[split..], m1, v1, 1.0, &k);
        });
}

struct Coefficients {
    b1: f32,
    b2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    scale: f32,
}

/// AdamW on one slice; on x86-64 with AVX-512 (or AVX2) the compiler gets to use it, as
/// PyTorch's own fused kernel does by runtime dispatch.
fn adamw_slice(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    k: &Coefficients,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { adamw_avx512(p, g, m, v, decay, k) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { adamw_avx2(p, g, m, v, decay, k) };
        }
    }
    adamw_scalar(p, g, m, v, decay, k);
}

#[inline(always)]
fn adamw_scalar(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    k: &Coefficients,
) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g * k.scale;
        *m = k.b1 * *m + (1.0 - k.b1) * g;
        *v = k.b2 * *v + (1.0 - k.b2) * g * g;
        let denom = v.sqrt() / k.bc2_sqrt + k.eps;
        *p = *p * decay - k.step_size * *m / denom;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn adamw_avx512(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    k: &Coefficients,
) {
    adamw_scalar(p, g, m, v, decay, k);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adamw_avx2(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    k: &Coefficients,
) {
    adamw_scalar(p, g, m, v, decay, k);
}

/// The same arithmetic in tensor ops, for devices other than the CPU.
#[allow(clippy::too_many_arguments)]
fn tensor_ops(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    decayed: usize,
    lr: f64,
    grad_scale: f64,
    c: AdamWConfig,
    bc1: f64,
    bc2: f64,
) {
    let g = if grad_scale == 1.0 {
        g.shallow_clone()
    } else {
        g * grad_scale
    };
    if c.weight_decay != 0.0 {
        let _ = p
            .narrow(0, 0, decayed as i64)
            .g_mul_scalar_(1.0 - lr * c.weight_decay);
    }
    let _ = m.shallow_clone().lerp_(&g, 1.0 - c.beta1);
    let _ = v.shallow_clone().lerp_(&g.square(), 1.0 - c.beta2);
    let denom = v.sqrt() / bc2.sqrt() + c.eps;
    let _ = p.shallow_clone().g_sub_(&(m / denom * (lr / bc1)));
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
