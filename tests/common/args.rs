//! Command-line flags of the long-running programs built on this support (benches/races.rs,
//! benches/soak.rs): `--flag value` pairs, `--bench` (added by `cargo bench`) ignored.

use super::rng::Rng;

pub struct ProgramArgs(Vec<String>);

impl ProgramArgs {
    pub fn from_env() -> ProgramArgs {
        ProgramArgs(std::env::args().skip(1).filter(|a| a != "--bench").collect())
    }

    /// The value after `flag`, if given.
    pub fn value(&self, flag: &str) -> Option<String> {
        self.0.iter().position(|a| a == flag).and_then(|i| self.0.get(i + 1)).cloned()
    }

    /// Whether `flag` (one without a value) is given.
    pub fn flag(&self, flag: &str) -> bool {
        self.0.iter().any(|a| a == flag)
    }

    /// `flag`'s value parsed, or `default`; a value that does not parse stops the program.
    pub fn number<T: std::str::FromStr>(&self, flag: &str, default: T) -> T {
        self.value(flag).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{flag} {v}: not a number")))
    }

    /// `--seed S`, or a seed from the clock (printed by the program so a run can be replayed).
    pub fn seed(&self) -> u64 {
        self.value("--seed").map_or_else(Rng::seed_from_clock, |_| self.number("--seed", 0))
    }
}
