//! Which device a rank computes on, as a user names it (`cpu`, `wgpu`, `cuda`, `cuda:1`), and
//! the rule that gives every rank of a job a device of its own: the named index for a single
//! process, else the launcher's `LOCAL_RANK` (`wildfire launch`, torchrun, Slurm), else the
//! rank's index among the threads of this process.
//!
//! [`RankDevice`] turns that index into a backend's device, or an error naming how many devices
//! of the kind this machine has. It is implemented for Flex (the CPU: one device, every rank
//! shares it), Burn's CubeCL backend on wgpu (the adapter of that index, or the one adapter when
//! there is one) and on CUDA (`cuda:N`), bare or under Burn's fusion, and through
//! [`crate::Parallel`] and Burn's `Autodiff` for the decorated backends.
//!
//! **The GPU backends are fused.** [`FusedCuda`] and [`FusedWgpu`] are Burn's CubeCL backends
//! under Burn's fusion (`Fusion<CubeBackend<..>>`, what Burn's `Cuda` and `Wgpu` are with its
//! default features): chains of elementwise ops, and elementwise work around a matmul or a
//! reduction, run as one kernel each, where the bare backend launches one kernel per op. The
//! decorator wraps the fused backend (`Parallel<FusedCuda>`), so its overrides see fused tensors
//! and queue wildfire's kernels in the fusion stream ([`crate::fusion`]). wgpu is fused too: it is
//! the CPU twin of CUDA, the path the tests can run.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_flex::Flex;
use burn_fusion::{Fusion, FusionBackend};

use crate::Parallel;

/// What `--device wgpu` trains on: Burn's CubeCL backend on wgpu (Vulkan; lavapipe on a machine
/// without a GPU) under Burn's fusion (see the module doc).
#[cfg(feature = "wgpu")]
pub type FusedWgpu = Fusion<CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>>;

/// What `--device cuda` trains on: Burn's CubeCL backend on CUDA under Burn's fusion, autotuned
/// (see the module doc).
#[cfg(feature = "cuda")]
pub type FusedCuda = Fusion<CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;

/// The kinds of device a rank can compute on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// The host's cores, through Burn's Flex backend.
    #[default]
    Cpu,
    /// A Vulkan, Metal or DirectX adapter through Burn's Wgpu backend (on a machine without a GPU,
    /// Mesa's lavapipe emulates one on the CPU).
    Wgpu,
    /// An NVIDIA GPU through Burn's Cuda backend (a build with `--features cuda`).
    Cuda,
}

impl DeviceKind {
    /// The name users write.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }
}

/// A device as a user names it: a kind and, for a single process, which one (`cuda:1`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    /// The local index; `None` lets [`DeviceSpec::ordinal`] choose one per rank.
    pub index: Option<usize>,
}

impl DeviceSpec {
    /// The local index of the device that a rank uses: the spec's own index, else
    /// `local_rank` (the launcher's `LOCAL_RANK`), else `thread_rank` (the rank's index among
    /// the ranks that are threads of this process).
    ///
    /// A spec with an index is for one process: several local ranks on one named device would
    /// share it without saying so, so that is an error naming both.
    pub fn ordinal(
        &self,
        local_rank: Option<usize>,
        thread_rank: usize,
    ) -> Result<usize, DeviceError> {
        match (self.index, local_rank) {
            (Some(index), Some(local)) if local > 0 => Err(DeviceError::IndexUnderLauncher {
                spec: *self,
                index,
                local_rank: local,
            }),
            (Some(index), _) => Ok(index),
            (None, Some(local)) => Ok(local),
            (None, None) => Ok(thread_rank),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())?;
        match self.index {
            Some(index) => write!(f, ":{index}"),
            None => Ok(()),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (kind, index) = match text.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (text, None),
        };
        let kind = match kind {
            "cpu" => DeviceKind::Cpu,
            "wgpu" => DeviceKind::Wgpu,
            "cuda" => DeviceKind::Cuda,
            _ => {
                return Err(format!(
                    "unknown device {text:?} (expected cpu, wgpu, wgpu:N, cuda or cuda:N)"
                ));
            }
        };
        let index = index
            .map(|index| {
                index
                    .parse::<usize>()
                    .map_err(|_| format!("device {text:?}: the index {index:?} is not a number"))
            })
            .transpose()?;
        if kind == DeviceKind::Cpu && index.is_some() {
            return Err(format!(
                "device {text:?}: the CPU is one device, it takes no index"
            ));
        }
        Ok(Self { kind, index })
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a rank has no device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "rank needs {kind} device {ordinal}, but this machine has {count} {kind} device(s) \
         (a launched job starts at most that many ranks per host)",
        kind = kind.name()
    )]
    NoSuchDevice {
        kind: DeviceKind,
        ordinal: usize,
        count: usize,
    },
    #[error(
        "--device {spec} names device {index} for a single process, but this is local rank \
         {local_rank} of a launched job: pass --device {kind} and each rank takes device \
         LOCAL_RANK",
        kind = spec.kind.name()
    )]
    IndexUnderLauncher {
        spec: DeviceSpec,
        index: usize,
        local_rank: usize,
    },
    #[error("--device {kind} is not available: {why}", kind = kind.name())]
    Unavailable { kind: DeviceKind, why: String },
}

/// A backend whose devices a rank can be given by local index.
pub trait RankDevice: Backend {
    /// The kind of device the backend computes on.
    const KIND: DeviceKind;

    /// The device of local index `ordinal`.
    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError>;

    /// The device's name and dense bf16 peak FLOP/s, when it is a GPU of [`known_peak_flops`].
    fn data_sheet_peak(_device: &Self::Device) -> Option<(String, f64)> {
        None
    }
}

impl RankDevice for Flex {
    const KIND: DeviceKind = DeviceKind::Cpu;

    /// The CPU: every rank shares the one device (its thread pool).
    fn device_at(_ordinal: usize) -> Result<Self::Device, DeviceError> {
        Ok(Default::default())
    }
}

#[cfg(feature = "wgpu")]
impl<F: FloatElement, I: IntElement, BT: BoolElement> RankDevice
    for CubeBackend<cubecl::wgpu::WgpuRuntime, F, I, BT>
{
    const KIND: DeviceKind = DeviceKind::Wgpu;

    /// The one adapter when the machine has one (every rank shares it, as the ranks of a CPU
    /// machine share lavapipe), else discrete GPU `ordinal`.
    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError> {
        use burn::backend::wgpu::WgpuDevice;
        let unavailable = |why| DeviceError::Unavailable {
            kind: Self::KIND,
            why,
        };
        let default = crate::kernels::probe::wgpu().map_err(unavailable)?;
        // Type 4 is cubecl-wgpu's "any adapter", type 0 its discrete GPUs.
        if Self::device_count(4) <= 1 {
            return Ok(default);
        }
        let count = Self::device_count(0);
        if ordinal >= count {
            return Err(DeviceError::NoSuchDevice {
                kind: Self::KIND,
                ordinal,
                count,
            });
        }
        Ok(WgpuDevice::DiscreteGpu(ordinal))
    }
}

#[cfg(feature = "cuda")]
impl<F: FloatElement, I: IntElement, BT: BoolElement> RankDevice
    for CubeBackend<cubecl::cuda::CudaRuntime, F, I, BT>
{
    const KIND: DeviceKind = DeviceKind::Cuda;

    /// `cuda:ordinal`, once the driver has answered and counted the devices.
    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError> {
        let unavailable = |why: String| DeviceError::Unavailable {
            kind: Self::KIND,
            why,
        };
        crate::comm::nccl_device::check_cuda_driver().map_err(|e| unavailable(e.to_string()))?;
        keep_compiled_kernels();
        let count = cudarc::driver::CudaContext::device_count()
            .map_err(|e| unavailable(format!("the driver cannot count its devices: {e:?}")))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(DeviceError::NoSuchDevice {
                kind: Self::KIND,
                ordinal,
                count,
            });
        }
        Ok(burn::backend::cuda::CudaDevice::new(ordinal))
    }

    fn data_sheet_peak(device: &Self::Device) -> Option<(String, f64)> {
        let name = cuda_device_name(device.index).ok()?;
        let peak = known_peak_flops(&name)?;
        Some((name, peak))
    }
}

/// Makes CubeCL keep the kernels it compiles across runs, as it keeps Burn's autotune results
/// by default (the first step of a run otherwise compiles every kernel anew: on CUDA, PTX from
/// NVRTC). Unless CubeCL's configuration (a `cubecl.toml` in the working directory or above it,
/// or `CUBECL_*` variables) names a compilation cache, it goes where the autotune cache does by
/// default: the Cargo project's `target/` folder, or the user's cache folder outside one.
/// Nothing changes once CubeCL has read its configuration: call it before the first device.
/// Returns whether it set the cache.
pub fn keep_compiled_kernels() -> bool {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut state = CubeClRuntimeConfig::storage().lock();
    if state.is_some() {
        return false;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    let set = config.compilation.cache.is_none();
    if set {
        config.compilation.cache = Some(CacheConfig::Target);
    }
    *state = Some(std::sync::Arc::new(config));
    set
}

impl<B: RankDevice> RankDevice for Parallel<B> {
    const KIND: DeviceKind = B::KIND;

    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError> {
        B::device_at(ordinal)
    }

    fn data_sheet_peak(device: &Self::Device) -> Option<(String, f64)> {
        B::data_sheet_peak(device)
    }
}

/// A fused backend computes on its inner backend's devices.
impl<B: RankDevice + FusionBackend> RankDevice for Fusion<B> {
    const KIND: DeviceKind = B::KIND;

    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError> {
        B::device_at(ordinal)
    }

    fn data_sheet_peak(device: &Self::Device) -> Option<(String, f64)> {
        B::data_sheet_peak(device)
    }
}

impl<B: RankDevice, C: CheckpointStrategy> RankDevice for Autodiff<B, C> {
    const KIND: DeviceKind = B::KIND;

    fn device_at(ordinal: usize) -> Result<Self::Device, DeviceError> {
        B::device_at(ordinal)
    }

    fn data_sheet_peak(device: &Self::Device) -> Option<(String, f64)> {
        B::data_sheet_peak(device)
    }
}

/// The name of CUDA device `ordinal` as the driver reports it (`NVIDIA H200`), for
/// [`known_peak_flops`].
#[cfg(feature = "cuda")]
pub fn cuda_device_name(ordinal: usize) -> Result<String, DeviceError> {
    let unavailable = |why: String| DeviceError::Unavailable {
        kind: DeviceKind::Cuda,
        why,
    };
    let context = cudarc::driver::CudaContext::new(ordinal)
        .map_err(|e| unavailable(format!("device {ordinal} does not open: {e:?}")))?;
    context
        .name()
        .map_err(|e| unavailable(format!("device {ordinal} has no name: {e:?}")))
}

/// Dense bf16 tensor-core peaks (FLOP/s, without sparsity) of the GPUs people train on, from
/// their makers' data sheets, by a substring of the driver's device name. More specific names
/// come first (`H100 PCIe` before `H100`).
const KNOWN_PEAKS: &[(&str, f64)] = &[
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
];

/// The dense bf16 peak of a GPU the driver names `device_name`, when it is one wildfire knows.
pub fn known_peak_flops(device_name: &str) -> Option<f64> {
    KNOWN_PEAKS
        .iter()
        .find(|(name, _)| device_name.contains(name))
        .map(|&(_, peak)| peak)
}

/// The f32 matmul FLOP/s that backend `B` reaches on `device`: square products of side `side`,
/// repeated for at least `budget` seconds after one warm-up product, timed to the last result's
/// arrival on the host. On the CPU this is what the machine's cores reach with the run's thread
/// pool, the honest denominator of MFU where no data-sheet peak applies.
pub fn measure_matmul_flops<B: Backend>(
    device: &B::Device,
    side: usize,
    budget: std::time::Duration,
) -> f64 {
    let a = Tensor::<B, 2>::random([side, side], Distribution::Default, device);
    let b = Tensor::<B, 2>::random([side, side], Distribution::Default, device);
    // The warm-up compiles the kernel (wgpu, CUDA) and fills the allocator's pools.
    let _ = a.clone().matmul(b.clone()).into_data();
    let started = Instant::now();
    let mut products = 0u32;
    while started.elapsed() < budget || products == 0 {
        let _ = a.clone().matmul(b.clone()).into_data();
        products += 1;
    }
    let flops = 2.0 * (side as f64).powi(3) * f64::from(products);
    flops / started.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_print_as_written() {
        for text in ["cpu", "wgpu", "wgpu:1", "cuda", "cuda:3"] {
            let spec: DeviceSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        assert_eq!(
            "cuda:2".parse::<DeviceSpec>().unwrap(),
            DeviceSpec {
                kind: DeviceKind::Cuda,
                index: Some(2)
            }
        );
        let error = "tpu".parse::<DeviceSpec>().unwrap_err();
        assert!(
            error.contains("\"tpu\"") && error.contains("cuda:N"),
            "{error}"
        );
        let error = "cuda:x".parse::<DeviceSpec>().unwrap_err();
        assert!(error.contains("\"x\""), "{error}");
        assert!("cpu:1".parse::<DeviceSpec>().is_err());
    }

    #[test]
    fn each_rank_takes_its_local_device_unless_one_is_named() {
        let cuda: DeviceSpec = "cuda".parse().unwrap();
        assert_eq!(cuda.ordinal(Some(3), 0).unwrap(), 3);
        assert_eq!(cuda.ordinal(None, 2).unwrap(), 2);
        let named: DeviceSpec = "cuda:1".parse().unwrap();
        assert_eq!(named.ordinal(None, 0).unwrap(), 1);
        assert_eq!(named.ordinal(Some(0), 0).unwrap(), 1);
        let error = named.ordinal(Some(2), 0).unwrap_err().to_string();
        assert!(
            error.contains("cuda:1") && error.contains("local rank 2"),
            "{error}"
        );
    }

    #[test]
    fn a_missing_device_is_named_with_the_count() {
        let error = DeviceError::NoSuchDevice {
            kind: DeviceKind::Cuda,
            ordinal: 4,
            count: 2,
        }
        .to_string();
        assert!(
            error.contains("cuda device 4") && error.contains("has 2"),
            "{error}"
        );
    }

    #[test]
    fn known_gpus_have_their_dense_bf16_peak() {
        assert_eq!(known_peak_flops("NVIDIA H200"), Some(989.4e12));
        assert_eq!(known_peak_flops("NVIDIA H100 PCIe"), Some(756.0e12));
        assert_eq!(known_peak_flops("NVIDIA H100 80GB HBM3"), Some(989.4e12));
        assert_eq!(known_peak_flops("NVIDIA A100-SXM4-80GB"), Some(312.0e12));
        assert_eq!(known_peak_flops("NVIDIA GeForce RTX 4090"), None);
    }

    /// The child side of the next test: CubeCL's configuration after [`keep_compiled_kernels`].
    #[test]
    #[ignore = "run by `compiled_kernels_are_kept_unless_configured` in a child process"]
    fn report_kept_compiled_kernels() {
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
        let (first, second) = (keep_compiled_kernels(), keep_compiled_kernels());
        let cache = CubeClRuntimeConfig::get().compilation.cache.clone();
        println!("set: {first} then {second}; cache: {cache:?}");
    }

    /// In a process of its own (CubeCL reads its configuration once per process), from a
    /// folder without a `cubecl.toml`: the compilation cache is set to CubeCL's default place
    /// once, and a second call changes nothing.
    #[test]
    fn compiled_kernels_are_kept_unless_configured() {
        let dir = std::env::temp_dir().join(format!("wildfire-cubecl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "device::tests::report_kept_compiled_kernels"])
            .args(["--nocapture", "--include-ignored"])
            .current_dir(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        std::fs::remove_dir_all(&dir).ok();
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        assert!(
            text.contains("set: true then false; cache: Some(Target)"),
            "{text}"
        );
    }

    #[test]
    fn the_matmul_probe_measures_a_positive_rate() {
        let flops = measure_matmul_flops::<Flex>(
            &Default::default(),
            64,
            std::time::Duration::from_millis(5),
        );
        assert!(flops.is_finite() && flops > 1e6, "{flops}");
    }
}
