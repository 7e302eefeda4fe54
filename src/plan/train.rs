//! Planning a `train` stage: settings checked and defaulted, the model directory and the
//! device checked, before any work.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::datatypes::{DataType, Schema};

use super::checks::{column_list, is_string};
use super::{Stage, query};
use crate::catalog::TableDef;
use crate::config::{Backend, DistributedSpec, Every as EverySpec, Precision, TrainSpec};
use crate::delta;
use crate::model::ModelConfig;
use crate::track::MlflowSettings;
use crate::train::{EarlyStopping, Every, METRIC_NAMES, TrainSettings};

/// A validated `train` stage.
#[derive(Debug)]
pub(crate) struct TrainStage {
    pub name: String,
    pub field: String,
    pub query: super::Query,
    pub model: PathBuf,
    /// The model's `config.json`, read once when the pipeline file is.
    pub config: ModelConfig,
    /// The run directory the trainer writes: `train.output`, or the cache's local copy of it
    /// when it is an object-store URL (`output_remote`), which it is mirrored to.
    pub output: PathBuf,
    pub output_remote: Option<crate::storage::Remote>,
    /// The id column as given (`id:`) or as the tokenize stage of this file that writes the
    /// table writes it; `None`: as the table's tokenize commit recorded it, else `id`
    /// (`plan::train::id_column`).
    pub id: Option<String>,
    /// The table of `from:`, where a recorded id column is looked up.
    pub from: Option<String>,
    pub split: String,
    pub labels: Option<Vec<String>>,
    pub device: tch::Device,
    pub mlflow: Option<MlflowSettings>,
    pub settings: TrainSettings,
    pub distributed: Distributed,
}

/// How the ranks of a data-parallel run talk (`train.distributed`); unused by a run alone.
#[derive(Debug, Clone)]
pub(crate) struct Distributed {
    /// How long a rendezvous or a collective waits for the other ranks.
    pub timeout: std::time::Duration,
    /// CUDA tensors go through NCCL (else everything through gloo).
    pub nccl: bool,
}

/// Checks `train.distributed` and picks the backend: `auto` is NCCL on CUDA where this
/// build has it, gloo otherwise.
fn distributed(f: &str, d: &DistributedSpec, device: tch::Device) -> Result<Distributed, String> {
    let timeout = crate::config::parse_duration(&d.timeout)
        .map_err(|e| format!("{f}.distributed.timeout: {e}"))?;
    if timeout.is_zero() {
        return Err(format!("{f}.distributed.timeout: must be more than 0s"));
    }
    let nccl = match (d.backend, device.is_cuda()) {
        (Backend::Nccl, false) => {
            return Err(format!(
                "{f}.distributed.backend: nccl runs on CUDA GPUs, and this stage trains on the \
                 CPU (`device`); use `gloo` or `auto`"
            ));
        }
        (Backend::Nccl, true) if !crate::runtime::NCCL_BUILT => {
            return Err(format!(
                "{f}.distributed.backend: this lakeml was built without NCCL (its build found \
                 no NCCL or CUDA headers next to libtorch); use `gloo`, or rebuild with \
                 scripts/env.sh's venv, which installs them"
            ));
        }
        (Backend::Nccl, true) => true,
        (Backend::Auto, cuda) => cuda && crate::runtime::NCCL_BUILT,
        (Backend::Gloo, _) => false,
    };
    Ok(Distributed { timeout, nccl })
}

fn every(field: &str, key: &str, e: &EverySpec) -> Result<Every, String> {
    match e {
        EverySpec::Steps(0) => Err(format!(
            "{field}.{key}: 0 steps; use a positive number, `epoch` or `none`"
        )),
        EverySpec::Steps(n) => Ok(Every::Steps(*n)),
        EverySpec::Word(w) if w == "epoch" => Ok(Every::Epoch),
        EverySpec::Word(w) if w == "none" => Ok(Every::Never),
        EverySpec::Word(w) => Err(format!(
            "{field}.{key}: `{w}` is not a schedule; use a number of steps, `epoch` or `none`"
        )),
    }
}

fn metric(field: &str, key: &str, name: &str) -> Result<String, String> {
    if METRIC_NAMES.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "{field}.{key}: `{name}` is not a metric; use one of {}",
            METRIC_NAMES.join(", ")
        ))
    }
}

pub(super) fn device(field: &str, spec: &str) -> Result<tch::Device, String> {
    let cuda = |i: usize| {
        if !tch::Cuda::is_available() {
            Err(format!(
                "{field}.device: `{spec}` asks for CUDA, but libtorch finds no CUDA GPU on this \
                 machine; use `device: cpu` (or `auto`, which picks CUDA when there is one)"
            ))
        } else if i >= tch::Cuda::device_count() as usize {
            Err(format!(
                "{field}.device: `{spec}`: this machine has {} CUDA device(s)",
                tch::Cuda::device_count()
            ))
        } else {
            Ok(tch::Device::Cuda(i))
        }
    };
    match spec {
        "auto" => Ok(tch::Device::cuda_if_available()),
        "cpu" => Ok(tch::Device::Cpu),
        "cuda" => cuda(0),
        other => match other.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => cuda(i),
            None => Err(format!(
                "{field}.device: `{other}` is not a device; use `auto`, `cpu`, `cuda` or `cuda:N`"
            )),
        },
    }
}

pub(super) fn train_stage(
    base: &Path,
    i: usize,
    t: TrainSpec,
    earlier: &[Stage],
    storage: &crate::storage::Defaults,
) -> Result<TrainStage, String> {
    let field = format!("stages[{i}].train");
    let f = field.as_str();
    let query = query(base, &t.source, f)?;
    let model = crate::storage::model_dir(base, &t.model, storage)
        .map_err(|m| format!("{f}.model: {m}"))?;
    let (output, output_remote) = crate::storage::run_dir(base, &t.output, storage)
        .map_err(|m| format!("{f}.output: {m}"))?;
    if !model.is_dir() {
        return Err(format!(
            "{f}.model: `{}` is not a directory; give an HF model directory (config.json, \
             model.safetensors, tokenizer.json)",
            model.display()
        ));
    }
    let config = ModelConfig::load(&model).map_err(|e| format!("{f}.model: {e}"))?;
    if !model.join("tokenizer.json").is_file() {
        return Err(format!(
            "{f}.model: `{}` has no tokenizer.json; the trained model is saved with its \
             tokenizer, so copy the tokenizer.json that made the table into it",
            model.display()
        ));
    }
    if !model.join("model.safetensors").is_file()
        && !model.join("model.safetensors.index.json").is_file()
    {
        return Err(format!(
            "{f}.model: `{}` has no model.safetensors (nor model.safetensors.index.json); \
             save the model with safetensors",
            model.display()
        ));
    }
    let device = device(f, &t.device)?;
    let positive = |key: &str, n: usize| {
        if n == 0 {
            Err(format!("{f}.{key}: must be at least 1"))
        } else {
            Ok(n)
        }
    };
    positive("batch_size", t.batch_size)?;
    positive("grad_accum", t.grad_accum)?;
    positive("prefetch", t.prefetch)?;
    positive("keep_checkpoints", t.keep_checkpoints)?;
    if let Some(key) = [("rank", &t.rank), ("world", &t.world)]
        .into_iter()
        .find_map(|(key, v)| v.is_some().then_some(key))
    {
        return Err(format!(
            "{f}.{key}: the launcher sets the ranks now; remove `rank` and `world`, and start \
             N data-parallel processes with `pipeline run FILE --nproc N` (or under torchrun)"
        ));
    }
    let distributed = distributed(f, &t.distributed, device)?;
    if !(t.lr > 0.0 && t.lr.is_finite()) {
        return Err(format!("{f}.lr: {} must be a positive number", t.lr));
    }
    if t.epochs == 0 && t.max_steps.is_none() {
        return Err(format!(
            "{f}.epochs: must be at least 1 (or set `max_steps`)"
        ));
    }
    if t.max_steps == Some(0) || t.log_every == 0 {
        return Err(format!(
            "{f}: `max_steps` and `log_every` must be at least 1"
        ));
    }
    if t.warmup_steps.is_some() && t.warmup_ratio.is_some() {
        return Err(format!(
            "{f}: give `warmup_steps` or `warmup_ratio`, not both"
        ));
    }
    if t.warmup_ratio.is_some_and(|r| !(0.0..1.0).contains(&r)) {
        return Err(format!("{f}.warmup_ratio: must be in [0, 1)"));
    }
    if t.max_grad_norm < 0.0 || t.weight_decay < 0.0 {
        return Err(format!(
            "{f}: `max_grad_norm` and `weight_decay` cannot be negative"
        ));
    }
    let eval_every = every(f, "eval_every", &t.eval_every)?;
    let checkpoint_every = every(f, "checkpoint_every", &t.checkpoint_every)?;
    let best_metric = metric(f, "best_metric", &t.best_metric)?;
    let early_stopping = match t.early_stopping {
        Some(es) => {
            if eval_every == Every::Never {
                return Err(format!(
                    "{f}.early_stopping: needs evaluations; set `eval_every` to `epoch` or a \
                     number of steps"
                ));
            }
            Some(EarlyStopping {
                metric: metric(f, "early_stopping.metric", &es.metric)?,
                patience: es.patience.max(1),
                min_delta: es.min_delta,
            })
        }
        None => None,
    };
    if let Some(labels) = &t.labels {
        let mut seen = std::collections::HashSet::new();
        if labels.len() < 2 || !labels.iter().all(|l| seen.insert(l.as_str())) {
            return Err(format!("{f}.labels: list at least two classes, each once"));
        }
    }
    let precision = match t.precision {
        Some(Precision::Int8) => {
            return Err(format!(
                "{f}.precision: int8 is for inference (predict, serve); train in fp32 or bf16"
            ));
        }
        Some(precision) => precision,
        None if device.is_cuda() => Precision::Bf16,
        None => Precision::Fp32,
    };
    // Ranks on one machine (`pipeline run --nproc`, torchrun) share its cores.
    let threads = t.threads.unwrap_or_else(|| {
        let local_ranks = crate::train::Launch::from_env()
            .ok()
            .flatten()
            .map_or(1, |l| l.local_world);
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        (cores / local_ranks).max(1)
    });
    // The id column of the tokenize stage in this file that writes the table read here.
    let id = t.id.or_else(|| {
        let from = t.source.from.as_ref()?;
        earlier.iter().rev().find_map(|s| match s {
            Stage::Tokenize(k) if &k.to == from => Some(k.policy.id.clone()),
            _ => None,
        })
    });
    Ok(TrainStage {
        name: t.name.unwrap_or_else(|| "train".into()),
        field,
        query,
        output,
        output_remote,
        model,
        config,
        id,
        from: t.source.from,
        split: t.split,
        labels: t.labels,
        device,
        distributed,
        mlflow: t.tracking.mlflow.map(|m| MlflowSettings {
            uri: m.uri,
            experiment: m.experiment,
            run_name: m.run_name,
        }),
        settings: TrainSettings {
            precision,
            seed: t.seed,
            epochs: t.epochs,
            max_steps: t.max_steps,
            batch_size: t.batch_size,
            eval_batch_size: t.eval_batch_size.unwrap_or(64).max(1),
            grad_accum: t.grad_accum,
            lr: t.lr,
            weight_decay: t.weight_decay,
            adam_beta1: t.adam_beta1,
            adam_beta2: t.adam_beta2,
            adam_eps: t.adam_eps,
            schedule: t.schedule,
            warmup_steps: t.warmup_steps,
            warmup_ratio: t.warmup_ratio,
            max_grad_norm: t.max_grad_norm,
            group_by_length: t.group_by_length,
            prefetch: t.prefetch,
            eval_every,
            checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            best_metric,
            save: t.save,
            early_stopping,
            log_every: t.log_every,
            threads: threads.max(1),
        },
    })
}

/// The id column a train stage reads: `id:`, else the tokenize stage of this file that
/// writes the `from:` table (both settled when the file loads), else the id column the
/// table's last tokenize commit recorded, else `id`.
pub(crate) async fn id_column(
    t: &TrainStage,
    tables: &BTreeMap<String, TableDef>,
) -> crate::error::Result<String> {
    if let Some(id) = &t.id {
        return Ok(id.clone());
    }
    if let Some(def) = t.from.as_ref().and_then(|from| tables.get(from))
        && let Some(table) = delta::open_target(def).await?
        && let Some(id) = delta::last_commit(&table)
            .await?
            .and_then(|c| c.tag)
            .and_then(|tag| tag.pointer("/extra/id").cloned())
            .and_then(|v| v.as_str().map(str::to_string))
    {
        return Ok(id);
    }
    Ok("id".into())
}

/// The columns a train stage reads: the id column `id` (integers or strings), `input_ids`
/// list of int32, an integer `label`, and the split column (strings).
pub(super) fn check_train_columns(t: &TrainStage, id: &str, schema: &Schema) -> Result<(), String> {
    let get =
        |name: &str| {
            schema.field_with_name(name).map(|f| f.data_type().clone()).map_err(|_| {
            format!(
                "{}: column `{name}` not found in the stage's query (columns: {}); train reads \
                 a tokenized table (its id column, input_ids, label, and the split column; \
                 `id:` names the id column)",
                t.field,
                column_list(schema)
            )
        })
        };
    let wrong = |name: &str, want: &str, got: &DataType| {
        Err(format!(
            "{}: column `{name}` is {got}, but train needs {want}",
            t.field
        ))
    };
    match get(id)? {
        ty if ty.is_integer() || is_string(&ty) => {}
        other => return wrong(id, "integers or strings (the id column)", &other),
    }
    match get("input_ids")? {
        DataType::List(item) if item.data_type() == &DataType::Int32 => {}
        other => {
            return wrong(
                "input_ids",
                "list<int32> (a tokenize stage's output)",
                &other,
            );
        }
    }
    match get("label")? {
        t if t.is_integer() => {}
        DataType::Null => {
            return Err(format!(
                "{}: column `label` is all null; training needs labels (tokenize with `label:`)",
                t.field
            ));
        }
        other => {
            return wrong(
                "label",
                "integer class ids (tokenize maps string labels)",
                &other,
            );
        }
    }
    match get(&t.split)? {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Ok(()),
        other => wrong(&t.split, "strings (train / validation / test)", &other),
    }
}

impl TrainStage {
    /// The device as written in settings and reports.
    pub(crate) fn device_name(&self) -> String {
        match self.device {
            tch::Device::Cpu => "cpu".into(),
            tch::Device::Cuda(i) => format!("cuda:{i}"),
            other => format!("{other:?}"),
        }
    }
}
