//! strata's fuzz targets: the bodies are in `targets.rs`, which the stable replay test
//! (`tests/fuzz_corpus.rs`) includes too.

pub mod targets;
