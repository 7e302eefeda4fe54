//! `pipeline run FILE --nproc N`: N ranks of the same command on this machine, as
//! `torchrun --standalone --nproc_per_node N` starts them. Each rank gets torchrun's
//! environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
//! and runs the pipeline as a rank of a data-parallel job (src/train/dist.rs).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long the other ranks get to stop by themselves (a collective fails within seconds
/// when a peer is gone) after one failed, before they are stopped.
const GRACE: Duration = Duration::from_secs(30);

/// Runs this process's own command line as `nproc` local ranks and waits for all of them.
/// Rank 0's output is this command's; the other ranks print only errors, each line led by
/// `[rank N]`.
pub fn run_local_ranks(nproc: usize) -> Result<()> {
    if std::env::var_os("RANK").is_some() {
        return Err(Error::Launch(
            "--nproc: this process is already a rank of a launched job (RANK is set); drop \
             --nproc under torchrun or another launcher"
                .into(),
        ));
    }
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("finding the pipeline binary to start the ranks", e))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("finding a free port for the rendezvous", e))?
        .port();
    let mut ranks: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("TORCHELASTIC_RESTART_COUNT");
        if rank > 0 {
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        }
        // SAFETY: prctl is async-signal-safe; a rank stops when this launcher dies.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop(&mut ranks);
                return Err(Error::io(format!("starting rank {rank}"), e));
            }
        };
        if let Some(err) = child.stderr.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(std::io::Result::ok) {
                    let _ = writeln!(std::io::stderr(), "[rank {rank}] {line}");
                }
            });
        }
        ranks.push(child);
    }
    wait_all(&mut ranks)
}

/// Waits for every rank; after the first failure the others get [`GRACE`] to stop.
fn wait_all(ranks: &mut [Child]) -> Result<()> {
    let mut status: Vec<Option<ExitStatus>> = vec![None; ranks.len()];
    let mut deadline = None;
    while status.iter().any(Option::is_none) {
        for (rank, child) in ranks.iter_mut().enumerate() {
            if status[rank].is_none()
                && let Ok(Some(s)) = child.try_wait()
            {
                status[rank] = Some(s);
                if !s.success() && deadline.is_none() {
                    deadline = Some(Instant::now() + GRACE);
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            stop(ranks);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let failed: Vec<(usize, ExitStatus)> = status
        .into_iter()
        .enumerate()
        .filter_map(|(rank, s)| s.filter(|s| !s.success()).map(|s| (rank, s)))
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    let how = |s: &ExitStatus| match (s.code(), s.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        _ => "failed".into(),
    };
    let text: Vec<String> = failed
        .iter()
        .map(|(rank, s)| format!("rank {rank} {}", how(s)))
        .collect();
    let message = format!(
        "{} of {} ranks failed: {} (each rank's own error is above)",
        failed.len(),
        ranks.len(),
        text.join(", ")
    );
    if failed.iter().all(|(_, s)| s.code() == Some(2)) {
        Err(Error::Launch(message))
    } else {
        Err(Error::Model(format!(
            "{message}; a rerun resumes from the last checkpoint"
        )))
    }
}

/// Stops the ranks still running: SIGTERM, then SIGKILL after 5 s.
fn stop(ranks: &mut [Child]) {
    let running = |c: &mut Child| matches!(c.try_wait(), Ok(None));
    for child in ranks.iter_mut() {
        if running(child) {
            // SAFETY: signalling our own child, by its pid.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
    }
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until && ranks.iter_mut().any(running) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for child in ranks.iter_mut() {
        if running(child) {
            let _ = child.kill();
        }
    }
}
