//! lakeml: fine-tune and serve Hugging Face text classifiers on lakehouse tables.
//!
//! A pipeline file names tables (Delta, Parquet, CSV, JSON lines) and stages; each stage reads
//! SQL over those tables and writes a Delta table in one commit; `pipeline serve` exposes the
//! tables and models over Arrow Flight SQL. See the README for the file format and the
//! server, and ARCHITECTURE.md for the data flow, the layers and the scaling model.
//!
//! ```no_run
//! # async fn demo() -> lakeml::Result<()> {
//! let pipeline = lakeml::Pipeline::load("pipelines/train.yaml")?;
//! for report in pipeline.run(&lakeml::RunOptions::new()).await? {
//!     println!("{report}");
//! }
//! # Ok(())
//! # }
//! ```

mod catalog;
mod config;
mod cpu;
mod delta;
mod error;
mod fingerprint;
mod gemm;
mod jobs;
mod launch;
mod model;
mod plan;
mod predict;
mod query;
mod report;
mod runtime;
mod serve;
mod stages;
mod storage;
mod tokenize;
mod track;
mod train;
mod vector;

pub use error::{Error, Result};
pub use gemm::{GemmInfo, mkl_cpu_check, set_mkl_override};
pub use jobs::{JobOverview, RunRecord, RunState, TriggerOutcome, WatchedTable, format_runs};
pub use launch::run_local_ranks;
pub use plan::Pipeline;
pub use report::StageReport;
pub use runtime::{RuntimeInfo, check_libtorch};
pub use serve::{ServeOptions, hash_password};
pub use stages::RunOptions;
pub use tokenize::{Encoded, Encoder, EncoderSettings};
