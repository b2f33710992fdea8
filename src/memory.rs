//! Memory the allocator holds after it was freed, given back to the system before the agent's
//! largest allocation: the netlink batch of a full replace (which must be in memory whole, as
//! one datagram, while the kernel takes it).
//!
//! mimalloc (the agent's allocator, `src/main.rs`) returns freed pages to the system only after
//! a delay (1 s by default), so the model, plan and parsing garbage of the sync that leads to a
//! full replace is still resident when its batch is built on top of it, and adds to the agent's
//! peak (docs/benchmarks.md, "Memory"). [`release_freed`] purges it at once. It is called
//! only there: purging on every free would cost page faults on every sync.

/// Gives the pages mimalloc holds free back to the system now. Without mimalloc (the
/// `system-allocator` build for heap profiles, or a program that links this crate with another
/// global allocator) there is nothing of mimalloc's to give back and it costs nothing.
pub fn release_freed() {
    #[cfg(not(feature = "system-allocator"))]
    // SAFETY: `mi_collect` takes no pointers and only walks mimalloc's own free lists and
    // arenas; it is safe to call from any thread at any time.
    unsafe {
        libmimalloc_sys::mi_collect(true)
    }
}
