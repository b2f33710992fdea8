//! cargo-fuzz entry point of target `sock_diag` (tests/fuzzing/; corpus fuzz/corpus/sock_diag/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::netlink::sock_diag(data));
