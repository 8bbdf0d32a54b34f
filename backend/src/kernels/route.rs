//! Which implementation a kernel call takes, by the type of the backend's tensor primitive:
//!
//! - a CubeCL runtime's tensor (`CubeTensor<WgpuRuntime>` with the `wgpu` feature,
//!   `CubeTensor<CudaRuntime>` with `cuda`: Burn's bare `Wgpu` and `Cuda`, alone or inside
//!   `Parallel<_>`): the CubeCL kernel, launched at once ([`on_cube`]);
//! - a tensor of Burn's fusion backend over one of those runtimes (`Fusion<CubeBackend<..>>`,
//!   [`crate::device::FusedWgpu`] and [`crate::device::FusedCuda`]): the same kernel, queued in
//!   the fusion stream as a custom operation ([`crate::fusion`]);
//! - Flex's tensor (Burn's CPU backend): the native loops of [`super::flex`] ([`on_flex`]);
//! - otherwise, or when a kernel declines its inputs (a dtype, a shape outside its range): the
//!   reference in Burn tensor ops.
//!
//! A CubeCL kernel decides whether it takes a call from the inputs' shapes and types alone
//! ([`CubeKernel::outputs`]), before anything is launched or queued: a queued operation cannot
//! decline when its turn comes. The choice is by type and shape, so every rank of a job takes
//! the same path.
//!
//! **Never a silent fallback.** Every call is counted by op and path ([`kernel_paths`]), and the
//! first call of an op on each path is logged (`info`), with the reason when a kernel declined.
//!
//! **The kernels are the default.** `WILDFIRE_KERNELS=reference` (or
//! [`set_kernels_enabled`]`(false)`) sends every call to the reference instead, e.g. to compare
//! the two or to rule the kernels out.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_flex::FlexTensor;

use std::any::TypeId;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use super::cube_kernel::{CubeKernel, TensorSpec};
use crate::fusion::{FusedTensor, queue_kernel};
use crate::typecast::same;

#[cfg(feature = "wgpu")]
use cubecl::wgpu::WgpuDevice;

/// `kernel` on `inputs` (primitives of type `P`) when `P` is a CubeCL tensor or a fused one and
/// the kernel takes them; otherwise the inputs back.
pub(crate) fn on_cube<P: 'static, K: CubeKernel<N, M>, const N: usize, const M: usize>(
    kernel: &K,
    inputs: [P; N],
) -> Result<[P; M], [P; N]> {
    if !kernels_enabled() {
        return Err(inputs);
    }
    #[cfg(feature = "wgpu")]
    let inputs = match on_runtime::<cubecl::wgpu::WgpuRuntime, P, K, N, M>(kernel, inputs) {
        Ok(outputs) => return Ok(outputs),
        Err(inputs) => inputs,
    };
    #[cfg(feature = "cuda")]
    let inputs = match on_runtime::<cubecl::cuda::CudaRuntime, P, K, N, M>(kernel, inputs) {
        Ok(outputs) => return Ok(outputs),
        Err(inputs) => inputs,
    };
    let _ = kernel;
    Err(inputs)
}

/// [`on_cube`] for runtime `R`: its tensors launch the kernel, its fused tensors queue it.
fn on_runtime<R: CubeRuntime, P: 'static, K: CubeKernel<N, M>, const N: usize, const M: usize>(
    kernel: &K,
    inputs: [P; N],
) -> Result<[P; M], [P; N]> {
    let launched = on_primitive::<CubeTensor<R>, _, N, M>(inputs, |tensors| {
        let device = tensors[0].device.clone();
        when_taken::<R, _, K, N, M>(
            kernel,
            tensors,
            &device,
            KernelPath::CubeCl,
            |tensors, _| kernel.launch(tensors),
        )
    });
    let inputs = match launched {
        Ok(outputs) => return Ok(outputs),
        Err(inputs) => inputs,
    };
    on_primitive::<FusedTensor<R>, _, N, M>(inputs, |tensors| {
        let device = tensors[0].client.device().clone();
        let path = KernelPath::CubeClFused;
        when_taken::<R, _, K, N, M>(kernel, tensors, &device, path, |tensors, outputs| {
            queue_kernel(kernel.clone(), tensors, outputs)
        })
    })
}

/// `run` on `tensors` (with the outputs' shapes and types) when `kernel` takes them on `device`,
/// counted on `path`; otherwise the tensors back, the kernel's reason noted.
fn when_taken<R, T, K, const N: usize, const M: usize>(
    kernel: &K,
    tensors: [T; N],
    device: &R::Device,
    path: KernelPath,
    run: impl FnOnce([T; N], [TensorSpec; M]) -> [T; M],
) -> Result<[T; M], [T; N]>
where
    R: CubeRuntime,
    T: TensorMetadata,
    K: CubeKernel<N, M>,
{
    let specs = tensors.each_ref().map(TensorSpec::of);
    match kernel.outputs::<R>(&specs, device) {
        Ok(outputs) => {
            record(kernel.op(), path);
            Ok(run(tensors, outputs))
        }
        Err(reason) => {
            declined(kernel.op(), &reason);
            Err(tensors)
        }
    }
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
/// takes them, counted under `op`; otherwise the inputs back.
pub(crate) fn on_flex<P: 'static, const N: usize, const M: usize>(
    op: &'static str,
    inputs: [P; N],
    launch: impl FnOnce([FlexTensor; N]) -> Option<[FlexTensor; M]>,
) -> Result<[P; M], [P; N]> {
    on_flex_owned(op, inputs, handing_back(launch))
}

/// [`on_flex`] for a launch that owns its inputs: it hands them back itself when it declines
/// them, so no other handle to their memory is kept while it runs, and a launch that takes
/// them can write into that memory (Flex's copy-on-write then copies nothing).
pub(crate) fn on_flex_owned<P: 'static, const N: usize, const M: usize>(
    op: &'static str,
    inputs: [P; N],
    launch: impl FnOnce([FlexTensor; N]) -> Result<[FlexTensor; M], [FlexTensor; N]>,
) -> Result<[P; M], [P; N]> {
    if !kernels_enabled() {
        return Err(inputs);
    }
    let outputs = on_primitive(inputs, launch)?;
    record(op, KernelPath::Flex);
    Ok(outputs)
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

/// The implementation a call of an op took.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KernelPath {
    /// A CubeCL kernel, launched at once (Burn's bare CubeCL backends).
    CubeCl,
    /// A CubeCL kernel, queued in Burn's fusion stream as a custom operation.
    CubeClFused,
    /// Flex's native loops.
    Flex,
    /// A vendor library's kernel (cuBLASLt's GEMM), on the stream CubeCL launches on.
    Vendor,
    /// The reference in Burn tensor ops.
    Reference,
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::CubeCl => "the CubeCL kernel",
            Self::CubeClFused => "the CubeCL kernel in the fusion stream",
            Self::Flex => "Flex's native loops",
            Self::Vendor => "the vendor library's kernel",
            Self::Reference => "the reference in Burn ops",
        })
    }
}

/// Calls per op and path in this process.
static TAKEN: Mutex<BTreeMap<(&'static str, KernelPath), u64>> = Mutex::new(BTreeMap::new());

/// Ops whose kernel declined a call, with the first reason (logged once per op).
static DECLINED: Mutex<BTreeMap<&'static str, String>> = Mutex::new(BTreeMap::new());

/// Counts a call of `op` on `path`; the first of each is logged.
pub(crate) fn record(op: &'static str, path: KernelPath) {
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let count = taken.entry((op, path)).or_insert(0);
    if *count == 0 {
        log::info!("kernels: {op} takes {path}");
    }
    *count += 1;
}

/// Notes that `op`'s kernel declined a call (logged the first time, at `debug` after).
pub(crate) fn declined(op: &'static str, reason: &str) {
    let mut declined = DECLINED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    match declined.contains_key(op) {
        true => log::debug!("kernels: {op}'s kernel declined a call: {reason}"),
        false => {
            log::info!("kernels: {op}'s kernel declined a call: {reason}");
            declined.insert(op, reason.to_owned());
        }
    }
}

/// Counts a call of `op` that ran the reference (every op's router calls it on that path).
pub(crate) fn took_reference(op: &'static str) {
    record(op, KernelPath::Reference);
}

/// How many calls of each op took each path in this process so far, by op and path.
pub fn kernel_paths() -> Vec<(&'static str, KernelPath, u64)> {
    let taken = TAKEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    taken
        .iter()
        .map(|(&(op, path), &count)| (op, path, count))
        .collect()
}

/// [`kernel_paths`] as lines, `attention forward: the CubeCL kernel in the fusion stream ×60`,
/// each reference path followed by the reason the op's kernel first declined, if it did.
pub fn describe_kernel_paths() -> Vec<String> {
    let declined = DECLINED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    kernel_paths()
        .into_iter()
        .map(|(op, path, count)| {
            let why = match (path, declined.get(op)) {
                (KernelPath::Reference, Some(reason)) => {
                    format!(" (its kernel declined: {reason})")
                }
                _ => String::new(),
            };
            format!("{op}: {path} ×{count}{why}")
        })
        .collect()
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

/// The CubeCL runtime whose kernels primitives of type `P` run, bare or fused, if any: `"wgpu"`
/// or `"cuda"`.
pub fn cube_runtime<P: 'static>() -> Option<&'static str> {
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn is_of<P: 'static, R: CubeRuntime>() -> bool {
        let p = TypeId::of::<P>();
        p == TypeId::of::<CubeTensor<R>>() || p == TypeId::of::<FusedTensor<R>>()
    }
    #[cfg(feature = "wgpu")]
    if is_of::<P, cubecl::wgpu::WgpuRuntime>() {
        return Some("wgpu");
    }
    #[cfg(feature = "cuda")]
    if is_of::<P, cubecl::cuda::CudaRuntime>() {
        return Some("cuda");
    }
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
