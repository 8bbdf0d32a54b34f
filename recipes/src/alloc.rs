//! Allocator settings for training on the CPU backend, and the registration of the process's
//! counting allocator ([`CountingAlloc`], from `wildfire_backend::alloc`) for the training
//! loop's memory metric.
//!
//! Every tensor op allocates its output; a tiny-GPT step allocates and frees hundreds of
//! buffers of 1–8 MiB. glibc serves blocks above its mmap threshold with fresh `mmap`s and hands
//! freed heap back to the OS, so each of those buffers costs page faults and zeroing on every
//! step (measured: 12–15% of a step). Raising both thresholds keeps freed memory in the process
//! for reuse, trading resident memory (up to the step's peak) for those faults.

use std::sync::OnceLock;

pub use wildfire_backend::alloc::CountingAlloc;

/// Serve allocations below 32 MiB (glibc's maximum threshold) from the heap, and keep up to
/// 1 GiB of freed heap instead of returning it to the OS. A no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; it is called before any thread
    // of ours allocates concurrently, and glibc serialises it internally anyway.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// The process's counting global allocator, when its binary registered one.
static REGISTERED: OnceLock<&'static CountingAlloc> = OnceLock::new();

/// Makes `heap`, the process's `#[global_allocator]`, the one the training loop reads for its
/// memory metric (see [`registered`]), and starts counting. Only the first call counts.
pub fn register(heap: &'static CountingAlloc) {
    heap.enable();
    let _ = REGISTERED.set(heap);
}

/// The registered counting allocator, if any: the `wildfire` binary and the memory benchmarks
/// register theirs; a library user's process has none, and its runs report no memory metric.
pub fn registered() -> Option<&'static CountingAlloc> {
    REGISTERED.get().copied()
}
