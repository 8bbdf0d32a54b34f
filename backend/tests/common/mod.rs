//! What the kernel test binaries share: the wgpu device, or a printed skip without one.
//! (Each test binary uses what it needs of it.)
#![allow(dead_code)]

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::DType;
use burn::tensor::backend::Backend;

/// The wgpu device, or `None` (printed as a skip) when there is no adapter; with
/// `WILDFIRE_REQUIRE_WGPU=1` (set by `.ci/run`) a missing adapter is a failure instead.
pub fn wgpu_device() -> Option<WgpuDevice> {
    let probe = std::panic::catch_unwind(|| {
        let device = WgpuDevice::default();
        <Wgpu as Backend>::supports_dtype(&device, DType::F32);
        device
    });
    match probe {
        Ok(device) => Some(device),
        Err(_) if std::env::var("WILDFIRE_REQUIRE_WGPU").is_ok_and(|v| v == "1") => {
            panic!("WILDFIRE_REQUIRE_WGPU=1 but no wgpu adapter was found")
        }
        Err(_) => {
            eprintln!("skipped: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
            None
        }
    }
}

/// Whether `device` computes in `dtype`; prints a skip when it does not.
pub fn has_dtype(device: &WgpuDevice, dtype: DType) -> bool {
    let has = <Wgpu as Backend>::supports_dtype(device, dtype);
    if !has {
        eprintln!("skipped: this wgpu device has no {dtype:?} arithmetic");
    }
    has
}
