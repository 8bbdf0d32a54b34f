//! The backend behind `--device`: the recipe is generic over the backend it trains on, and this
//! is where a device kind named at run time picks the backend type (`Parallel<Flex>`,
//! `Parallel<FusedWgpu>`, `Parallel<FusedCuda>` in a build with `--features cuda`: Burn's CubeCL
//! backends under Burn's fusion, see `wildfire_backend::device`).

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use wildfire_backend::device::{DeviceKind, DeviceSpec, FusedWgpu, RankDevice};
use wildfire_backend::{DecoratedBackend, Parallel};

use crate::TrainBackend;

/// A decorated backend the recipe runs on, with its two autodiff flavours: plain, and Burn's
/// `BalancedCheckpointing` for selective activation checkpointing.
pub trait DeviceBackend: DecoratedBackend + RankDevice {
    type Train: TrainBackend<InnerBackend = Self>;
    type TrainSelective: TrainBackend<InnerBackend = Self>;
}

impl<B> DeviceBackend for Parallel<B>
where
    Parallel<B>: DecoratedBackend + RankDevice,
    Autodiff<Parallel<B>>: TrainBackend<InnerBackend = Parallel<B>>,
    Autodiff<Parallel<B>, BalancedCheckpointing>: TrainBackend<InnerBackend = Parallel<B>>,
{
    type Train = Autodiff<Parallel<B>>;
    type TrainSelective = Autodiff<Parallel<B>, BalancedCheckpointing>;
}

/// The device of a command that runs in one process (generate, export): `spec`'s index, else
/// the first device of its kind.
pub fn process_device<B: DeviceBackend>(spec: DeviceSpec) -> anyhow::Result<B::Device> {
    Ok(B::device_at(spec.ordinal(None, 0)?)?)
}

/// Work that runs on whichever backend the device kind picks.
pub trait DeviceJob {
    type Output;
    fn run<B: DeviceBackend>(self) -> anyhow::Result<Self::Output>;
}

/// Runs `job` on the backend of device kind `kind`; `cuda` in a build without the feature is
/// an error that says how to build it.
pub fn on_device<J: DeviceJob>(kind: DeviceKind, job: J) -> anyhow::Result<J::Output> {
    match kind {
        DeviceKind::Cpu => job.run::<Parallel<Flex>>(),
        DeviceKind::Wgpu => job.run::<Parallel<FusedWgpu>>(),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => job.run::<Parallel<wildfire_backend::device::FusedCuda>>(),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => anyhow::bail!(
            "--device cuda needs a wildfire built with CUDA: cargo build --release --features \
             cuda (this build has cpu and wgpu)"
        ),
    }
}
