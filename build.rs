//! Gives the `pipeline` binary an rpath to libtorch, so it runs without LD_LIBRARY_PATH,
//! exports its answer to MKL's CPU check (src/gemm.rs), and records which libtorch it was
//! built against (`pipeline info`, and the version check at start: src/runtime.rs). It also
//! compiles the c10d shim (csrc/c10d: libtorch's TCPStore, ProcessGroupGloo and, where
//! libtorch has CUDA, ProcessGroupNCCL behind a C ABI, for data-parallel training:
//! src/train/dist.rs) against that libtorch's headers.
//!
//! torch-sys (a direct dependency for this reason; it declares `links = "tch"`) exports the
//! libtorch library directory it linked against as DEP_TCH_LIBTORCH_LIB. `$ORIGIN`-relative
//! entries come first, so that the binary a wheel installs finds the torch of its own
//! environment.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let dir = std::env::var("DEP_TCH_LIBTORCH_LIB").unwrap_or_default();
    // src/gemm.rs: MKL's CPU-vendor check answered by the program (main.rs, and the unit
    // tests), which must be in the dynamic symbol table to take precedence over libtorch's.
    println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=mkl_serv_intel_cpu_true");
    // Where libtorch is looked for, in order (the first directory that has it wins):
    // 1. the wheel (`pip install lakeml`): the binary is in the environment's `bin/`, and
    //    torch in `lib/pythonX.Y/site-packages` (a venv, `--user`, a prefix) or Debian's
    //    `dist-packages` (its system pip), for every Python the torch wheel is built for;
    // 2. a binary carried next to a `torch/lib` (e.g. on a GPU machine);
    // 3. the libtorch this build linked against (a source build).
    for python in ["3.10", "3.11", "3.12", "3.13", "3.14"] {
        for site in ["site-packages", "dist-packages"] {
            println!(
                "cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/python{python}/{site}/torch/lib"
            );
        }
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/torch/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    if !dir.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    // A PyPI torch keeps its version next to lib/: `__version__ = '2.11.0+cu130'`.
    let version = std::fs::read_to_string(std::path::Path::new(&dir).join("../version.py"))
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("__version__"))?;
            Some(line.split('\'').nth(1)?.to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    c10d_shim(&dir);
    println!("cargo:rustc-env=LAKEML_LIBTORCH_LIB={dir}");
    println!("cargo:rustc-env=LAKEML_LIBTORCH_VERSION={version}");
}

/// Compiles csrc/c10d/shim.cpp as torch-sys compiles its own wrapper (C++17, the CXX11 ABI
/// the PyPI wheels use), with gloo's types declared by csrc/c10d/gloo-stub (the wheel ships
/// no gloo headers). Its c10d symbols come from libtorch_cpu, named again after the static
/// shim so that the linker's `--as-needed` keeps it. csrc/c10d/nccl.cpp joins it where
/// libtorch has CUDA and the headers NCCL's half needs are installed (see [`nccl_includes`]);
/// it sets cfg `lakeml_nccl` then.
fn c10d_shim(libtorch_lib: &str) {
    println!("cargo:rerun-if-changed=csrc/c10d");
    println!("cargo::rustc-check-cfg=cfg(lakeml_nccl)");
    let include = std::path::Path::new(libtorch_lib).join("../include");
    let mut build = cc::Build::new();
    let nccl = nccl_includes(libtorch_lib);
    if let Some(dirs) = &nccl {
        build
            .define("USE_C10D_NCCL", None)
            .includes(dirs)
            // c10/cuda/CUDAEvent.h trips GCC's note on std::hardware_destructive_interference_size.
            .flag_if_supported("-Wno-interference-size")
            .file("csrc/c10d/nccl.cpp");
        println!("cargo:rustc-cfg=lakeml_nccl");
    }
    build
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("USE_C10D_GLOO", None)
        .define("GLOG_USE_GLOG_EXPORT", None)
        .include("csrc/c10d/gloo-stub")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .warnings(false)
        .file("csrc/c10d/shim.cpp")
        .compile("lakeml_c10d");
    if nccl.is_some() {
        println!("cargo:rustc-link-lib=torch_cuda");
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
}

/// The include directories NCCL's half of the shim needs, where the torch wheel beside
/// libtorch has CUDA: NCCL's header (PyPI nvidia-nccl, a torch dependency, at the version
/// torch was built with, which fixes the layout of ProcessGroupNCCL::Options) and CUDA's
/// runtime headers (nvidia-cuda-runtime, with the crt/ and nv/ parts from nvidia-cuda-crt
/// and nvidia-cuda-cccl that scripts/env.sh installs). `None` where any is missing: the
/// build then has gloo alone, and `backend: nccl` says so.
fn nccl_includes(libtorch_lib: &str) -> Option<Vec<std::path::PathBuf>> {
    let lib = std::path::Path::new(libtorch_lib);
    if !lib.join("libtorch_cuda.so").exists() {
        return None;
    }
    let nvidia = lib.join("../../nvidia");
    let dirs: Vec<std::path::PathBuf> = std::fs::read_dir(&nvidia)
        .ok()?
        .filter_map(|e| Some(e.ok()?.path().join("include")))
        .filter(|d| d.is_dir())
        .collect();
    let needed = [
        "nccl.h",
        "cuda_runtime_api.h",
        "crt/host_defines.h",
        "nv/target",
    ];
    let mut found: Vec<std::path::PathBuf> = Vec::new();
    for header in needed {
        let Some(dir) = dirs.iter().find(|d| d.join(header).exists()) else {
            // Seen again once they are installed.
            println!("cargo:rerun-if-changed={}", nvidia.display());
            println!(
                "cargo:warning=no {header} under {}: building without NCCL (scripts/env.sh \
                 installs CUDA's headers)",
                nvidia.display()
            );
            return None;
        };
        println!("cargo:rerun-if-changed={}", dir.join(header).display());
        if !found.contains(dir) {
            found.push(dir.clone());
        }
    }
    Some(found)
}
