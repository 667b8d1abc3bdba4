//! `strata._native`: the compiled half of the `strata` Python package (PyO3, abi3).
//!
//! It exposes the workspace crates to the Python half (`python/strata/`): the AdamW step
//! (`optim`), the NVMe tensor store (`io`), and `plan`/`doctor` (`info`). Tensors are
//! used in place through their data pointers (`view`), and the GIL is released around
//! every kernel and every wait for I/O. The Python half holds the user-facing API
//! (`torch.optim.Optimizer` subclass, argument defaults, dict results).

use pyo3::prelude::*;

mod info;
mod io;
mod optim;
mod view;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Messages from the crates (the one-time fallback to threaded I/O, an mlock refusal)
    // go to stderr as the CLI prints them.
    strata::logging::init();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(optim::adamw_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim::adamw_steps, m)?)?;
    m.add_function(wrap_pyfunction!(optim::adamw_check, m)?)?;
    m.add_function(wrap_pyfunction!(optim::q8_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(optim::q8_convert, m)?)?;
    m.add_function(wrap_pyfunction!(optim::max_threads, m)?)?;
    m.add_function(wrap_pyfunction!(optim::isa, m)?)?;
    m.add_function(wrap_pyfunction!(info::plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(info::doctor_json, m)?)?;
    m.add_function(wrap_pyfunction!(info::parse_bytes, m)?)?;
    m.add_class::<io::Store>()?;
    m.add_class::<io::Handle>()?;
    m.add_class::<io::PinnedBuffer>()?;
    Ok(())
}
