//! cargo-fuzz entry point of target `state_file` (tests/fuzzing/; corpus fuzz/corpus/state_file/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::files::state_file(data));
