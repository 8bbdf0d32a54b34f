//! Which implementation a kernel call takes, by the type of the backend's tensor primitive:
//!
//! - a CubeCL runtime's tensor (`CubeTensor<WgpuRuntime>` with the `wgpu` feature,
//!   `CubeTensor<CudaRuntime>` with `cuda`: Burn's `Wgpu` and `Cuda`, bare or inside
//!   `Parallel<_>`): the CubeCL kernel ([`on_cube`]);
//! - Flex's tensor (Burn's CPU backend): the native loops of [`super::flex`] ([`on_flex`]);
//! - otherwise, or when a kernel declines its inputs (a dtype, a shape outside its range): the
//!   reference in Burn tensor ops.
//!
//! The choice is by type, so every rank of a job takes the same path.
//!
//! **The kernels are the default.** `WILDFIRE_KERNELS=reference` (or
//! [`set_kernels_enabled`]`(false)`) sends every call to the reference instead, e.g. to compare
//! the two or to rule the kernels out.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_flex::FlexTensor;

use std::any::TypeId;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::typecast::same;

#[cfg(feature = "wgpu")]
use cubecl::wgpu::WgpuDevice;

/// A kernel taking `N` tensors and giving `M`, on any CubeCL runtime.
pub(crate) trait CubeKernel<const N: usize, const M: usize> {
    /// The outputs, or `None` when the kernel does not take these inputs (the caller then runs
    /// the reference): a dtype the device lacks, a shape outside the kernel's range.
    fn launch<R: CubeRuntime>(&self, inputs: [CubeTensor<R>; N]) -> Option<[CubeTensor<R>; M]>;
}

/// `kernel` on `inputs` (primitives of type `P`) when `P` is a CubeCL tensor and the kernel
/// takes them; otherwise the inputs back.
pub(crate) fn on_cube<P: 'static, const N: usize, const M: usize>(
    kernel: &impl CubeKernel<N, M>,
    inputs: [P; N],
) -> Result<[P; M], [P; N]> {
    if !kernels_enabled() {
        return Err(inputs);
    }
    #[cfg(feature = "wgpu")]
    let inputs = match on_runtime::<cubecl::wgpu::WgpuRuntime, P, N, M>(kernel, inputs) {
        Ok(outputs) => return Ok(outputs),
        Err(inputs) => inputs,
    };
    #[cfg(feature = "cuda")]
    let inputs = match on_runtime::<cubecl::cuda::CudaRuntime, P, N, M>(kernel, inputs) {
        Ok(outputs) => return Ok(outputs),
        Err(inputs) => inputs,
    };
    let _ = kernel;
    Err(inputs)
}

/// Whether CubeCL backends run the kernels: as [`set_kernels_enabled`] last said, or else as
/// `WILDFIRE_KERNELS` says: unset or `cubecl` yes, `reference` no (read once per process:
/// every attention and matmul call asks).
///
/// # Panics
/// On any other value of `WILDFIRE_KERNELS`, naming it.
pub fn kernels_enabled() -> bool {
    match KERNELS.load(Ordering::Relaxed) {
        UNDECIDED => {
            let from_env = match std::env::var("WILDFIRE_KERNELS").as_deref() {
                Err(_) | Ok("cubecl") => ENABLED,
                Ok("reference") => DISABLED,
                Ok(other) => {
                    panic!("WILDFIRE_KERNELS={other:?}: expected `cubecl` or `reference`")
                }
            };
            // A concurrent `set_kernels_enabled` wins over the environment.
            let _ =
                KERNELS.compare_exchange(UNDECIDED, from_env, Ordering::Relaxed, Ordering::Relaxed);
            KERNELS.load(Ordering::Relaxed) == ENABLED
        }
        state => state == ENABLED,
    }
}

/// Sets whether CubeCL backends run the kernels (`true`) or the reference (`false`) in this
/// process, whatever `WILDFIRE_KERNELS` says.
pub fn set_kernels_enabled(enabled: bool) {
    KERNELS.store(if enabled { ENABLED } else { DISABLED }, Ordering::Relaxed);
}

const UNDECIDED: u8 = 0;
const DISABLED: u8 = 1;
const ENABLED: u8 = 2;
static KERNELS: AtomicU8 = AtomicU8::new(UNDECIDED);

/// `launch` on `inputs` when they are Flex's tensors (unless the kernels are opted out) and it
/// takes them; otherwise the inputs back.
pub(crate) fn on_flex<P: 'static, const N: usize, const M: usize>(
    inputs: [P; N],
    launch: impl FnOnce([FlexTensor; N]) -> Option<[FlexTensor; M]>,
) -> Result<[P; M], [P; N]> {
    on_flex_owned(inputs, handing_back(launch))
}

/// [`on_flex`] for a launch that owns its inputs: it hands them back itself when it declines
/// them, so no other handle to their memory is kept while it runs, and a launch that takes
/// them can write into that memory (Flex's copy-on-write then copies nothing).
pub(crate) fn on_flex_owned<P: 'static, const N: usize, const M: usize>(
    inputs: [P; N],
    launch: impl FnOnce([FlexTensor; N]) -> Result<[FlexTensor; M], [FlexTensor; N]>,
) -> Result<[P; M], [P; N]> {
    if !kernels_enabled() {
        return Err(inputs);
    }
    on_primitive(inputs, launch)
}

/// [`on_cube`] for runtime `R`.
fn on_runtime<R: CubeRuntime, P: 'static, const N: usize, const M: usize>(
    kernel: &impl CubeKernel<N, M>,
    inputs: [P; N],
) -> Result<[P; M], [P; N]> {
    on_primitive::<CubeTensor<R>, _, N, M>(inputs, handing_back(|tensors| kernel.launch(tensors)))
}

/// A launch that may decline its inputs (`None`) as one that hands them back: it runs on
/// handles to the same memory and keeps the inputs for that case.
fn handing_back<T: Clone, const N: usize, const M: usize>(
    launch: impl FnOnce([T; N]) -> Option<[T; M]>,
) -> impl FnOnce([T; N]) -> Result<[T; M], [T; N]> {
    |tensors| launch(tensors.clone()).ok_or(tensors)
}

/// `launch` on `inputs` when primitives of type `P` are of type `T`; otherwise, or when the
/// launch hands them back, the inputs back.
fn on_primitive<T: 'static, P: 'static, const N: usize, const M: usize>(
    inputs: [P; N],
    launch: impl FnOnce([T; N]) -> Result<[T; M], [T; N]>,
) -> Result<[P; M], [P; N]> {
    if TypeId::of::<P>() != TypeId::of::<T>() {
        return Err(inputs);
    }
    launch(inputs.map(same::<P, T>))
        .map(|outputs| outputs.map(same))
        .map_err(|tensors| tensors.map(same))
}

/// Lavapipe (Mesa's CPU Vulkan driver, through wgpu) ends every loop of a shader invocation
/// once the invocation's loops together have run this many iterations (gallivm's
/// `LP_MAX_TGSI_LOOP_ITERATIONS`, one counter shared by every loop), silently: the results are
/// wrong, not an error. Kernels decline shapes that would pass it on a device that may be
/// lavapipe ([`loops_capped`]).
pub(crate) const LOOP_ITERATION_CAP: usize = 65_535;

/// Whether `device` may be lavapipe, whose loops are capped ([`LOOP_ITERATION_CAP`]): a wgpu
/// device that is wgpu's CPU adapter, or the default (or an existing) device on a machine where
/// wgpu finds a CPU adapter, since which adapter those are is wgpu's choice. A GPU named as such
/// has no cap; a GPU behind the default device on a machine that also has lavapipe keeps it and
/// loses only the shapes past it, to the reference.
pub fn loops_capped<R: CubeRuntime>(device: &R::Device) -> bool {
    #[cfg(feature = "wgpu")]
    if let Some(device) = (device as &dyn std::any::Any).downcast_ref::<WgpuDevice>() {
        return wgpu_may_be_cpu(device, machine_has_cpu_adapter);
    }
    let _ = device;
    false
}

/// Whether wgpu `device` may be a CPU adapter, asking `cpu_adapter_found` only when the device
/// does not say.
#[cfg(feature = "wgpu")]
fn wgpu_may_be_cpu(device: &WgpuDevice, cpu_adapter_found: impl FnOnce() -> bool) -> bool {
    match device {
        WgpuDevice::Cpu => true,
        WgpuDevice::DiscreteGpu(_) | WgpuDevice::IntegratedGpu(_) | WgpuDevice::VirtualGpu(_) => {
            false
        }
        _ => cpu_adapter_found(),
    }
}

/// Whether wgpu finds a CPU adapter (lavapipe, llvmpipe) for its default graphics API on this
/// machine; asked once per process.
#[cfg(feature = "wgpu")]
fn machine_has_cpu_adapter() -> bool {
    use cubecl::Runtime;
    use cubecl::device::Device;
    use cubecl::wgpu::{AutoGraphicsApi, GraphicsApi, WgpuRuntime};
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        WgpuRuntime::enumerate_all_devices(&AutoGraphicsApi::backend())
            .into_iter()
            .any(|id| WgpuDevice::from_id(id) == WgpuDevice::Cpu)
    })
}

/// The CubeCL runtime whose kernels primitives of type `P` run, if any: `"wgpu"` or `"cuda"`.
pub fn cube_runtime<P: 'static>() -> Option<&'static str> {
    #[cfg(feature = "wgpu")]
    if TypeId::of::<P>() == TypeId::of::<CubeTensor<cubecl::wgpu::WgpuRuntime>>() {
        return Some("wgpu");
    }
    #[cfg(feature = "cuda")]
    if TypeId::of::<P>() == TypeId::of::<CubeTensor<cubecl::cuda::CudaRuntime>>() {
        return Some("cuda");
    }
    let _ = TypeId::of::<P>;
    None
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    /// A wgpu device named as a GPU has no loop cap, the CPU adapter has it, and the default and
    /// existing devices have it exactly when the machine has a CPU adapter.
    #[cfg(feature = "wgpu")]
    #[test]
    fn only_a_device_that_may_be_the_cpu_adapter_is_loop_capped() {
        use super::{WgpuDevice, wgpu_may_be_cpu};
        let never_asked = || panic!("the device says what it is");
        for gpu in [
            WgpuDevice::DiscreteGpu(0),
            WgpuDevice::IntegratedGpu(1),
            WgpuDevice::VirtualGpu(0),
        ] {
            assert!(!wgpu_may_be_cpu(&gpu, never_asked), "{gpu:?}");
        }
        assert!(wgpu_may_be_cpu(&WgpuDevice::Cpu, never_asked));
        for chosen_by_wgpu in [WgpuDevice::DefaultDevice, WgpuDevice::Existing(0)] {
            for cpu_adapter in [false, true] {
                assert_eq!(
                    wgpu_may_be_cpu(&chosen_by_wgpu, || cpu_adapter),
                    cpu_adapter,
                    "{chosen_by_wgpu:?}, CPU adapter found: {cpu_adapter}"
                );
            }
        }
    }

    /// Runs test `name` of this binary alone in a child process with `WILDFIRE_KERNELS=value`
    /// (the variable is read once per process, and setting it in a threaded test binary is
    /// unsafe); its combined output, and whether it passed.
    fn child(name: &str, value: &str) -> (bool, String) {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--include-ignored"])
            .env("WILDFIRE_KERNELS", value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        (
            out.status.success() && text.contains("1 passed"),
            text.into_owned(),
        )
    }

    /// The child side: prints what the environment decided.
    #[test]
    #[ignore = "run by `the_environment_decides_and_a_bad_value_is_named` in a child process"]
    fn report_kernels_enabled() {
        println!("kernels enabled: {}", super::kernels_enabled());
    }

    #[test]
    fn the_environment_decides_and_a_bad_value_is_named() {
        let name = "kernels::route::tests::report_kernels_enabled";
        for (value, enabled) in [("cubecl", true), ("reference", false)] {
            let (passed, text) = child(name, value);
            assert!(passed, "WILDFIRE_KERNELS={value}:\n{text}");
            assert!(
                text.contains(&format!("kernels enabled: {enabled}")),
                "{text}"
            );
        }
        let (passed, text) = child(name, "fast");
        assert!(!passed, "WILDFIRE_KERNELS=fast was accepted:\n{text}");
        assert!(
            text.contains("WILDFIRE_KERNELS=\"fast\": expected `cubecl` or `reference`"),
            "{text}"
        );
    }
}
