//! `strata.plan(...)` and `strata.doctor()`: the CLI's answers, found by the same library
//! functions (`strata::plan_cmd::report`, `strata::doctor::examine`) and handed to Python
//! as JSON text (which `strata/__init__.py` turns into dicts), with the CLI's printout.
//! `strata.plan`'s keywords reach the settings as typed values (a JSON object), checked
//! as the CLI checks its flags, not as a command line.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use strata::doctor::DoctorArgs;
use strata::train_config::PlanArgs;

fn with_text(mut value: serde_json::Value, text: String) -> PyResult<String> {
    if let Some(object) = value.as_object_mut() {
        object.insert("text".into(), serde_json::Value::String(text));
    }
    serde_json::to_string(&value).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Plans a step for `options` (a JSON object of `strata plan`'s flags by key, as
/// `--print-config` names them, with typed values), as one of `ranks` ranks, over the
/// TOML file `config` when given; JSON.
#[pyfunction]
#[pyo3(signature = (options, ranks = 1, config = None))]
pub fn plan_json(
    py: Python<'_>,
    options: &str,
    ranks: usize,
    config: Option<PathBuf>,
) -> PyResult<String> {
    let options: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(options).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let report = py
        .detach(move || {
            let cfg = PlanArgs::resolve_keywords(config.as_deref(), &options)
                .map_err(|e| e.to_string())?;
            strata::plan_cmd::report(&cfg, ranks).map_err(|e| e.to_string())
        })
        .map_err(PyValueError::new_err)?;
    let text = strata::plan_cmd::render(&report);
    let value = serde_json::to_value(&report).map_err(|e| PyValueError::new_err(e.to_string()))?;
    with_text(value, text)
}

/// What `strata doctor` finds for these swap folders; JSON.
#[pyfunction]
pub fn doctor_json(py: Python<'_>, nvme: Vec<std::path::PathBuf>) -> PyResult<String> {
    let args = DoctorArgs { nvme, json: None };
    let report = py.detach(move || strata::doctor::examine(&args));
    let text = strata::doctor::render(&report);
    let value = serde_json::to_value(&report).map_err(|e| PyValueError::new_err(e.to_string()))?;
    with_text(value, text)
}

/// Bytes from a size such as "4GiB", read as the CLI reads sizes.
#[pyfunction]
pub fn parse_bytes(text: &str) -> PyResult<u64> {
    strata::size::parse_bytes(text).map_err(PyValueError::new_err)
}
