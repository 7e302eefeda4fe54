//! Data parallelism across processes and machines, on libtorch's own c10d: a `TCPStore`
//! for rendezvous, a `ProcessGroupGloo` for the collectives on CPU tensors, and a
//! `ProcessGroupNCCL` for those on CUDA tensors, as `torch.distributed` and DDP use them.
//! tch binds none of c10d, so csrc/c10d/ (compiled by build.rs) puts a C ABI over them;
//! this module is its only caller and gives it a safe API.
//!
//! A launcher says who is who through torchrun's environment ([`Launch::from_env`]):
//! `pipeline run --nproc N` sets it for N local ranks, and `torchrun`, TorchDistributor, a
//! Kubernetes PyTorchJob or Slurm (through torchrun) set it the same way. A single-process
//! run never reaches this module.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::net::{ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::error::{Error, Result};

unsafe extern "C" {
    fn lk_c10d_free_err(e: *mut c_char);
    #[allow(clippy::too_many_arguments)]
    fn lk_c10d_group_new(
        host: *const c_char,
        port: c_int,
        is_server: c_int,
        prefix: *const c_char,
        rank: c_int,
        world: c_int,
        timeout_ms: c_int,
        iface: *const c_char,
        bind_host: *const c_char,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn lk_c10d_group_free(g: *mut c_void, failed: c_int);
    fn lk_c10d_allreduce_sum(g: *mut c_void, t: *mut torch_sys::C_tensor) -> *mut c_char;
    fn lk_c10d_broadcast(g: *mut c_void, t: *mut torch_sys::C_tensor, root: c_int) -> *mut c_char;
    fn lk_c10d_store_set(g: *mut c_void, key: *const c_char) -> *mut c_char;
    fn lk_c10d_store_check(g: *mut c_void, key: *const c_char, present: *mut c_int) -> *mut c_char;
}

#[cfg(lakeml_nccl)]
unsafe extern "C" {
    fn lk_c10d_nccl_new(
        gloo: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        world: c_int,
        timeout_ms: c_int,
        device: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// The shim's error string, owned (and freed on the C side), or `None` for success.
fn taken(err: *mut c_char) -> std::result::Result<(), String> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us.
    let text = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .trim()
        .to_string();
    unsafe { lk_c10d_free_err(err) };
    Err(text)
}

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Launch(format!("{what} `{s}` contains a NUL byte")))
}

/// Who this process is in a data-parallel job, from torchrun's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Launch {
    pub rank: usize,
    pub world: usize,
    /// This rank among those on its machine (`LOCAL_RANK`): its GPU, with CUDA.
    pub local_rank: usize,
    /// Ranks on this machine (`LOCAL_WORLD_SIZE`): they share its cores.
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The launcher's agent hosts the store (`TORCHELASTIC_USE_AGENT_STORE`): every rank,
    /// rank 0 too, connects to it as a client.
    pub agent_store: bool,
    /// torchrun's restart count: each attempt rendezvouses under its own keys.
    pub attempt: u64,
}

impl Launch {
    /// `RANK` and `WORLD_SIZE` (with `MASTER_ADDR`, `MASTER_PORT`), or `None` when they are
    /// unset or the world is one process.
    pub(crate) fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let (Some(rank), Some(world)) = (var("RANK"), var("WORLD_SIZE")) else {
            return Ok(None);
        };
        let number = |name: &str, text: &str| {
            text.trim().parse::<usize>().map_err(|_| {
                Error::Launch(format!(
                    "{name}={text:?} is not a number; a launcher (`pipeline run --nproc`, \
                     torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                ))
            })
        };
        let (rank, world) = (number("RANK", &rank)?, number("WORLD_SIZE", &world)?);
        if world <= 1 {
            return Ok(None);
        }
        if rank >= world {
            return Err(Error::Launch(format!(
                "RANK={rank} must be below WORLD_SIZE={world}"
            )));
        }
        let need = |name: &str| {
            var(name).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                Error::Launch(format!(
                    "WORLD_SIZE={world} but {name} is not set: every rank needs MASTER_ADDR \
                     and MASTER_PORT, the address of rank 0 (or of the launcher's store)"
                ))
            })
        };
        let master_addr = need("MASTER_ADDR")?.trim().to_string();
        let port = need("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| Error::Launch(format!("MASTER_PORT={port:?} is not a port number")))?;
        let local_world = match var("LOCAL_WORLD_SIZE") {
            Some(n) => number("LOCAL_WORLD_SIZE", &n)?.max(1),
            None => 1,
        };
        let local_rank = match var("LOCAL_RANK") {
            Some(n) => number("LOCAL_RANK", &n)?,
            None => 0,
        };
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let attempt = var("TORCHELASTIC_RESTART_COUNT")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        Ok(Some(Launch {
            rank,
            world,
            local_rank,
            local_world,
            master_addr,
            master_port,
            agent_store,
            attempt,
        }))
    }

    /// The address gloo binds: the one this machine reaches `MASTER_ADDR` from (a host name
    /// may resolve to loopback, which other machines cannot reach).
    fn bind_host(&self) -> Result<String> {
        let route = || -> std::io::Result<String> {
            let to = (self.master_addr.as_str(), self.master_port)
                .to_socket_addrs()?
                .next()
                .ok_or_else(|| std::io::Error::other("no address"))?;
            let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let socket = UdpSocket::bind(any)?;
            socket.connect(to)?;
            Ok(socket.local_addr()?.ip().to_string())
        };
        route().map_err(|e| {
            Error::Launch(format!(
                "MASTER_ADDR={}: no route to it from this machine ({e}); check the address, \
                 or name the network interface gloo should use in GLOO_SOCKET_IFNAME",
                self.master_addr
            ))
        })
    }
}

/// A joined process group: collectives over every rank, in place on tensors. CPU tensors go
/// through gloo; CUDA tensors through NCCL when the group has it (else gloo, which copies
/// them through the host).
pub(crate) struct Group {
    ptr: *mut c_void,
    /// The NCCL process group on the same store, or null.
    nccl: *mut c_void,
    /// This rank's GPU, with NCCL.
    pub device: Option<tch::Device>,
    pub rank: usize,
    pub world: usize,
    timeout: Duration,
    agent_store: bool,
    /// A collective failed: leaving aborts instead of waiting for the others.
    failed: AtomicBool,
}

// SAFETY: c10d process groups and stores are thread-safe; the trainer calls one collective
// at a time, from one thread at a time.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        let failed = c_int::from(self.failed.load(Ordering::Relaxed));
        // SAFETY: both came from the shim and are freed once, NCCL's first (it keeps its
        // keys in gloo's store).
        unsafe {
            if !self.nccl.is_null() {
                lk_c10d_group_free(self.nccl, failed);
            }
            lk_c10d_group_free(self.ptr, failed);
        }
    }
}

impl Group {
    /// Joins the job `launch` describes, waiting up to `timeout` for every rank. Rank 0
    /// hosts the store unless the launcher's agent does. With `nccl`, CUDA tensors go
    /// through NCCL on the rank's GPU (`LOCAL_RANK` among the visible ones). Blocking.
    pub(crate) fn join(launch: &Launch, timeout: Duration, nccl: bool) -> Result<Group> {
        let iface = std::env::var("GLOO_SOCKET_IFNAME").unwrap_or_default();
        let bind_host = if iface.is_empty() {
            launch.bind_host()?
        } else {
            String::new()
        };
        let host = c_string("MASTER_ADDR", &launch.master_addr)?;
        let prefix = c_string("prefix", &format!("lakeml/attempt-{}", launch.attempt))?;
        let iface_c = c_string("GLOO_SOCKET_IFNAME", &iface)?;
        let bind_c = c_string("bind address", &bind_host)?;
        let timeout_ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `ptr` is written on success only.
        let err = unsafe {
            lk_c10d_group_new(
                host.as_ptr(),
                c_int::from(launch.master_port),
                c_int::from(launch.rank == 0 && !launch.agent_store),
                prefix.as_ptr(),
                launch.rank as c_int,
                launch.world as c_int,
                timeout_ms,
                iface_c.as_ptr(),
                bind_c.as_ptr(),
                &raw mut ptr,
            )
        };
        taken(err).map_err(|e| {
            let at = format!("{}:{}", launch.master_addr, launch.master_port);
            let hint = if e.contains("EADDRINUSE") || e.contains("address already in use") {
                format!(
                    "port {} is in use on this machine: pick another MASTER_PORT (`pipeline \
                     run --nproc` picks a free one)",
                    launch.master_port
                )
            } else if e.contains("waiting for clients") || e.contains("wait for") {
                format!(
                    "not every one of the {} ranks joined within {}: start all of them \
                     (WORLD_SIZE = {}), with the same MASTER_ADDR and MASTER_PORT, or raise \
                     `train.distributed.timeout`",
                    launch.world,
                    humanize(timeout),
                    launch.world
                )
            } else if e.contains("connect") {
                format!(
                    "rank 0 did not answer at {at} within {}: is it running, and is the \
                     address reachable from here?",
                    humanize(timeout)
                )
            } else {
                "check that every rank runs the same lakeml with the same WORLD_SIZE, \
                 MASTER_ADDR and MASTER_PORT"
                    .into()
            };
            Error::Model(format!(
                "rank {} of {} could not join the process group at {at}: {e}; {hint}; \
                 nothing was trained or written",
                launch.rank, launch.world
            ))
        })?;
        let mut group = Group {
            ptr,
            nccl: std::ptr::null_mut(),
            device: None,
            rank: launch.rank,
            world: launch.world,
            timeout,
            agent_store: launch.agent_store,
            failed: AtomicBool::new(false),
        };
        if nccl {
            group.join_nccl(launch)?;
        }
        Ok(group)
    }

    /// Adds an NCCL process group, on the same store, for CUDA tensors. Training is always
    /// seeded to be repeatable, so NCCL's NVLS algorithm, whose reductions are not, is left
    /// out (`NCCL_ALGO=^NVLS`) unless NCCL_ALGO is set.
    #[cfg(lakeml_nccl)]
    fn join_nccl(&mut self, launch: &Launch) -> Result<()> {
        let gpus = tch::Cuda::device_count().max(1) as usize;
        let index = launch.local_rank % gpus;
        let prefix = c_string("prefix", "nccl")?;
        let timeout_ms = c_int::try_from(self.timeout.as_millis()).unwrap_or(c_int::MAX);
        let mut out = std::ptr::null_mut();
        // SAFETY: `self.ptr` is a live group; valid pointers for the call.
        let err = unsafe {
            lk_c10d_nccl_new(
                self.ptr,
                prefix.as_ptr(),
                self.rank as c_int,
                self.world as c_int,
                timeout_ms,
                index as c_int,
                &raw mut out,
            )
        };
        taken(err).map_err(|e| {
            Error::Model(format!(
                "rank {} of {}: NCCL on cuda:{index} ({gpus} GPU(s) visible): {e}; check the \
                 GPUs (nvidia-smi), or use `distributed.backend: gloo`",
                self.rank, self.world
            ))
        })?;
        self.nccl = out;
        self.device = Some(tch::Device::Cuda(index));
        Ok(())
    }

    #[cfg(not(lakeml_nccl))]
    fn join_nccl(&mut self, _: &Launch) -> Result<()> {
        Err(Error::Internal(
            "NCCL was asked of a build without it; the plan should have refused".into(),
        ))
    }

    /// The process group for `t`'s device.
    fn backend_for(&self, t: &Tensor) -> *mut c_void {
        if !self.nccl.is_null() && t.device().is_cuda() {
            self.nccl
        } else {
            self.ptr
        }
    }

    /// Sums `t` (dense, contiguous) over every rank, in place.
    pub(crate) fn all_reduce_sum(&self, t: &mut Tensor, what: &str) -> Result<()> {
        // SAFETY: `t` is a live tensor; the shim does not keep the pointer.
        let err = unsafe { lk_c10d_allreduce_sum(self.backend_for(t), t.as_mut_ptr()) };
        taken(err).map_err(|e| self.failure("all-reduce", what, &e))
    }

    /// Averages `t` over every rank, in place.
    pub(crate) fn all_reduce_mean(&self, t: &mut Tensor, what: &str) -> Result<()> {
        self.all_reduce_sum(t, what)?;
        let _ = t.g_div_scalar_(self.world as f64);
        Ok(())
    }

    /// Gives every rank rank 0's values of `t`, in place.
    pub(crate) fn broadcast(&self, t: &mut Tensor, what: &str) -> Result<()> {
        // SAFETY: as in all_reduce_sum.
        let err = unsafe { lk_c10d_broadcast(self.backend_for(t), t.as_mut_ptr(), 0) };
        taken(err).map_err(|e| self.failure("broadcast", what, &e))
    }

    /// Rank 0's `bytes` on every rank (the others pass anything).
    pub(crate) fn broadcast_bytes(&self, bytes: &[u8], what: &str) -> Result<Vec<u8>> {
        let mut len = Tensor::from_slice(&[bytes.len() as i64]);
        self.broadcast(&mut len, what)?;
        let n = len.int64_value(&[0]).max(0) as usize;
        let mut data = if self.rank == 0 {
            Tensor::from_slice(bytes)
        } else {
            Tensor::zeros([n as i64], (Kind::Uint8, tch::Device::Cpu))
        };
        self.broadcast(&mut data, what)?;
        Ok(Vec::<u8>::try_from(&data).unwrap_or_default())
    }

    /// Which ranks answer on `what`, per rank: `flags[r]` is rank r's own value; every rank
    /// gets them all.
    pub(crate) fn gather_flags(&self, mine: bool, what: &str) -> Result<Vec<bool>> {
        let mut flags = Tensor::zeros([self.world as i64], (Kind::Int64, tch::Device::Cpu));
        if mine {
            let _ = flags.get(self.rank as i64).fill_(1);
        }
        self.all_reduce_sum(&mut flags, what)?;
        let values = Vec::<i64>::try_from(&flags).unwrap_or_default();
        Ok(values.into_iter().map(|v| v != 0).collect())
    }

    /// Refuses to go on unless every rank's `value` equals rank 0's; `what` names it.
    pub(crate) fn agree(&self, value: &str, what: &str) -> Result<()> {
        let theirs = self.broadcast_bytes(value.as_bytes(), what)?;
        let differs = self.gather_flags(theirs != value.as_bytes(), what)?;
        let ranks: Vec<String> = (0..self.world)
            .filter(|&r| differs.get(r).copied().unwrap_or(false))
            .map(|r| r.to_string())
            .collect();
        if ranks.is_empty() {
            return Ok(());
        }
        Err(Error::Launch(format!(
            "rank {} of {}: rank(s) {} differ from rank 0 in their {what}; every rank must run \
             the same pipeline file, options and input tables; nothing was trained",
            self.rank,
            self.world,
            ranks.join(", ")
        )))
    }

    /// Sets `key` in the group's store, for [`Group::wait`].
    pub(crate) fn signal(&self, key: &str) -> Result<()> {
        let k = c_string("key", key)?;
        // SAFETY: valid pointers for the call.
        taken(unsafe { lk_c10d_store_set(self.ptr, k.as_ptr()) })
            .map_err(|e| Error::Model(format!("rank {}: the rendezvous store: {e}", self.rank)))
    }

    /// Waits, without a time limit, until rank 0 sets `key` (it is working on `what`), or
    /// fails when rank 0's store is gone (it failed, or was stopped).
    pub(crate) async fn wait(&self, key: &str, what: &str) -> Result<()> {
        let k = c_string("key", key)?;
        loop {
            let mut present = 0;
            // SAFETY: valid pointers for the call.
            let err = unsafe { lk_c10d_store_check(self.ptr, k.as_ptr(), &raw mut present) };
            if let Err(e) = taken(err) {
                return Err(Error::Model(format!(
                    "rank {} of {}: rank 0 stopped while running {what} ({e}); its own error \
                     says why",
                    self.rank, self.world
                )));
            }
            if present != 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The error for a failed collective, naming the ranks that are gone: survivors mark
    /// themselves in the store and give the others a few seconds to do the same.
    fn failure(&self, op: &str, what: &str, cause: &str) -> Error {
        self.failed.store(true, Ordering::Relaxed);
        let diagnosis = self.lost_ranks();
        Error::Model(format!(
            "the {op} of {what} across {} ranks failed on rank {}: {diagnosis} ({cause})",
            self.world, self.rank
        ))
    }

    fn lost_ranks(&self) -> String {
        let key = |r: usize| CString::new(format!("alive/{r}")).unwrap_or_default();
        let store_gone = || {
            if self.agent_store {
                "the launcher's store is gone, so the job is over".to_string()
            } else {
                "rank 0, which hosts the rendezvous store, is lost".to_string()
            }
        };
        // SAFETY: valid pointers for the call.
        if taken(unsafe { lk_c10d_store_set(self.ptr, key(self.rank).as_ptr()) }).is_err() {
            return store_gone();
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let mut missing = Vec::new();
            for r in (0..self.world).filter(|&r| r != self.rank) {
                let mut present = 0;
                // SAFETY: as above.
                let err =
                    unsafe { lk_c10d_store_check(self.ptr, key(r).as_ptr(), &raw mut present) };
                if taken(err).is_err() {
                    // A write to a closed socket can still succeed once; the next one fails.
                    return store_gone();
                }
                if present == 0 {
                    missing.push(r.to_string());
                }
            }
            if missing.is_empty() {
                return format!(
                    "every rank is still running, so one was slower than the {} timeout; \
                     raise `train.distributed.timeout`",
                    humanize(self.timeout)
                );
            }
            if Instant::now() >= deadline {
                let (s, verb) = if missing.len() == 1 {
                    ("", "is")
                } else {
                    ("s", "are")
                };
                return format!(
                    "rank{s} {} {verb} lost (exited, killed or stopped)",
                    missing.join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 && s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn torchrun_environment() {
        assert_eq!(Launch::from_vars(vars(&[])).ok(), Some(None));
        assert_eq!(
            Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).ok(),
            Some(None),
            "a world of one is a plain run"
        );
        let launch = Launch::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]));
        assert_eq!(
            launch.ok().flatten(),
            Some(Launch {
                rank: 1,
                world: 4,
                local_rank: 1,
                local_world: 2,
                master_addr: "10.0.0.5".into(),
                master_port: 29500,
                agent_store: true,
                attempt: 2,
            })
        );
        for (bad, needle) in [
            (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "must be below"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_ADDR"),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "0"),
                ],
                "MASTER_PORT",
            ),
        ] {
            let err = Launch::from_vars(vars(&bad)).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains(needle)),
                "{bad:?}: {err:?}"
            );
        }
    }
}
