//! libtorch runs on plain threads of its own, named `lakeml-torch-*`: the async runtime is
//! never blocked, and a libtorch failure (a C++ exception surfaces as a panic in tch) becomes
//! an error a user can act on instead of a crash message.

use std::any::Any;

use crate::error::{Error, Result};

const PREFIX: &str = "lakeml-torch-";

/// Starts `f` on a libtorch thread called `lakeml-torch-{name}`; its result arrives on the
/// returned channel. A panic inside it arrives as an error, with `oom_hint` saying what to
/// lower when memory ran out.
pub(crate) fn spawn<T, F>(
    name: &str,
    oom_hint: &'static str,
    f: F,
) -> Result<tokio::sync::oneshot::Receiver<Result<T>>>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    quiet_panics();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("{PREFIX}{name}"))
        .spawn(move || {
            let _ = tx.send(catch(oom_hint, f));
        })
        .map_err(|e| Error::io(format!("starting the {name} thread"), e))?;
    Ok(rx)
}

/// Runs `f`, turning a libtorch panic into an error.
pub(crate) fn catch<T>(oom_hint: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(failure(panic.as_ref(), oom_hint)))
}

/// The default panic hook would print a libtorch exception raw, as if lakeml had crashed;
/// on libtorch threads it stays quiet (the error is reported instead). Other threads keep it.
fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(PREFIX));
            if !ours {
                default(info);
            }
        }));
    });
}

/// A libtorch exception, raised as a panic by tch, in words a user can act on.
fn failure(panic: &(dyn Any + Send), oom_hint: &str) -> Error {
    let msg = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown failure".into());
    let first = msg.lines().next().unwrap_or_default().to_string();
    if msg.contains("out of memory")
        || msg.contains("not enough memory")
        || msg.contains("can't allocate")
    {
        Error::Model(format!("out of memory: {first}; {oom_hint}"))
    } else {
        Error::Model(format!("libtorch failed: {first}"))
    }
}
