//! cargo-fuzz entry point of target `manifests` (tests/fuzzing/; corpus fuzz/corpus/manifests/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::files::manifests(data));
