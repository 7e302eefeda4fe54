//! The training loop, on its own thread: model, optimizer, schedule, evaluation, early
//! stopping, checkpoints and resume, then the test split and the saved model.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tch::{Kind, Tensor};

use super::checkpoint::{self, Found, LoopState, RunDir};
use super::data::{Dataset, Split};
use super::dist::Group;
use super::loader::{self, Batch, Order, Prefetch};
use super::metrics::{self, Metrics};
use super::optim::{self, AdamW, AdamWConfig, LookedUp};
use super::{Every, TrainSettings};
use crate::config::{Precision, SaveWhich};
use crate::error::{Error, Result};
use crate::model::{Model, ModelConfig};
use crate::track::{MlflowSettings, Tracker};

/// What a finished run reports.
pub(crate) struct Outcome {
    pub metrics: Metrics,
    pub model_dir: PathBuf,
    pub resumed_from: Option<u64>,
    pub stopped_early: bool,
    pub mlflow_run_id: Option<String>,
}

/// Everything the training thread needs, owned.
pub(crate) struct Job {
    pub model_dir: PathBuf,
    pub config: ModelConfig,
    pub output: RunDir,
    pub device: tch::Device,
    pub mlflow: Option<MlflowSettings>,
    pub settings: TrainSettings,
    pub data: Dataset,
    /// Names checkpoints: a checkpoint with another fingerprint is never resumed. It leaves
    /// out the number of ranks, so a run resumes with the same or another N.
    pub fingerprint: String,
    /// What the fingerprint is made of, kept in each checkpoint.
    pub identity: serde_json::Value,
    pub progress: bool,
    /// The process group of a data-parallel run; `None` trains alone.
    pub group: Option<Arc<Group>>,
}

impl Job {
    /// Rank 0 (or a run alone) writes the checkpoints, logs and model.
    fn writes(&self) -> bool {
        self.group.as_ref().is_none_or(|g| g.rank == 0)
    }

    fn rank_world(&self) -> (usize, usize) {
        self.group.as_ref().map_or((0, 1), |g| (g.rank, g.world))
    }
}

/// The token-embedding matrix of every architecture (`embeddings.word_embeddings` in HF's
/// BERT, RoBERTa, DistilBERT and DeBERTa-v2 alike).
const WORD_EMBEDDINGS: &str = "embeddings.word_embeddings.weight";

/// The seed of micro-batch `n`: dropout masks depend only on (seed, n), so a resumed run
/// draws exactly the masks the uninterrupted run would have.
fn batch_seed(seed: u64, n: u64) -> i64 {
    (seed.wrapping_mul(0x9E37_79B9).wrapping_add(n) & 0x7FFF_FFFF_FFFF) as i64
}

/// Mean loss, predictions and metrics of `model` over `split`, in eval mode. With a group,
/// each rank evaluates every `world`-th batch and the sums are reduced: every rank gets the
/// same metrics.
fn evaluate(
    model: &Model,
    split: &Split,
    batch_size: usize,
    pad_id: i64,
    classes: usize,
    group: Option<&Group>,
) -> Result<Metrics> {
    let _guard = tch::no_grad_guard();
    let device = model.vs.device();
    let mut loss_sum = 0.0;
    let mut predicted = vec![0i64; split.len()];
    let (rank, world) = group.map_or((0, 1), |g| (g.rank, g.world));
    let batches = loader::eval_batches(split, batch_size);
    for rows in batches.into_iter().skip(rank).step_by(world) {
        let b = loader::make_batch(split, &rows, pad_id);
        let logits = model.net.forward_t(
            &b.input_ids.to_device(device),
            &b.attention_mask.to_device(device),
            false,
        );
        let labels = b.labels.to_device(device);
        loss_sum += logits.cross_entropy_for_logits(&labels).double_value(&[]) * b.rows as f64;
        let argmax = Vec::<i64>::try_from(logits.argmax(-1, false).to_device(tch::Device::Cpu))
            .unwrap_or_default();
        for (row, p) in rows.iter().zip(argmax) {
            predicted[*row] = p;
        }
    }
    if let Some(g) = group {
        // Each row's prediction comes from one rank, zeros from the others: the sum is exact.
        let mut sums: Vec<f64> = predicted.iter().map(|&p| p as f64).collect();
        sums.push(loss_sum);
        let mut t = Tensor::from_slice(&sums);
        g.all_reduce_sum(&mut t, "the evaluation")?;
        let sums = Vec::<f64>::try_from(&t).unwrap_or_default();
        loss_sum = sums.last().copied().unwrap_or_default();
        for (p, v) in predicted.iter_mut().zip(&sums) {
            *p = *v as i64;
        }
    }
    let n = split.len().max(1) as f64;
    Ok(metrics::classification(
        &split.labels,
        &predicted,
        classes,
        loss_sum / n,
    ))
}

fn due(every: Every, step: u64, end_of_epoch: bool) -> bool {
    match every {
        Every::Never => false,
        Every::Epoch => end_of_epoch,
        Every::Steps(n) => step.is_multiple_of(n),
    }
}

fn prefixed(prefix: &str, m: &Metrics) -> Vec<(String, f64)> {
    m.iter()
        .map(|(k, v)| (format!("{prefix}/{k}"), *v))
        .collect()
}

fn log(tracker: &mut Tracker, step: u64, values: &[(String, f64)]) -> Result<()> {
    let refs: Vec<(&str, f64)> = values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    tracker.scalars(step, &refs)
}

fn bar(progress: bool, total: u64) -> ProgressBar {
    if !progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:.bold} [{bar:30}] {pos}/{len} steps {msg} [{elapsed} < {eta}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_prefix("train");
    bar
}

/// Runs the whole job; called on the training thread.
pub(crate) fn train(mut job: Job) -> Result<Outcome> {
    let train = Arc::new(std::mem::take(&mut job.data.train));
    let s = &job.settings;
    tch::set_num_threads(s.threads as i32);
    tch::manual_seed(s.seed as i64);
    let classes = job.data.labels.len();
    let mut model = Model::load(
        job.config.clone(),
        &job.model_dir,
        classes as i64,
        job.device,
    )?;
    let pad_id = model.config.arch.pad_token_id();
    let mut opt = optimizer(&model, s)?;
    let (rank, world) = job.rank_world();
    let order = Order {
        batch_size: s.batch_size,
        seed: s.seed,
        group_by_length: s.group_by_length,
        rank,
        world,
    };
    let (total_steps, warmup) = schedule(train.len(), s, &order)?;
    let (mut state, resumed_from) = resume(&job, &mut opt, world, total_steps)?;
    let mut tracker = open_tracker(&job, &mut state)?;
    if resumed_from.is_none() {
        tracker.params(&params(&job, &model, &opt, train.len(), world))?;
    }
    // Ranks reduce only the word-embedding rows their batches looked up.
    let looked_up = job
        .group
        .as_ref()
        .and_then(|_| opt.looked_up(WORD_EMBEDDINGS));
    let result = Loop {
        job: &job,
        model: &mut model,
        opt: &mut opt,
        tracker: &mut tracker,
        state: &mut state,
        plan: Plan {
            order,
            classes,
            pad_id,
            total_steps,
            warmup,
        },
        bar: bar(job.progress && job.writes(), total_steps),
        window: Window::new(job.device),
        stopped: false,
        looked_up,
    }
    .run(&train);
    let stopped_early = match result {
        Ok(stopped) => stopped,
        Err(e) => {
            let _ = tracker.finish(false);
            return Err(e);
        }
    };
    let (metrics, model_dir) = finish(&job, &model, &mut opt, &mut tracker, &state, pad_id)?;
    Ok(Outcome {
        metrics: outcome_metrics(metrics, &state, world, resumed_from, s),
        model_dir,
        resumed_from,
        stopped_early,
        mlflow_run_id: state.mlflow_run_id.clone(),
    })
}

/// AdamW over the model's weights, its moments in the training precision.
fn optimizer(model: &Model, s: &TrainSettings) -> Result<AdamW> {
    let kind = match s.precision {
        Precision::Bf16 => Kind::BFloat16,
        // The plan refuses int8 for training.
        Precision::Fp32 | Precision::Int8 => Kind::Float,
    };
    AdamW::new(
        &model.vs,
        AdamWConfig {
            beta1: s.adam_beta1,
            beta2: s.adam_beta2,
            eps: s.adam_eps,
            weight_decay: s.weight_decay,
        },
        kind,
    )
}

/// The run's optimizer steps in all, and how many of them warm the learning rate up.
fn schedule(rows: usize, s: &TrainSettings, order: &Order) -> Result<(u64, u64)> {
    let micro_per_epoch = loader::batches_per_epoch(rows, order);
    if micro_per_epoch == 0 {
        return Err(Error::Data(
            "the training split is empty, so there is nothing to train on".into(),
        ));
    }
    let steps_per_epoch = micro_per_epoch.div_ceil(s.grad_accum) as u64;
    let total_steps = s.max_steps.unwrap_or(steps_per_epoch * s.epochs);
    let warmup = s
        .warmup_steps
        .unwrap_or_else(|| (s.warmup_ratio.unwrap_or(0.0) * total_steps as f64).ceil() as u64);
    Ok((total_steps, warmup))
}

/// The loop's state: the latest checkpoint of this very configuration, if a run was cut
/// short (rank 0's, on every rank), else a fresh start; and the step it resumes from.
fn resume(
    job: &Job,
    opt: &mut AdamW,
    world: usize,
    total_steps: u64,
) -> Result<(LoopState, Option<u64>)> {
    let mut state = LoopState {
        fingerprint: job.fingerprint.clone(),
        identity: Some(job.identity.clone()),
        world,
        ..LoopState::default()
    };
    let mut resumed_from = None;
    if job.writes() {
        checkpoint::pull(&job.output)?;
        match checkpoint::find(&job.output, &job.fingerprint)? {
            // A finished run of another number of ranks is not this run's end: start over.
            Found::Mine(restored)
                if restored.state.world == world || restored.state.global_step < total_steps =>
            {
                opt.restore(&restored.tensors, restored.state.global_step)?;
                state = restored.state;
                resumed_from = Some(state.global_step);
            }
            found => {
                if let Some(why) = not_resumed(job, &found, world) {
                    eprintln!("{why}");
                }
                checkpoint::clear(&job.output)?;
            }
        }
    }
    if let Some(g) = &job.group {
        // Rank 0's position and weights (a checkpoint's, or its fresh ones), as DDP does.
        let text = serde_json::to_vec(&(&state, resumed_from))
            .map_err(|e| Error::Internal(format!("loop state: {e}")))?;
        let text = g.broadcast_bytes(&text, "the loop state")?;
        (state, resumed_from) = serde_json::from_slice(&text)
            .map_err(|e| Error::Internal(format!("rank 0's loop state: {e}")))?;
        opt.sync(|t| g.broadcast(t, "the initial weights"))?;
        opt.steps = state.global_step;
    }
    // Micro-batches are counted in global batches: with another number of ranks, the
    // resumed epoch skips as many rows as were done (its order is that of the new size).
    if state.world != world {
        state.batches_done = state.batches_done * state.world / world;
        state.world = world;
    }
    Ok((state, resumed_from))
}

/// One line on why the checkpoints `found` are not resumed: the end of a finished run of
/// another number of ranks, or a run of other inputs, naming what changed. `None` when
/// there are none.
fn not_resumed(job: &Job, found: &Found, world: usize) -> Option<String> {
    let place = job.output.mirror.as_ref().map_or_else(
        || checkpoint::dir(&job.output.path).display().to_string(),
        |m| m.url_of("checkpoints"),
    );
    match found {
        Found::Nothing => None,
        Found::Mine(restored) => Some(format!(
            "train: the checkpoint in {place} (step {}) ends a finished run of {} ranks; this \
             run of {world} starts over from step 0 and removes it",
            restored.state.global_step, restored.state.world
        )),
        Found::Other(name, other) => {
            let changed = match &other.identity {
                Some(before) => changed_keys(before, &job.identity).join(", "),
                None => "unknown: it was written by an older lakeml".into(),
            };
            Some(format!(
                "train: checkpoint {name} in {place} (step {}) was written for other inputs \
                 (changed: {changed}); this run starts from step 0 and removes it",
                other.global_step
            ))
        }
    }
}

/// The keys whose values differ between two identities, as `key` or `key.sub` one level
/// into objects (`settings.lr`).
fn changed_keys(before: &serde_json::Value, now: &serde_json::Value) -> Vec<String> {
    let (Some(before), Some(now)) = (before.as_object(), now.as_object()) else {
        return vec!["everything".into()];
    };
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(now.keys()).collect();
    let mut changed = Vec::new();
    for key in keys {
        match (before.get(key), now.get(key)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(serde_json::Value::Object(a)), Some(serde_json::Value::Object(b)))
                if key != "model" && key != "inputs" =>
            {
                let subs: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
                changed.extend(
                    subs.into_iter()
                        .filter(|k| a.get(*k) != b.get(*k))
                        .map(|k| format!("{key}.{k}")),
                );
            }
            _ => changed.push(key.clone()),
        }
    }
    changed
}

/// Rank 0's tracker (the resumed run's MLflow run, if any); silent on the other ranks.
fn open_tracker(job: &Job, state: &mut LoopState) -> Result<Tracker> {
    let tracker = if job.writes() {
        Tracker::open(
            &job.output.path,
            job.mlflow.clone(),
            state.mlflow_run_id.as_deref(),
        )?
    } else {
        Tracker::silent()
    };
    state.mlflow_run_id = tracker.mlflow_run_id().map(str::to_string);
    Ok(tracker)
}

/// The run's parameters as the tracker records them: the settings, the model and the data.
fn params(
    job: &Job,
    model: &Model,
    opt: &AdamW,
    train_rows: usize,
    world: usize,
) -> Vec<(String, String)> {
    let mut params: Vec<(String, String)> = serde_json::to_value(&job.settings)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.to_string().trim_matches('"').to_string()))
        .collect();
    params.push(("model".into(), crate::storage::model_name(&job.model_dir)));
    params.push(("model_type".into(), model.config.arch.prefix().into()));
    params.push(("train_rows".into(), train_rows.to_string()));
    params.push(("world".into(), world.to_string()));
    params.push(("parameters".into(), opt.numel().to_string()));
    params.push(("new_weights".into(), model.fresh.join(",")));
    params.push(("labels".into(), job.data.labels.join(",")));
    params
}

/// After the loop: the weights to keep (the best by `best_metric`, or the final ones), their
/// test metrics, and the saved model directory.
fn finish(
    job: &Job,
    model: &Model,
    opt: &mut AdamW,
    tracker: &mut Tracker,
    state: &LoopState,
    pad_id: i64,
) -> Result<(Metrics, PathBuf)> {
    let s = &job.settings;
    if s.save == SaveWhich::Best {
        if job.writes()
            && let Some(best) = checkpoint::best(&job.output, &job.fingerprint)?
        {
            opt.load_weights(&best.to_device(job.device));
        }
        if let Some(g) = &job.group {
            opt.sync(|t| g.broadcast(t, "the best weights"))?;
        }
    }
    let mut metrics = Metrics::new();
    if !job.data.test.is_empty() {
        let classes = job.data.labels.len();
        let group = job.group.as_deref();
        let test = evaluate(
            model,
            &job.data.test,
            s.eval_batch_size,
            pad_id,
            classes,
            group,
        )?;
        log(tracker, state.global_step, &prefixed("test", &test))?;
        metrics.extend(test.into_iter().map(|(k, v)| (format!("test_{k}"), v)));
    }
    let model_dir = if job.writes() {
        let dir = save_model(job, model)?;
        tracker.artifacts(&dir, "model")?;
        tracker.finish(true)?;
        checkpoint::push_logs(&job.output)?;
        dir
    } else {
        job.output.path.join("model")
    };
    Ok((metrics, model_dir))
}

/// The outcome's metrics: `metrics` (the test split's) and the run's speed and steps.
fn outcome_metrics(
    mut metrics: Metrics,
    state: &LoopState,
    world: usize,
    resumed_from: Option<u64>,
    s: &TrainSettings,
) -> Metrics {
    let secs = state.train_seconds.max(1e-9);
    metrics.insert("steps".into(), state.global_step as f64);
    metrics.insert("world".into(), world as f64);
    if world > 1 {
        // Per step of this process (a resumed run counts its own steps only).
        let steps = (state.global_step - resumed_from.unwrap_or(0)).max(1);
        metrics.insert(
            "all_reduce_ms_per_step".into(),
            1e3 * state.all_reduce_seconds / steps as f64,
        );
        metrics.insert(
            "all_reduce_mb_per_step".into(),
            state.all_reduce_bytes / 1e6 / steps as f64,
        );
    }
    metrics.insert("train_seconds".into(), state.train_seconds);
    metrics.insert("samples_per_second".into(), state.samples as f64 / secs);
    metrics.insert("tokens_per_second".into(), state.tokens as f64 / secs);
    metrics.insert(
        "padding_ratio".into(),
        1.0 - state.tokens as f64 / (state.slots.max(1)) as f64,
    );
    if let Some((best, step)) = state.best {
        metrics.insert(format!("best_eval_{}", s.best_metric), best);
        metrics.insert("best_step".into(), step as f64);
    }
    metrics
}

/// What stays fixed for the whole loop.
struct Plan {
    order: Order,
    classes: usize,
    pad_id: i64,
    total_steps: u64,
    warmup: u64,
}

/// The training loop: epochs of micro-batches, an optimizer step every `grad_accum` of them,
/// and around the steps the logging, evaluation (best weights, early stopping) and
/// checkpoints. Everything it changes that a resume needs is in `state`.
struct Loop<'a> {
    job: &'a Job,
    model: &'a mut Model,
    opt: &'a mut AdamW,
    tracker: &'a mut Tracker,
    state: &'a mut LoopState,
    plan: Plan,
    bar: ProgressBar,
    window: Window,
    /// Early stopping has spoken.
    stopped: bool,
    /// The word-embedding rows this step looked up, with data parallelism.
    looked_up: Option<LookedUp>,
}

impl Loop<'_> {
    /// Trains until the last step or early stopping; returns whether it stopped early.
    fn run(mut self, train: &Arc<Split>) -> Result<bool> {
        self.bar.set_position(self.state.global_step);
        while self.state.global_step < self.plan.total_steps {
            if self.epoch(train)? {
                break;
            }
        }
        self.bar.finish_and_clear();
        Ok(self.stopped)
    }

    /// One epoch, or what a resumed run has left of it; true when training is over (the last
    /// step, or early stopping).
    fn epoch(&mut self, train: &Arc<Split>) -> Result<bool> {
        let job = self.job;
        let s = &job.settings;
        let epoch = self.state.epoch;
        let batches = loader::epoch_batches(train, &self.plan.order, epoch);
        let micro_total = batches.len();
        let skip = self.state.batches_done.min(micro_total);
        let remaining: Vec<loader::Shard> = batches.into_iter().skip(skip).collect();
        let mut micro = skip;
        let mut in_step = 0usize;
        let mut clock = Clock::new(self.state.train_seconds);
        for batch in Prefetch::start(train.clone(), remaining, self.plan.pad_id, s.prefetch) {
            // Each micro-batch seeds the RNG by its global index and the rank (dropout): a
            // resumed run draws the same masks, and ranks draw different ones.
            let global_micro = epoch * micro_total as u64 + micro as u64;
            let (rank, world) = (self.plan.order.rank as u64, self.plan.order.world as u64);
            tch::manual_seed(batch_seed(s.seed, global_micro * world + rank));
            let loss = self.forward_backward(&batch);
            micro += 1;
            in_step += 1;
            // Counted for the whole global batch, every rank's part.
            self.state.samples += batch.global_rows as u64;
            self.state.tokens += batch.global_tokens as u64;
            self.state.slots += batch.global_slots as u64;
            self.window.add(batch.global_rows, &loss);
            if in_step < s.grad_accum && micro < micro_total {
                continue;
            }
            in_step = 0;
            let (lr, norm) = self.optimizer_step()?;
            self.state.batches_done = micro;
            let step = self.state.global_step;
            self.state.train_seconds = clock.seconds();
            self.bar.inc(1);

            if step.is_multiple_of(s.log_every) || step == self.plan.total_steps {
                let at = epoch as f64 + micro as f64 / micro_total as f64;
                self.window
                    .log(self.tracker, &self.bar, step, lr, norm, at)?;
            }
            let end_of_epoch = micro == micro_total;
            if end_of_epoch {
                self.state.epoch += 1;
                self.state.batches_done = 0;
            }
            let last = step >= self.plan.total_steps;
            // Evaluation (every N steps, each epoch end, and at the very end if enabled).
            let eval_now = !job.data.validation.is_empty()
                && (due(s.eval_every, step, end_of_epoch)
                    || (last && s.eval_every != Every::Never));
            // Evaluations and checkpoints are not training time.
            if eval_now {
                if clock.exclude(|| self.validate(step))? {
                    self.stopped = true;
                }
                self.state.train_seconds = clock.seconds();
            }
            if job.writes()
                && (due(s.checkpoint_every, step, end_of_epoch)
                    || (self.stopped && s.checkpoint_every != Every::Never))
            {
                clock.exclude(|| {
                    checkpoint::save(
                        &job.output,
                        &self.opt.state(),
                        self.state,
                        s.keep_checkpoints,
                    )
                })?;
                self.state.train_seconds = clock.seconds();
            }
            if self.stopped || last {
                return Ok(true);
            }
        }
        if micro < micro_total {
            return Err(Error::Internal("the data loader stopped early".into()));
        }
        Ok(false)
    }

    /// One micro-batch forward and backward (gradients accumulate, scaled by 1/grad_accum);
    /// returns its loss, on the device. A rank's share of a global batch weighs its loss by
    /// its rows, so the average over ranks is the global batch's mean loss.
    fn forward_backward(&mut self, batch: &Batch) -> Tensor {
        let device = self.job.device;
        if batch.rows == 0 {
            // The last global batch had fewer rows than there are ranks; this one adds
            // nothing to the sum the all-reduce averages.
            return Tensor::zeros([], (Kind::Float, device));
        }
        if let Some(looked_up) = &mut self.looked_up {
            looked_up.mark(&batch.input_ids);
        }
        let logits = self.model.net.forward_t(
            &batch.input_ids.to_device(device),
            &batch.attention_mask.to_device(device),
            true,
        );
        let loss = logits.cross_entropy_for_logits(&batch.labels.to_device(device));
        let world = self.plan.order.world;
        let mut scale = self.job.settings.grad_accum as f64;
        if world > 1 {
            scale *= batch.global_rows as f64 / (batch.rows * world) as f64;
        }
        (&loss / scale).backward();
        loss
    }

    /// The accumulated gradients, clipped, into one optimizer step; returns the step's
    /// learning rate and the gradient norm before clipping.
    fn optimizer_step(&mut self) -> Result<(f64, f64)> {
        let s = &self.job.settings;
        let (step, total) = (self.state.global_step, self.plan.total_steps);
        let lr = optim::learning_rate(s.schedule, s.lr, self.plan.warmup, step, total);
        if let Some(g) = &self.job.group {
            // Clipping and the step then see the same gradients on every rank.
            let started = Instant::now();
            let floats = self.opt.reduce_grads(self.looked_up.as_mut(), |t| {
                g.all_reduce_mean(t, "the gradients")
            })?;
            self.state.all_reduce_seconds += started.elapsed().as_secs_f64();
            self.state.all_reduce_bytes += 4.0 * floats as f64;
        }
        let norm = self.opt.grad_norm()?;
        if !norm.is_finite() {
            return Err(Error::Model(format!(
                "the gradient norm became {norm} at step {}; lower `lr`, or use fp32",
                step + 1
            )));
        }
        let scale = if s.max_grad_norm > 0.0 && norm > s.max_grad_norm {
            s.max_grad_norm / (norm + 1e-6)
        } else {
            1.0
        };
        self.opt.step(lr, scale)?;
        self.opt.zero_grad();
        self.state.global_step += 1;
        Ok((lr, norm))
    }

    /// Evaluates the validation split at `step`: logs the metrics, keeps the best weights by
    /// `best_metric`, and returns whether early stopping says to stop.
    fn validate(&mut self, step: u64) -> Result<bool> {
        let job = self.job;
        let s = &job.settings;
        let (pad_id, classes) = (self.plan.pad_id, self.plan.classes);
        let m = evaluate(
            self.model,
            &job.data.validation,
            s.eval_batch_size,
            pad_id,
            classes,
            job.group.as_deref(),
        )?;
        log(self.tracker, step, &prefixed("eval", &m))?;
        self.tracker.flush()?; // evaluations reach MLflow now, not at the next batch
        self.bar.println(format!(
            "step {step}: eval loss {:.4} accuracy {:.4} f1_macro {:.4}",
            m["loss"], m["accuracy"], m["f1_macro"]
        ));
        let value = m[&s.best_metric];
        if self
            .state
            .best
            .is_none_or(|(b, _)| improved(value, b, &s.best_metric, 0.0))
        {
            self.state.best = Some((value, step));
            if job.writes() {
                checkpoint::save_best(
                    &job.output,
                    self.opt.weights().to_device(tch::Device::Cpu),
                    self.state,
                )?;
            }
        }
        let Some(es) = &s.early_stopping else {
            return Ok(false);
        };
        let v = m[&es.metric];
        if self
            .state
            .stop_best
            .is_none_or(|b| improved(v, b, &es.metric, es.min_delta))
        {
            self.state.stop_best = Some(v);
            self.state.stale_evals = 0;
            return Ok(false);
        }
        self.state.stale_evals += 1;
        if self.state.stale_evals < es.patience {
            return Ok(false);
        }
        self.bar.println(format!(
            "early stopping at step {step}: eval {} has not improved for {} evaluations",
            es.metric, es.patience
        ));
        Ok(true)
    }
}

/// Whether `new` beats `old` by more than `delta` in `metric`'s direction.
fn improved(new: f64, old: f64, metric: &str, delta: f64) -> bool {
    if metrics::higher_is_better(metric) {
        new > old + delta
    } else {
        new < old - delta
    }
}

/// Training seconds: those of earlier epochs and runs, plus this epoch's wall time less the
/// time spent in evaluations and checkpoints.
struct Clock {
    before: f64,
    started: Instant,
}

impl Clock {
    fn new(before: f64) -> Self {
        Self {
            before,
            started: Instant::now(),
        }
    }

    fn seconds(&self) -> f64 {
        self.before + self.started.elapsed().as_secs_f64()
    }

    /// Runs `f` without counting its time.
    fn exclude<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let paused = Instant::now();
        let out = f();
        self.before -= paused.elapsed().as_secs_f64();
        out
    }
}

/// Since the last log line: its start, rows, micro-batches, and the loss summed on the
/// device (reading it every micro-batch would stall a GPU once per batch).
struct Window {
    started: Instant,
    rows: u64,
    micro: u64,
    loss_sum: Tensor,
}

impl Window {
    fn new(device: tch::Device) -> Self {
        Self {
            started: Instant::now(),
            rows: 0,
            micro: 0,
            loss_sum: Tensor::zeros([], (Kind::Float, device)),
        }
    }

    fn add(&mut self, rows: usize, loss: &Tensor) {
        self.rows += rows as u64;
        self.micro += 1;
        let _ = self.loss_sum.g_add_(&loss.detach());
    }

    /// The window's mean loss and speed, logged at `step` (`epoch`: epochs done, with the
    /// fraction of this one); then a new window starts.
    fn log(
        &mut self,
        tracker: &mut Tracker,
        bar: &ProgressBar,
        step: u64,
        lr: f64,
        norm: f64,
        epoch: f64,
    ) -> Result<()> {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let avg_loss = self.loss_sum.double_value(&[]) / self.micro.max(1) as f64;
        let rate = self.rows as f64 / secs;
        bar.set_message(format!("loss {avg_loss:.4} · {rate:.0} samples/s"));
        log(
            tracker,
            step,
            &[
                ("train/loss".into(), avg_loss),
                ("train/lr".into(), lr),
                ("train/grad_norm".into(), norm),
                ("train/samples_per_second".into(), rate),
                ("train/epoch".into(), epoch),
            ],
        )?;
        self.started = Instant::now();
        self.rows = 0;
        self.micro = 0;
        let _ = self.loss_sum.zero_();
        Ok(())
    }
}

/// Writes the HF model directory (`config.json` with the labels, `model.safetensors`,
/// the tokenizer files) next to `model/`, then renames it into place: a reader sees the old
/// directory or the complete new one, never a partial one. A mirrored run directory then
/// publishes it to the store, where its stamp does the same for readers.
fn save_model(job: &Job, model: &Model) -> Result<PathBuf> {
    let dest = job.output.path.join("model");
    let tmp = job
        .output
        .path
        .join(format!(".model.tmp-{}", std::process::id()));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| Error::io(format!("writing the model to {}", p.display()), e)
    };
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let config = model.config.with_labels(&job.data.labels);
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| Error::Internal(format!("config.json: {e}")))?;
    std::fs::write(tmp.join("config.json"), text).map_err(io(&tmp))?;
    model.save_weights(&tmp)?;
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "spm.model",
    ] {
        let src = job.model_dir.join(name);
        if src.is_file() {
            std::fs::copy(&src, tmp.join(name)).map_err(io(&tmp))?;
        }
    }
    let old = job
        .output
        .path
        .join(format!(".model.old-{}", std::process::id()));
    if dest.exists() {
        std::fs::rename(&dest, &old).map_err(io(&dest))?;
    }
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    if let Some(mirror) = &job.output.mirror {
        mirror
            .publish("model")
            .map_err(|e| Error::Model(format!("publishing the model: {e}")))?;
    }
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn changed_keys_name_settings_one_level_down_and_the_model_whole() {
        let before = json!({
            "model": { "url": "s3://lake/minilm/", "files": { "config.json": [612, "e1"] } },
            "settings": { "lr": 1e-4, "seed": 1 },
            "sql": "SELECT * FROM t",
        });
        let now = json!({
            "model": { "url": "s3://lake/minilm/", "files": { "config.json": [612, "e2"] } },
            "settings": { "lr": 2e-4, "seed": 1 },
            "sql": "SELECT * FROM t",
            "split": "part",
        });
        assert_eq!(
            super::changed_keys(&before, &now),
            ["model", "settings.lr", "split"]
        );
        assert!(super::changed_keys(&now, &now).is_empty());
    }
}
