//! A step's operations as a Chrome trace (the JSON `chrome://tracing` and Perfetto open).
//!
//! Not here: the records it draws ([`OpRecord`](super::OpRecord), `report.rs`).

use serde_json::{Value, json};

use super::report::StepReport;
use crate::lane::Lane;

impl StepReport {
    /// The step as a Chrome trace: one track per lane, one slice per operation (with its
    /// bytes in the slice's arguments).
    pub fn chrome_trace(&self, step: u64) -> Value {
        let mut events: Vec<Value> = Lane::ALL
            .iter()
            .map(|lane| {
                json!({
                    "name": "thread_name", "ph": "M", "pid": 1, "tid": lane.index(),
                    "args": { "name": lane.to_string() }
                })
            })
            .collect();
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": 1,
            "args": { "name": format!("strata step {step}") }
        }));
        for r in &self.records {
            events.push(json!({
                "name": r.label.to_string(),
                "cat": r.lane.to_string(),
                "ph": "X",
                "pid": 1,
                "tid": r.lane.index(),
                "ts": r.start_ns as f64 / 1000.0,
                "dur": (r.end_ns.saturating_sub(r.start_ns)) as f64 / 1000.0,
                "args": { "bytes": r.bytes },
            }));
        }
        json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}
