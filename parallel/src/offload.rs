//! AdamW for Burn's optimizer adaptor whose moments may live in host memory (ZeRO-Offload's
//! placement): what [`crate::DataParallel::adamw`] steps under DDP and ZeRO 3, where the
//! Learner's model holds the parameters (whole, or a unit's rows) and Burn's adaptor keeps a
//! state per parameter.
//!
//! On the device, a step is [`FusedAdamW`]'s. In host memory (`offload`), each step copies the
//! parameter and its gradient to the host (Burn's `Flex` backend), runs the same [`FusedAdamW`]
//! there against moments that never leave the host, and copies the parameter back: the device
//! holds no moments (`8` bytes per parameter element it steps), for two copies of the parameter
//! and one of the gradient per step. AdamW is elementwise and both sides run the same f32
//! operations, so on the CPU the two placements give bitwise the same parameters.

use burn::backend::Flex;
use burn::optim::{AdamWState, SimpleOptimizer};
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor};
use wildfire_backend::host_data::aligned;
use wildfire_backend::kernels::adamw::FusedAdamW;

/// [`FusedAdamW`] with its moments on the parameters' device, or in host memory.
#[derive(Debug, Clone)]
pub struct PlacedAdamW {
    adamw: FusedAdamW,
    host: bool,
}

impl PlacedAdamW {
    /// `adamw`, keeping its moments in host memory when `offload`.
    pub fn new(adamw: FusedAdamW, offload: bool) -> Self {
        Self {
            adamw,
            host: offload,
        }
    }
}

/// One parameter's AdamW moments where [`PlacedAdamW`] keeps them.
#[derive(Clone)]
pub enum PlacedMoments<B: Backend, const D: usize> {
    Device(AdamWState<B, D>),
    Host(Box<AdamWState<Flex, D>>),
}

impl<B: Backend, const D: usize> std::fmt::Debug for PlacedMoments<B, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (place, time) = match self {
            Self::Device(state) => ("device", state.momentum.time),
            Self::Host(state) => ("host", state.momentum.time),
        };
        write!(f, "PlacedMoments({place}, step {time})")
    }
}

impl<B: Backend, const D: usize> PlacedMoments<B, D> {
    /// Placed in host memory (`host`) or on `device`.
    pub fn placed(self, host: bool, device: &Device<B>) -> Self {
        match (self, host) {
            (Self::Device(state), true) => Self::Host(Box::new(moved(state, &Default::default()))),
            (Self::Host(state), false) => Self::Device(moved(*state, device)),
            (state, _) => state,
        }
    }

    /// The moments on `device`, wherever they are.
    pub fn on_device(self, device: &Device<B>) -> AdamWState<B, D> {
        match self {
            Self::Device(state) => state,
            Self::Host(state) => moved(*state, device),
        }
    }
}

/// `state` copied to `device` of another backend.
fn moved<B: Backend, C: Backend, const D: usize>(
    state: AdamWState<B, D>,
    device: &Device<C>,
) -> AdamWState<C, D> {
    let copy = |tensor: Tensor<B, D>| Tensor::from_data(aligned(tensor.into_data()), device);
    let momentum = state.momentum;
    AdamWState::new(burn::optim::AdaptiveMomentumState {
        time: momentum.time,
        moment_1: copy(momentum.moment_1),
        moment_2: copy(momentum.moment_2),
        max_moment_2: momentum.max_moment_2.map(copy),
    })
}

/// Recorded as host AdamW moments, and loaded into host memory (the next step places them).
impl<B: Backend, const D: usize> Record<B> for PlacedMoments<B, D> {
    type Item<S: PrecisionSettings> = <AdamWState<Flex, D> as Record<Flex>>::Item<S>;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        match self.placed(true, &Default::default()) {
            Self::Host(state) => state.into_item(),
            Self::Device(_) => unreachable!("placed in host memory"),
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &Device<B>) -> Self {
        Self::Host(Box::new(AdamWState::from_item(item, &Default::default())))
    }
}

impl<B: Backend> SimpleOptimizer<B> for PlacedAdamW {
    type State<const D: usize> = PlacedMoments<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let device = param.device();
        if !self.host {
            let state = state.map(|s| s.on_device(&device));
            let (param, state) = SimpleOptimizer::<B>::step(&self.adamw, lr, param, grad, state);
            return (param, state.map(PlacedMoments::Device));
        }
        let host = Default::default();
        let to_host = |t: Tensor<B, D>| Tensor::<Flex, D>::from_data(aligned(t.into_data()), &host);
        let state = state.map(|s| match s.placed(true, &device) {
            PlacedMoments::Host(state) => *state,
            PlacedMoments::Device(_) => unreachable!("placed in host memory"),
        });
        let (param, state) =
            SimpleOptimizer::<Flex>::step(&self.adamw, lr, to_host(param), to_host(grad), state);
        let param = Tensor::from_data(param.into_data(), &device);
        (
            param,
            state.map(|state| PlacedMoments::Host(Box::new(state))),
        )
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        match state {
            PlacedMoments::Device(state) => {
                PlacedMoments::Device(<FusedAdamW as SimpleOptimizer<B>>::to_device(state, device))
            }
            host => host,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    #[test]
    fn host_moments_step_bitwise_as_device_moments() {
        let adamw = FusedAdamW::new(0.9, 0.999, 1e-8, 0.01);
        let device = Default::default();
        let tensor = |values: Vec<f32>| {
            Tensor::<Flex, 2>::from_data(TensorData::new(values, [2, 3]), &device)
        };
        let grads = [
            vec![0.1, -0.2, 0.3, 0.0, 1e-3, -4.0],
            vec![-0.5, 0.25, 0.125, 2.0, -1e-4, 0.75],
            vec![0.3, 0.3, -0.3, 0.1, 0.2, 0.0],
        ];
        let run = |offload: bool| {
            let optimizer = PlacedAdamW::new(adamw.clone(), offload);
            let mut param = tensor(vec![1.0, -1.0, 0.5, 0.25, -0.125, 3.0]);
            let mut state = None;
            for grad in &grads {
                let stepped = SimpleOptimizer::<Flex>::step(
                    &optimizer,
                    1e-2,
                    param,
                    tensor(grad.clone()),
                    state,
                );
                (param, state) = stepped;
            }
            let state = state.expect("three steps made moments");
            assert_eq!(matches!(state, PlacedMoments::Host(_)), offload);
            (
                param.into_data(),
                state.on_device(&device).momentum.moment_2.into_data(),
            )
        };
        let (on_device, offloaded) = (run(false), run(true));
        assert_eq!(
            on_device.0.as_slice::<f32>().unwrap(),
            offloaded.0.as_slice::<f32>().unwrap()
        );
        assert_eq!(
            on_device.1.as_slice::<f32>().unwrap(),
            offloaded.1.as_slice::<f32>().unwrap()
        );
    }
}
