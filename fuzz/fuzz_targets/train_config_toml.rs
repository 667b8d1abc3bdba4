#![no_main]
//! cargo-fuzz target: see [`strata_fuzz::targets::train_config_toml`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_fuzz::targets::train_config_toml(data));
