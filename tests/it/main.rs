//! Integration tests: the real `pipeline` binary on real tables, checked by real peers
//! (`deltalake` and `transformers` from PyPI, installed by scripts/test.sh).

mod cli;
mod common;
mod distributed;
mod docs;
mod embed;
mod jobs;
mod layers;
mod mlflow;
#[path = "../support/mlflow_server.rs"]
mod mlflow_server;
mod predict;
mod real_data;
mod serve;
mod serving;
mod spark;
mod storage;
mod storage_files;
mod storage_jobs;
mod tokenize;
mod train;
mod wheel;
