#![no_main]
//! cargo-fuzz target: see [`strata_fuzz::targets::token_file`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_fuzz::targets::token_file(data));
