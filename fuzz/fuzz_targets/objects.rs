//! cargo-fuzz entry point of target `objects` (tests/fuzzing/; corpus fuzz/corpus/objects/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::objects::run(data));
