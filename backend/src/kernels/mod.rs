//! Fused kernels and their reference implementations (see DESIGN.md: `backend/src/kernels/`).
//!
//! - [`attention`]: FlashAttention-2's forward and backward, as a reference in Burn tensor ops.

pub mod attention;
