#![no_main]
//! cargo-fuzz target: see [`strata_fuzz::targets::tokenizer_json`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_fuzz::targets::tokenizer_json(data));
