//! Gives the `pipeline` binary an rpath to libtorch, so it runs without LD_LIBRARY_PATH,
//! exports its answer to MKL's CPU check (src/gemm.rs), and records which libtorch it was
//! built against (`pipeline info`).
//!
//! torch-sys (a direct dependency for this reason; it declares `links = "tch"`) exports the
//! libtorch library directory it linked against as DEP_TCH_LIBTORCH_LIB. `$ORIGIN`-relative
//! fallbacks let a binary carried next to a `torch/lib` (e.g. on a GPU machine) find it too.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let dir = std::env::var("DEP_TCH_LIBTORCH_LIB").unwrap_or_default();
    if !dir.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    // src/gemm.rs: MKL's CPU-vendor check answered by the program (main.rs, and the unit
    // tests), which must be in the dynamic symbol table to take precedence over libtorch's.
    println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=mkl_serv_intel_cpu_true");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/torch/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    // A PyPI torch keeps its version next to lib/: `__version__ = '2.11.0+cu130'`.
    let version = std::fs::read_to_string(std::path::Path::new(&dir).join("../version.py"))
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("__version__"))?;
            Some(line.split('\'').nth(1)?.to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=LAKEML_LIBTORCH_LIB={dir}");
    println!("cargo:rustc-env=LAKEML_LIBTORCH_VERSION={version}");
}
