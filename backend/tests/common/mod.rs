//! What the kernel test binaries share: the wgpu device (or a printed skip without one), the
//! output and input gradients of an attention, and the error measure.
//! (Each test binary uses what it needs of it.)
#![allow(dead_code)]

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};

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

/// The output and the gradients of query, key and value (in that order) of `attend` on backend
/// `A`, from `data = [query, key, value, output gradient]` (converted to f32).
pub fn output_and_grads<A: AutodiffBackend>(
    data: &[TensorData],
    device: &A::Device,
    attend: impl Fn(Tensor<A, 4>, Tensor<A, 4>, Tensor<A, 4>) -> Tensor<A, 4>,
) -> [TensorData; 4] {
    let tensor =
        |i: usize| Tensor::<A, 4>::from_data(data[i].clone().convert_dtype(DType::F32), device);
    let [q, k, v] = [0, 1, 2].map(|i| tensor(i).require_grad());
    let output = attend(q.clone(), k.clone(), v.clone());
    let grads = (output.clone() * tensor(3)).sum().backward();
    [
        output.into_data(),
        q.grad(&grads).unwrap().into_data(),
        k.grad(&grads).unwrap().into_data(),
        v.grad(&grads).unwrap().into_data(),
    ]
}

/// `max |actual − expected| / max |expected|`.
pub fn relative_error(actual: TensorData, expected: TensorData) -> f32 {
    let actual: Vec<f32> = actual.convert::<f32>().to_vec().unwrap();
    let expected: Vec<f32> = expected.convert::<f32>().to_vec().unwrap();
    let scale = expected
        .iter()
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let worst = actual
        .iter()
        .zip(&expected)
        .map(|(a, e)| (a - e).abs())
        .fold(0.0f32, f32::max);
    worst / scale
}
