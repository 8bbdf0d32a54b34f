//! Whether a kernel device answers, asked before a test, a bench or a check uses it.
//!
//! CubeCL's runtimes panic when they find no device, and for CUDA without a driver the panic
//! happens on a device thread, so what reaches the caller only says a channel closed. These
//! probes ask first and return the reason instead: a test then prints it as a skip (or fails,
//! where its environment says the device must be there), a bench reports it as an error.

use std::panic::AssertUnwindSafe;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// The default wgpu adapter's device (a GPU's Vulkan/Metal driver, or Mesa's lavapipe on a CPU),
/// or why there is none.
#[cfg(feature = "wgpu")]
pub fn wgpu() -> Result<burn::backend::wgpu::WgpuDevice, String> {
    use burn::backend::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::default();
    answers::<Wgpu>(device).map_err(|why| {
        format!("no wgpu adapter ({why}); install mesa-vulkan-drivers for a CPU Vulkan device")
    })
}

/// The first CUDA device, or why there is none (no driver, no device, a runtime error).
#[cfg(feature = "cuda")]
pub fn cuda() -> Result<burn::backend::cuda::CudaDevice, String> {
    // Look for the driver first: see the module doc.
    // SAFETY: dlopen with a valid C string; the handle is closed right away.
    let driver = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY) };
    if driver.is_null() {
        return Err("libcuda.so.1 cannot be loaded: no NVIDIA driver on this machine".into());
    }
    // SAFETY: the handle came from dlopen above.
    unsafe { libc::dlclose(driver) };
    answers::<burn::backend::Cuda>(Default::default())
}

/// `device`, once a one-element tensor has made the round trip to it and back.
fn answers<B: Backend>(device: B::Device) -> Result<B::Device, String> {
    // A device is a handle; a panic leaves nothing half-changed behind it.
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        B::supports_dtype(&device, DType::F32);
        Tensor::<B, 1>::zeros([1], &device).into_data()
    }))
    .map(|_| device)
    .map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the runtime panicked".into())
    })
}

/// The device from `probe`, for a test: `None` after printing `skipped: <why>` when there is
/// none, unless the environment variable `require` is `1` (as `.ci/run` sets
/// `WILDFIRE_REQUIRE_WGPU` and `scripts/gpu-check.sh` sets `WILDFIRE_REQUIRE_CUDA`), which
/// makes a missing device a panic instead.
pub fn for_test<D>(probe: Result<D, String>, require: &str) -> Option<D> {
    match probe {
        Ok(device) => Some(device),
        Err(why) if std::env::var(require).is_ok_and(|v| v == "1") => {
            panic!("{require}=1 but the device is missing: {why}")
        }
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}
