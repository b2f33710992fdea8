//! cargo-fuzz entry point of target `annotations` (tests/fuzzing/; corpus fuzz/corpus/annotations/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::annotations::run(data));
