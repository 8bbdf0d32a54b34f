//! Heap accounting for the benchmarks that report memory: the process's global allocator counts
//! live bytes and their peak while counting is switched on (it is off unless a benchmark turns it
//! on, and then costs three relaxed atomic operations per allocation).

use wildfire_recipes::alloc::CountingAlloc;

#[global_allocator]
pub static HEAP: CountingAlloc = CountingAlloc::new();
