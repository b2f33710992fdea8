//! cargo-fuzz entry point of target `nft_dump` (tests/fuzzing/; corpus fuzz/corpus/nft_dump/).
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzzing::netlink::nft_dump(data));
