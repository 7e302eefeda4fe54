//! `pipeline`: the lakeml command line. Parses flags, calls the library, reports errors.
//! Exit codes: 0 success, 1 the job failed, 2 bad usage or a bad pipeline file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lakeml::{Pipeline, RunOptions, RuntimeInfo, ServeOptions, hash_password};

#[derive(Parser)]
#[command(
    name = "pipeline",
    version,
    about = "Fine-tune and serve HF text classifiers on lakehouse tables"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Let MKL take its generic fp32 path on non-Intel CPUs, as it does outside lakeml
    /// (also LAKEML_MKL_OVERRIDE=0). By default lakeml answers MKL's CPU-vendor check so
    /// that fp32 products use the CPU's AVX2/AVX-512 kernels; see `pipeline info`.
    #[arg(long, global = true)]
    no_mkl_override: bool,
}

/// MKL (inside libtorch) asks this whether the CPU is Intel's before it picks its fp32
/// kernels. build.rs exports it from the binary, so the dynamic linker binds MKL's call here
/// instead of to MKL's own copy; the answer is `lakeml::gemm`'s.
#[unsafe(no_mangle)]
pub extern "C" fn mkl_serv_intel_cpu_true() -> std::ffi::c_int {
    lakeml::mkl_cpu_check()
}

#[derive(Subcommand)]
enum Command {
    /// Validate a pipeline file, then run its stages in order.
    Run {
        /// The pipeline file (YAML).
        file: PathBuf,
        /// Rerun every stage, even those whose output is up to date.
        #[arg(long)]
        force: bool,
        /// Print each stage's report as a JSON line on stdout.
        #[arg(long)]
        json: bool,
        /// No progress bars (reports are still printed).
        #[arg(long, short)]
        quiet: bool,
        /// Run only this stage (repeat for several; they run in file order). The others
        /// are still validated.
        #[arg(long = "stage", value_name = "NAME")]
        stages: Vec<String>,
        /// Train data-parallel on N local processes (ranks), as `torchrun --standalone
        /// --nproc_per_node N` would; each takes its share of the cores. Under torchrun or
        /// another launcher, leave it out: its environment (RANK, WORLD_SIZE, ...) is used.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
        nproc: Option<u16>,
    },
    /// Check a pipeline file (keys, files, tables, columns, types) without running it.
    Validate {
        /// The pipeline file (YAML).
        file: PathBuf,
    },
    /// Run a SQL query over a pipeline's tables and print the result.
    Sql {
        /// The pipeline file (YAML) whose tables the query reads.
        file: PathBuf,
        /// The query, e.g. "SELECT label, count(*) FROM predictions GROUP BY label".
        query: String,
    },
    /// Serve a pipeline's tables and models over Arrow Flight SQL (its `serve:` section)
    /// until SIGINT or SIGTERM.
    Serve {
        /// The pipeline file (YAML) with a `serve:` section.
        file: PathBuf,
        /// Listen here instead of `serve.listen` (host:port; port 0 picks a free one).
        #[arg(long)]
        listen: Option<String>,
    },
    /// Run the file's `jobs` when their triggers fire (cron, interval, new table data),
    /// recording every run in the run history, until SIGTERM or SIGINT.
    Schedule {
        /// The pipeline file (YAML) with a `jobs:` section.
        file: PathBuf,
    },
    /// Show each job: its triggers, next 5 fire times and last run.
    Jobs {
        file: PathBuf,
        /// One JSON object per job, one per line.
        #[arg(long)]
        json: bool,
    },
    /// Show the run history, newest first: each attempt in its latest state.
    Runs {
        file: PathBuf,
        /// Only this job's runs.
        #[arg(long)]
        job: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// One JSON object per attempt, one per line.
        #[arg(long)]
        json: bool,
    },
    /// Run one job now, in the foreground, recorded as a manual run. Exit 0 when it
    /// succeeded, 1 when it failed (for Airflow, Dagster or cron to call).
    Trigger {
        file: PathBuf,
        job: String,
        /// Print the run's history row as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Read a password on stdin and print its argon2 hash, for a `serve` users file.
    HashPassword,
    /// Show what this build links (libtorch, threads, CUDA devices) and how fast its GEMMs
    /// run here at each precision.
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `println!` to stdout, but a reader that went away (`pipeline runs FILE | head`) ends the
/// program quietly with exit 0, as ripgrep does, instead of `println!`'s panic on EPIPE.
macro_rules! outln {
    ($($arg:tt)*) => { emit(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` with the same care.
macro_rules! out {
    ($($arg:tt)*) => { emit(format_args!($($arg)*)) };
}

fn emit(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            ExitCode::from(if e.is_usage() { 2 } else { 1 })
        }
    }
}

/// A forward pass allocates and frees the same large tensors batch after batch (a
/// feed-forward activation of a 4,096-token batch is 25 MB). glibc serves blocks that large
/// with a fresh `mmap` and unmaps them on free, so every pass page-faults and zeroes its
/// memory anew: 11% of an int8 pass here. Never mapping blocks of their own, and never
/// trimming the heap, lets the next pass reuse the memory the last one freed; the peak is
/// the same (glibc's tunables `glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...`).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc allocator parameters; it runs before any other thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, std::ffi::c_int::MAX);
    }
}

fn run(cli: Cli) -> lakeml::Result<()> {
    lakeml::check_libtorch()?;
    if cli.no_mkl_override {
        lakeml::set_mkl_override(false);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| lakeml::Error::Internal(format!("cannot start the async runtime: {e}")))?;
    match cli.command {
        Command::Run {
            file,
            force,
            json,
            quiet,
            stages,
            nproc,
        } => {
            let pipeline = Pipeline::load(&file)?;
            if let Some(n) = nproc.filter(|&n| n > 1)
                && std::env::var_os("RANK").is_none()
            {
                // The file was checked once here; the ranks run it.
                drop(runtime);
                return lakeml::run_local_ranks(usize::from(n));
            }
            let options = RunOptions::new()
                .with_force(force)
                .with_progress(!quiet)
                .with_stages(stages);
            let reports = runtime.block_on(pipeline.run(&options))?;
            for report in &reports {
                if json {
                    outln!("{}", serde_json::to_string(report).unwrap_or_default());
                } else {
                    outln!("{report}");
                }
            }
            if !json {
                let summary = pipeline.summary(&reports);
                if !summary.is_empty() {
                    outln!("{summary}");
                }
            }
            Ok(())
        }
        Command::Sql { file, query } => {
            let pipeline = Pipeline::load(&file)?;
            let batches = runtime.block_on(pipeline.sql(&query))?;
            let table = arrow::util::pretty::pretty_format_batches(&batches)
                .map_err(|e| lakeml::Error::Internal(format!("printing the result: {e}")))?;
            outln!("{table}");
            Ok(())
        }
        Command::Validate { file } => {
            let pipeline = Pipeline::load(&file)?;
            runtime.block_on(pipeline.validate())?;
            outln!(
                "{}: pipeline `{}` is valid",
                file.display(),
                pipeline.name()
            );
            Ok(())
        }
        Command::Serve { file, listen } => {
            let pipeline = Pipeline::load(&file)?;
            runtime.block_on(pipeline.serve(&ServeOptions::new().with_listen(listen)))
        }
        Command::Schedule { file } => {
            let pipeline = Pipeline::load(&file)?;
            runtime.block_on(pipeline.schedule())
        }
        Command::Jobs { file, json } => {
            let pipeline = Pipeline::load(&file)?;
            for job in runtime.block_on(pipeline.jobs_overview())? {
                if json {
                    outln!("{}", serde_json::to_string(&job).unwrap_or_default());
                } else {
                    outln!("{job}");
                }
            }
            Ok(())
        }
        Command::Runs {
            file,
            job,
            limit,
            json,
        } => {
            let pipeline = Pipeline::load(&file)?;
            let runs = runtime.block_on(pipeline.runs(job.as_deref(), limit))?;
            if json {
                for run in &runs {
                    outln!("{}", serde_json::to_string(run).unwrap_or_default());
                }
            } else {
                out!("{}", lakeml::format_runs(&runs));
            }
            Ok(())
        }
        Command::Trigger { file, job, json } => {
            let pipeline = Pipeline::load(&file)?;
            let outcome = runtime.block_on(pipeline.trigger(&job))?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string(&outcome.run).unwrap_or_default()
                );
            } else {
                out!(
                    "{}",
                    lakeml::format_runs(std::slice::from_ref(&outcome.run))
                );
            }
            if outcome.succeeded() {
                Ok(())
            } else {
                Err(lakeml::Error::Data(format!(
                    "job `{job}` {}: {}",
                    outcome.run.state.as_str(),
                    outcome
                        .run
                        .error
                        .as_deref()
                        .or(outcome.run.reason.as_deref())
                        .unwrap_or("see the run history")
                )))
            }
        }
        Command::HashPassword => {
            let mut password = String::new();
            std::io::stdin()
                .read_line(&mut password)
                .map_err(|e| lakeml::Error::Internal(format!("reading stdin: {e}")))?;
            let password = password.trim_end_matches(['\n', '\r']);
            if password.is_empty() {
                return Err(lakeml::Error::Data(
                    "no password on stdin; e.g. `read -s P && echo \"$P\" | pipeline \
                     hash-password`"
                        .into(),
                ));
            }
            outln!("{}", hash_password(password)?);
            Ok(())
        }
        Command::Info { json } => {
            let info = RuntimeInfo::detect();
            if json {
                outln!("{}", serde_json::to_string(&info).unwrap_or_default());
            } else {
                outln!("{info}");
            }
            Ok(())
        }
    }
}
