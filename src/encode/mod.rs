//! Encode: the plan's IR as the kernel's messages, and back. `nft` speaks nf_tables over
//! netlink (encoder, decoder, and the socket that sends a batch and reads the table back); `xt`
//! encodes and decodes the xtables matches and targets of iptables rules.

pub mod nft;
pub mod xt;
