//! What the linked libtorch offers on this machine (`pipeline info`), and whether the
//! libtorch the dynamic linker found is the version this binary was built against.

use std::path::{Path, PathBuf};

use crate::gemm::GemmInfo;
use crate::{Error, Result};

/// Whether this build has c10d's NCCL backend: build.rs compiles it where libtorch has CUDA
/// and NCCL's and CUDA's headers are installed (scripts/env.sh installs them).
pub(crate) const NCCL_BUILT: bool = cfg!(lakeml_nccl);

/// Facts about the linked libtorch and this machine.
#[derive(Debug, serde::Serialize)]
pub struct RuntimeInfo {
    pub lakeml_version: &'static str,
    /// The libtorch the binary was built against (version, library directory).
    pub libtorch_version: &'static str,
    pub libtorch_lib: &'static str,
    /// The directory the dynamic linker loaded libtorch from (a wheel install: the
    /// environment's `site-packages/torch/lib`).
    pub libtorch_loaded: Option<PathBuf>,
    /// Threads libtorch uses for one op (CPU).
    pub torch_threads: i32,
    pub cuda_available: bool,
    pub cuda_devices: i64,
    /// The c10d backends data-parallel training can use: gloo, and NCCL where the build
    /// compiled it (build.rs).
    pub c10d_backends: &'static str,
    pub cpu_cores: usize,
    /// The fp32 GEMM path and both precisions' measured GEMM speed.
    pub gemm: GemmInfo,
}

impl RuntimeInfo {
    /// Asks libtorch (this is also what proves the binary links and loads it), and measures
    /// its GEMMs for about 1.5 s.
    pub fn detect() -> Self {
        Self {
            lakeml_version: env!("CARGO_PKG_VERSION"),
            libtorch_version: env!("LAKEML_LIBTORCH_VERSION"),
            libtorch_lib: env!("LAKEML_LIBTORCH_LIB"),
            libtorch_loaded: loaded_libtorch_dir(),
            torch_threads: tch::get_num_threads(),
            cuda_available: tch::Cuda::is_available(),
            cuda_devices: tch::Cuda::device_count(),
            c10d_backends: if NCCL_BUILT {
                "gloo (CPU), nccl (CUDA)"
            } else {
                "gloo (built without NCCL)"
            },
            cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            gemm: GemmInfo::measure(),
        }
    }
}

impl std::fmt::Display for RuntimeInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "lakeml {}", self.lakeml_version)?;
        writeln!(
            f,
            "libtorch {}: built against {}, loaded from {}",
            self.libtorch_version,
            self.libtorch_lib,
            self.libtorch_loaded
                .as_deref()
                .map_or_else(|| "?".into(), |dir| dir.display().to_string())
        )?;
        writeln!(
            f,
            "cpu cores: {}, torch intra-op threads: {}",
            self.cpu_cores, self.torch_threads
        )?;
        writeln!(f, "fp32 GEMM: {}", self.gemm.fp32_path)?;
        writeln!(
            f,
            "GEMM speed (4096x384 . 384x1536, {} threads): fp32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s, \
             int8 {:.0} GOP/s{}",
            self.torch_threads,
            self.gemm.fp32_gflops,
            self.gemm.bf16_gflops,
            self.gemm.int8_gops,
            if self.gemm.int8_dot_products {
                ""
            } else {
                " (no int8 dot-product instructions: `precision: int8` falls back)"
            }
        )?;
        writeln!(f, "data parallelism (c10d): {}", self.c10d_backends)?;
        if self.cuda_available {
            write!(f, "cuda: {} device(s)", self.cuda_devices)
        } else {
            write!(f, "cuda: not available (CPU only)")
        }
    }
}

/// The directory of the `libtorch_cpu.so` this process loaded, as the dynamic linker found
/// it (through the rpath, before symlinks are resolved: a venv's `torch` may be a link).
pub fn loaded_libtorch_dir() -> Option<PathBuf> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        found: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid entry; `found` is the `Option<PathBuf>` below.
        unsafe {
            let name = (*info).dlpi_name;
            if name.is_null() {
                return 0;
            }
            let path = Path::new(std::ffi::OsStr::from_encoded_bytes_unchecked(
                std::ffi::CStr::from_ptr(name).to_bytes(),
            ));
            if path.file_name().is_some_and(|n| n == "libtorch_cpu.so") {
                *found.cast::<Option<PathBuf>>() = path.parent().map(Path::to_path_buf);
                return 1;
            }
        }
        0
    }
    let mut found: Option<PathBuf> = None;
    // SAFETY: the callback only reads the loader's entries and writes `found`.
    unsafe {
        libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast());
    }
    found
}

/// Refuses to run on a libtorch of another version than the one this binary was built
/// against (tch binds exactly one). A PyPI torch keeps its version in `torch/version.py`,
/// next to `lib/`; libtorch from elsewhere (a zip, a source build) is not checked.
pub fn check_libtorch() -> Result<()> {
    let Some(dir) = loaded_libtorch_dir() else {
        return Ok(());
    };
    // `torch/lib/../version.py`, taken lexically: `lib` may be a link.
    let Some(version_py) = dir.parent().map(|torch| torch.join("version.py")) else {
        return Ok(());
    };
    let Ok(text) = std::fs::read_to_string(&version_py) else {
        return Ok(());
    };
    check_torch_version(env!("LAKEML_LIBTORCH_VERSION"), &text, &dir)
}

/// The check itself: `built` is the version this binary was built against, `version_py`
/// the text of the loaded torch's `version.py`. Local build tags (`+cu130`, `+cpu`) do not
/// change libtorch's C++ interface, so only the release is compared.
fn check_torch_version(built: &str, version_py: &str, dir: &Path) -> Result<()> {
    let found = version_py
        .lines()
        .find_map(|line| line.strip_prefix("__version__"))
        .and_then(|rest| rest.split(['\'', '"']).nth(1));
    let release = |v: &str| v.split('+').next().unwrap_or(v).to_string();
    match found {
        Some(found) if built != "unknown" && release(found) != release(built) => {
            Err(Error::config(
                dir.join("libtorch_cpu.so"),
                format!(
                    "this is the libtorch of torch {found}, but lakeml {} was built against \
                     torch {built} and runs only on that version; install it into this \
                     environment: pip install torch=={}",
                    env!("CARGO_PKG_VERSION"),
                    release(built)
                ),
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_torch_release_is_refused_naming_both_versions() {
        let dir = Path::new("/venv/lib/python3.11/site-packages/torch/lib");
        let err = check_torch_version("2.11.0+cu130", "__version__ = '2.10.1+cpu'\n", dir)
            .unwrap_err()
            .to_string();
        assert!(err.contains("torch 2.10.1+cpu"), "{err}");
        assert!(err.contains("built against torch 2.11.0+cu130"), "{err}");
        assert!(err.contains("pip install torch==2.11.0"), "{err}");
        assert!(err.starts_with("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"));
    }

    #[test]
    fn the_same_release_with_another_build_tag_is_accepted() {
        let dir = Path::new("/t/lib");
        let ok = |text: &str| check_torch_version("2.11.0+cu130", text, dir).is_ok();
        assert!(ok("__version__ = '2.11.0+cpu'\ndebug = False\n"));
        assert!(ok("__version__ = \"2.11.0\"\n"));
        // No version line: not a PyPI torch, nothing to compare.
        assert!(ok("debug = False\n"));
    }

    #[test]
    fn the_loaded_libtorch_is_found() {
        // The unit-test binary links libtorch like the CLI does.
        let dir = loaded_libtorch_dir().expect("libtorch_cpu.so is loaded");
        assert!(dir.join("libtorch_cpu.so").exists(), "{}", dir.display());
    }
}
