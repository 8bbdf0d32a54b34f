//! The CUDA seam: the only code that turns CubeCL CUDA buffers into device pointers on the
//! stream CubeCL launches on ([`stream`]), and the library calls made there ([`cublaslt`]).
//!
//! CubeCL queues its kernels on a CUDA stream of its own. A library call (a cuBLASLt GEMM, an
//! NCCL collective) on its buffers must run in order with those kernels: after the kernels that
//! write its inputs and before the ones that read its outputs. [`stream::enqueue`] runs the
//! call's host side on CubeCL's device thread, in queue order, with the stream and the buffers'
//! pointers, after the stream has been made to wait for the buffers' last writers on any other
//! stream, exactly as a kernel launch is; the call enqueues its GPU work on that stream and
//! returns. Nothing waits for the GPU. That needs one method cubecl-cuda 0.10 does not have
//! (`CudaServer::raw_stream`), added in the vendored copy under `vendor/` (vendor/README.md).

pub mod cublaslt;
pub mod stream;
