//! A counting global allocator, for measurements of the heap (benchmarks, memory tests): a
//! binary that reports memory installs one as its `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The system allocator, counting live bytes and their peak while enabled. A binary that
/// reports memory installs one as its `#[global_allocator]`. Two peaks are kept: the
/// measurer's ([`peak`](Self::peak)) and the training loop's per-step window
/// ([`window_peak`](Self::window_peak)), so neither resets the other.
#[derive(Debug)]
pub struct CountingAlloc {
    enabled: AtomicBool,
    current: AtomicUsize,
    peak: AtomicUsize,
    window_peak: AtomicUsize,
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl CountingAlloc {
    /// Off until [`enable`](Self::enable)d.
    pub const fn new() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            window_peak: AtomicUsize::new(0),
        }
    }

    /// Starts counting (bytes allocated before are not known, so figures are growths).
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Relaxed);
    }

    /// Live bytes allocated since counting started, net of what was freed.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// The most live bytes since the last [`reset_peak`](Self::reset_peak).
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::Relaxed);
    }

    /// Starts a window (the training loop's step): its peak starts at the live bytes now,
    /// which it returns.
    pub fn start_window(&self) -> usize {
        let now = self.current();
        self.window_peak.store(now, Ordering::Relaxed);
        now
    }

    /// The most live bytes since the last [`start_window`](Self::start_window).
    pub fn window_peak(&self) -> usize {
        self.window_peak.load(Ordering::Relaxed)
    }

    fn grew(&self, bytes: usize) {
        if self.enabled.load(Ordering::Relaxed) {
            let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
            self.peak.fetch_max(now, Ordering::Relaxed);
            self.window_peak.fetch_max(now, Ordering::Relaxed);
        }
    }

    fn shrank(&self, bytes: usize) {
        if self.enabled.load(Ordering::Relaxed) {
            // Saturating: memory allocated before counting started may be freed after.
            let _ = self
                .current
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    Some(c.saturating_sub(bytes))
                });
        }
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            self.grew(layout.size());
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            self.grew(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a pointer from this allocator with its layout.
        unsafe { System.dealloc(pointer, layout) };
        self.shrank(layout.size());
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            self.shrank(layout.size());
            self.grew(new_size);
        }
        moved
    }
}
