//! Gives the `pipeline` binary an rpath to libtorch, so it runs without LD_LIBRARY_PATH.
//!
//! torch-sys (a direct dependency for this reason; it declares `links = "tch"`) exports the
//! libtorch library directory it linked against as DEP_TCH_LIBTORCH_LIB. `$ORIGIN`-relative
//! fallbacks let a binary carried next to a `torch/lib` (e.g. on a GPU machine) find it too.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/torch/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
}
