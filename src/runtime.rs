//! What the linked libtorch offers on this machine (`pipeline info`).

use crate::gemm::GemmInfo;

/// Facts about the linked libtorch and this machine.
#[derive(Debug, serde::Serialize)]
pub struct RuntimeInfo {
    pub lakeml_version: &'static str,
    /// The libtorch the binary was built against (version, library directory).
    pub libtorch_version: &'static str,
    pub libtorch_lib: &'static str,
    /// Threads libtorch uses for one op (CPU).
    pub torch_threads: i32,
    pub cuda_available: bool,
    pub cuda_devices: i64,
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
            torch_threads: tch::get_num_threads(),
            cuda_available: tch::Cuda::is_available(),
            cuda_devices: tch::Cuda::device_count(),
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
            "libtorch {}: built against {}, loaded",
            self.libtorch_version, self.libtorch_lib
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
        if self.cuda_available {
            write!(f, "cuda: {} device(s)", self.cuda_devices)
        } else {
            write!(f, "cuda: not available (CPU only)")
        }
    }
}
