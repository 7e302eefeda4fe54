//! The fp32 GEMM path, and how fast it runs here.
//!
//! libtorch's fp32 matrix products go through MKL, linked into `libtorch_cpu.so`. MKL picks
//! its kernels by asking `mkl_serv_intel_cpu_true()` whether the CPU is Intel's, and on any
//! other CPU it takes a generic path even where the CPU has AVX2 or AVX-512: on an AMD EPYC
//! with AVX-512 a transformer-shaped `sgemm` runs at about half speed. `libtorch_cpu.so`
//! exports that function without binding its own calls to it, so a definition earlier in the
//! dynamic linker's lookup order wins. The `pipeline` binary defines and exports one
//! (`src/main.rs`, `build.rs`) that answers [`mkl_cpu_check`]: "yes" unless the override is
//! off, after which MKL dispatches on the CPU's features alone (what HF's
//! text-embeddings-inference CPU image does with a preloaded library). Off, the answer is the
//! CPU's real vendor, so MKL behaves exactly as it does without lakeml.
//!
//! bf16 products go through oneDNN, which is not affected either way; so do int8 products
//! (`_int_mm`), which run at full speed only on CPUs with int8 dot-product instructions
//! ([`int8_dot_products`]).

use std::ffi::c_int;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// The environment variable that turns the override off (`0`, `off`, `false`, `no`).
pub const OVERRIDE_ENV: &str = "LAKEML_MKL_OVERRIDE";

const UNSET: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

static SETTING: AtomicU8 = AtomicU8::new(UNSET);
static ASKED: AtomicBool = AtomicBool::new(false);

/// Turns the override on or off for this process; must be called before the first tensor
/// operation (MKL asks once, when it first dispatches). Unset, [`OVERRIDE_ENV`] decides, and
/// the default is on.
pub fn set_mkl_override(on: bool) {
    SETTING.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether the override is on: [`set_mkl_override`], else [`OVERRIDE_ENV`], else on.
pub fn mkl_override() -> bool {
    match SETTING.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = std::env::var(OVERRIDE_ENV).map_or(true, |v| {
                !matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "0" | "off" | "false" | "no"
                )
            });
            set_mkl_override(on);
            on
        }
    }
}

/// The answer to MKL's "is this an Intel CPU?": 1 with the override on, else the truth.
/// Called by the exported `mkl_serv_intel_cpu_true` of the binary (and of the unit tests),
/// from any of MKL's threads.
pub fn mkl_cpu_check() -> c_int {
    ASKED.store(true, Ordering::Relaxed);
    c_int::from(mkl_override() || cpu_is_intel())
}

#[cfg(test)]
#[unsafe(no_mangle)]
extern "C" fn mkl_serv_intel_cpu_true() -> c_int {
    mkl_cpu_check()
}

/// Whether the CPU says it is Intel's (the `GenuineIntel` vendor string). Read once: MKL may
/// ask often, and `cpuid` traps to the hypervisor in a virtual machine.
fn cpu_is_intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let r = std::arch::x86_64::__cpuid(0);
            let word = |b: &[u8; 4]| u32::from_le_bytes(*b);
            [r.ebx, r.edx, r.ecx] == [word(b"Genu"), word(b"ineI"), word(b"ntel")]
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether the CPU has int8 dot-product instructions (x86 AVX512-VNNI or AVX-VNNI, Arm
/// dotprod), which oneDNN's int8 GEMMs need to beat bf16; `precision: int8` falls back
/// without them.
pub fn int8_dot_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
            || std::arch::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("dotprod")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Whether the CPU has native bf16 dot products (x86 AVX512-BF16, which every AMX CPU has
/// too; Arm bf16), the fallback for `precision: int8` where int8 dot products are missing.
pub fn bf16_dot_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("bf16")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The fp32 GEMM path in force, and the measured speed of each precision's GEMMs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmInfo {
    /// Which code path fp32 products take, for people.
    pub fp32_path: String,
    /// GFLOP/s of a transformer-shaped product (4096×384 · 384×1536) over about a second.
    pub fp32_gflops: f64,
    pub bf16_gflops: f64,
    /// Giga int8 multiply-adds ×2 per second (`_int_mm`, int32 sums), same shape.
    pub int8_gops: f64,
    /// Whether `precision: int8` runs here (see [`int8_dot_products`]).
    pub int8_dot_products: bool,
}

impl GemmInfo {
    /// Measures each precision on the CPU with libtorch's current threads (about 2 s),
    /// then says which path MKL took (it has answered its CPU check by then).
    pub fn measure() -> Self {
        let fp32_gflops = gflops(tch::Kind::Float, Duration::from_millis(1000));
        let bf16_gflops = gflops(tch::Kind::BFloat16, Duration::from_millis(500));
        let int8_gops = gflops(tch::Kind::Int8, Duration::from_millis(500));
        Self {
            fp32_path: fp32_path(),
            fp32_gflops,
            bf16_gflops,
            int8_gops,
            int8_dot_products: int8_dot_products(),
        }
    }
}

fn fp32_path() -> String {
    if !tch::utils::has_mkl() {
        return "libtorch's own BLAS (this libtorch has no MKL)".into();
    }
    let intel = cpu_is_intel();
    match (ASKED.load(Ordering::Relaxed), mkl_override()) {
        (false, _) => "MKL; its CPU check never reached lakeml's answer (a program without the \
                       exported override)"
            .into(),
        _ if intel => "MKL, Intel CPU: MKL's own fast path".into(),
        (true, true) => format!(
            "MKL, fast path by feature dispatch (lakeml answers MKL's CPU check; \
             {OVERRIDE_ENV}=0 or --no-mkl-override turns it off)"
        ),
        (true, false) => "MKL, generic path for non-Intel CPUs (the override is off)".into(),
    }
}

/// GFLOP/s of repeated `[4096, 384] x [384, 1536]` products (a MiniLM FFN at 4096 tokens);
/// int8 as the int8 linear layers run it (`_int_mm` on a transposed `[n, k]` weight).
fn gflops(kind: tch::Kind, budget: Duration) -> f64 {
    let (m, k, n) = (4096_i64, 384_i64, 1536_i64);
    let _guard = tch::no_grad_guard();
    let product: Box<dyn Fn() -> tch::Tensor> = if kind == tch::Kind::Int8 {
        let opts = (kind, tch::Device::Cpu);
        let a = tch::Tensor::randint_low(-127, 128, [m, k], opts);
        let b = tch::Tensor::randint_low(-127, 128, [n, k], opts).tr();
        Box::new(move || a.internal_int_mm(&b))
    } else {
        let opts = (kind, tch::Device::Cpu);
        let a = tch::Tensor::randn([m, k], opts);
        let b = tch::Tensor::randn([k, n], opts);
        Box::new(move || a.matmul(&b))
    };
    // warm up: the first product pays for dispatch and packing buffers
    let _ = product();
    let started = Instant::now();
    let mut runs = 0_u32;
    while started.elapsed() < budget || runs < 2 {
        let _ = product();
        runs += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    2.0 * (m * k * n) as f64 * f64::from(runs) / seconds / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mkl_asks_lakeml_and_the_override_is_on_by_default() {
        // The unit-test binary exports the same answer as `pipeline` (build.rs), so MKL's
        // first fp32 product asks it.
        set_mkl_override(true);
        let info = GemmInfo::measure();
        assert!(
            info.fp32_gflops > 0.0 && info.bf16_gflops > 0.0 && info.int8_gops > 0.0,
            "{info:?}"
        );
        if tch::utils::has_mkl() {
            assert!(
                ASKED.load(Ordering::Relaxed),
                "MKL did not call lakeml's mkl_serv_intel_cpu_true: {info:?}"
            );
            assert!(info.fp32_path.starts_with("MKL, "), "{info:?}");
        }
        assert_eq!(mkl_cpu_check(), 1);
    }
}
