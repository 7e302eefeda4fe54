//! The library's one error type: each variant says whose fault it is.

use std::path::PathBuf;

/// Everything that can go wrong in lakeml, by whose fault it is.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline file is wrong: fix the file (CLI exit code 2).
    #[error("{file}: {message}")]
    Config { file: PathBuf, message: String },

    /// The launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is wrong: fix how
    /// the ranks are started (CLI exit code 2).
    #[error("{0}")]
    Launch(String),

    /// The data is wrong: a row, a column or a table does not meet what the stage needs.
    #[error("{0}")]
    Data(String),

    /// Reading or writing a file failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A query failed in the SQL engine.
    #[error("{context}: {source}")]
    Engine {
        context: String,
        #[source]
        source: Box<datafusion::error::DataFusionError>,
    },

    /// A Delta table could not be read or committed.
    #[error("{context}: {source}")]
    Delta {
        context: String,
        #[source]
        source: Box<deltalake::DeltaTableError>,
    },

    /// A tokenizer could not be loaded or failed on an input.
    #[error("{0}")]
    Tokenizer(String),

    /// A model directory is unusable, or the model failed (out of memory, no CUDA).
    #[error("{0}")]
    Model(String),

    /// Experiment tracking failed: the MLflow server refused or could not be reached.
    #[error("{0}")]
    Tracking(String),

    /// A bug in lakeml: please report it.
    #[error("internal error (a bug in lakeml, please report it): {0}")]
    Internal(String),
}

/// `Result` with lakeml's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// True when the fault is in the pipeline file or the command line (exit code 2).
    pub fn is_usage(&self) -> bool {
        matches!(self, Error::Config { .. } | Error::Launch(_))
    }

    pub(crate) fn config(file: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config {
            file: file.into(),
            message: message.into(),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn engine(
        context: impl Into<String>,
        source: datafusion::error::DataFusionError,
    ) -> Self {
        Error::Engine {
            context: context.into(),
            source: Box::new(source),
        }
    }

    pub(crate) fn delta(context: impl Into<String>, source: deltalake::DeltaTableError) -> Self {
        Error::Delta {
            context: context.into(),
            source: Box::new(source),
        }
    }
}
