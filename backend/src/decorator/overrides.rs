//! The one place wildfire changes what an op does on `Parallel<B>`.
//!
//! To override an op, write it here in the impl of its op trait's override hook below, and run
//! `scripts/gen-decorator.py` again: the generator skips every op named in this file, so the
//! forward in `forward.rs` disappears and this definition is the only one. No op is overridden
//! yet; fused attention and the mixed-precision matmul policy will be the first.
