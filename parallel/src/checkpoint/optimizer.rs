//! Burn's Adam and AdamW state in a checkpoint, by parameter path. Each moment has its
//! parameter's shape and is updated elementwise, so a rank's moment is the same part of the
//! whole moment as its parameter is of the whole parameter: it is stored as the parameter's
//! boxes, under PyTorch's names (`optim.exp_avg.<path>`, `optim.exp_avg_sq.<path>`), and the
//! step count `t` of the bias correction as `optim.step.<path>` (one i64, written by the first
//! tensor-parallel rank). Loaded into the optimizer of the module under another plan or pipeline
//! cut ([`ModuleLayout`]), each rank's state is its part of the whole moments, keyed by the ids
//! of its parameters.

use std::collections::{BTreeMap, HashMap};

use burn::module::{AutodiffModule, Module, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    Adam, AdamState, AdamW, AdamWState, AdaptiveMomentumState, Optimizer, SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use super::module::ModuleLayout;
use super::slices::to_slice;
use super::store::{CheckpointError, TensorSlice, invalid_slice};
use crate::fsdp::FullMoments;
use crate::paths::{ParamFn, for_each_param};

/// The prefixes of the stored names of a parameter's moments (PyTorch's names): the first, the
/// second, AMSGrad's running maximum of the second (when the optimizer keeps it), and the step
/// count.
pub const EXP_AVG: &str = "optim.exp_avg.";
pub const EXP_AVG_SQ: &str = "optim.exp_avg_sq.";
pub const MAX_EXP_AVG_SQ: &str = "optim.max_exp_avg_sq.";
pub const STEP: &str = "optim.step.";

/// An optimizer whose per-parameter state is Burn's adaptive momentum: a step count and moments
/// shaped as the parameter, updated elementwise (Adam's and AdamW's).
pub trait MomentState<B: Backend>: SimpleOptimizer<B> {
    fn into_momentum<const D: usize>(state: Self::State<D>) -> AdaptiveMomentumState<B, D>;
    fn from_momentum<const D: usize>(momentum: AdaptiveMomentumState<B, D>) -> Self::State<D>;
}

impl<B: Backend> MomentState<B> for AdamW {
    fn into_momentum<const D: usize>(state: AdamWState<B, D>) -> AdaptiveMomentumState<B, D> {
        state.momentum
    }
    fn from_momentum<const D: usize>(momentum: AdaptiveMomentumState<B, D>) -> AdamWState<B, D> {
        AdamWState { momentum }
    }
}

impl<B: Backend> MomentState<B> for Adam {
    fn into_momentum<const D: usize>(state: AdamState<B, D>) -> AdaptiveMomentumState<B, D> {
        state.momentum
    }
    fn from_momentum<const D: usize>(momentum: AdaptiveMomentumState<B, D>) -> AdamState<B, D> {
        AdamState { momentum }
    }
}

/// This rank's slices of the state of `optimizer` (Burn's Adam or AdamW of `module`, as
/// `AdamWConfig::init` builds it) for `module` (split by `layout`'s plan): the
/// moments of every parameter it [stores](ModuleLayout::stores) that has state, and their step
/// counts on the first tensor-parallel rank.
pub fn optimizer_slices<B, M, O>(
    layout: &ModuleLayout,
    module: &M,
    optimizer: &OptimizerAdaptor<O, M, B>,
) -> Result<Vec<TensorSlice>, CheckpointError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: MomentState<B::InnerBackend>,
{
    struct Collect<'a, O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        layout: &'a ModuleLayout,
        records: BTreeMap<burn::module::ParamId, AdaptorRecord<O, B>>,
        slices: Result<Vec<TensorSlice>, CheckpointError>,
    }
    impl<O: MomentState<B::InnerBackend>, B: AutodiffBackend> Collect<'_, O, B> {
        fn state_slices<const D: usize>(
            &mut self,
            path: &str,
            id: burn::module::ParamId,
        ) -> Result<Vec<TensorSlice>, CheckpointError> {
            let Some(record) = self.records.remove(&id) else {
                return Ok(Vec::new());
            };
            if !self.layout.stores(path)? {
                return Ok(Vec::new());
            }
            let momentum = O::into_momentum::<D>(record.into_state());
            let moments = [
                (EXP_AVG, Some(momentum.moment_1)),
                (EXP_AVG_SQ, Some(momentum.moment_2)),
                (MAX_EXP_AVG_SQ, momentum.max_moment_2),
            ];
            let mut slices = Vec::new();
            for (prefix, moment) in moments {
                let Some(moment) = moment else { continue };
                let stored = format!("{prefix}{path}");
                let data = moment.into_data();
                slices.extend(self.layout.param_slices(path, stored, data)?);
            }
            if self.layout.plan.rank == 0 {
                let step = TensorData::new(vec![momentum.time as i64], [1]);
                slices.push(to_slice(format!("{STEP}{path}"), step)?);
            }
            Ok(slices)
        }
    }
    impl<O: MomentState<B::InnerBackend>, B: AutodiffBackend> ParamFn<B> for Collect<'_, O, B> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            if self.slices.is_err() {
                return;
            }
            match (self.state_slices::<D>(path, param.id), &mut self.slices) {
                (Ok(found), Ok(slices)) => slices.extend(found),
                (Err(error), _) => self.slices = Err(error),
                _ => {}
            }
        }
    }
    let mut collect = Collect::<O, B> {
        layout,
        records: optimizer.to_record().into_iter().collect(),
        slices: Ok(Vec::new()),
    };
    for_each_param(module, layout.paths.clone(), &mut collect);
    collect.slices
}

/// `optimizer` with the state of every parameter of `module` that `tensors` (whole, by stored
/// name) holds state for: this rank's part of its moments under `layout`'s plan, keyed by the
/// parameter's id. A parameter without state in the checkpoint keeps none (it starts fresh, as
/// it would have there). Refused before anything is loaded, naming the tensor: a step count
/// without both moments, or a moment whose shape is not the whole parameter's.
pub fn load_optimizer<B, M, O>(
    layout: &ModuleLayout,
    module: &M,
    optimizer: OptimizerAdaptor<O, M, B>,
    tensors: &BTreeMap<String, TensorData>,
) -> Result<OptimizerAdaptor<O, M, B>, CheckpointError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: MomentState<B::InnerBackend>,
{
    let loaded = optimizer_records::<B, M, O>(layout, module, tensors)?;
    let mut record = optimizer.to_record();
    record.extend(loaded);
    Ok(optimizer.load_record(record))
}

/// One parameter's record in Burn's optimizer adaptor over `O`, with the parameter's id.
pub type ParamRecord<O, B> = (ParamId, AdaptorRecord<O, B>);

/// The records Burn's optimizer adaptor over `O` keeps for the parameters of `module` that
/// `tensors` holds state for, by id, as [`load_optimizer`] reads them (for an adaptor whose
/// module holds `module`, e.g. one pipeline stage of several).
pub fn optimizer_records<B, M, O>(
    layout: &ModuleLayout,
    module: &M,
    tensors: &BTreeMap<String, TensorData>,
) -> Result<Vec<ParamRecord<O, B>>, CheckpointError>
where
    B: AutodiffBackend,
    M: Module<B>,
    O: MomentState<B::InnerBackend>,
{
    struct Records<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend>(Vec<ParamRecord<O, B>>);
    impl<O: MomentState<B::InnerBackend>, B: AutodiffBackend> MomentSink<B> for Records<O, B> {
        fn take<const D: usize>(
            &mut self,
            _: &str,
            id: ParamId,
            momentum: AdaptiveMomentumState<B::InnerBackend, D>,
        ) -> Result<(), CheckpointError> {
            let state = O::from_momentum(momentum);
            self.0.push((id, AdaptorRecord::from_state(state)));
            Ok(())
        }
    }
    let mut records = Records::<O, B>(Vec::new());
    read_moments(layout, module, tensors, &mut records)?;
    Ok(records.0)
}

/// The moments of the parameters of `module` that `tensors` holds state for, flattened, by id,
/// as [`load_optimizer`] reads them: what a ZeRO optimizer restores
/// ([`crate::fsdp::ZeroOptimizer::set_moments`]). ZeRO's AdamW keeps no AMSGrad maximum, so a
/// checkpoint with one is refused.
pub fn flat_moments<B: AutodiffBackend, M: Module<B>>(
    layout: &ModuleLayout,
    module: &M,
    tensors: &BTreeMap<String, TensorData>,
) -> Result<HashMap<ParamId, FullMoments<B::InnerBackend>>, CheckpointError> {
    struct Flat<B: Backend>(HashMap<ParamId, FullMoments<B>>);
    impl<A: AutodiffBackend> MomentSink<A> for Flat<A::InnerBackend> {
        fn take<const D: usize>(
            &mut self,
            path: &str,
            id: ParamId,
            momentum: AdaptiveMomentumState<A::InnerBackend, D>,
        ) -> Result<(), CheckpointError> {
            if momentum.max_moment_2.is_some() {
                let reason = "is in the checkpoint, but ZeRO's AdamW keeps no AMSGrad maximum";
                return Err(invalid_slice(
                    &format!("{MAX_EXP_AVG_SQ}{path}"),
                    reason.into(),
                ));
            }
            let numel = momentum.moment_1.shape().num_elements();
            let moments = FullMoments {
                exp_avg: momentum.moment_1.reshape([numel]),
                exp_avg_sq: momentum.moment_2.reshape([numel]),
                time: momentum.time,
            };
            self.0.insert(id, moments);
            Ok(())
        }
    }
    let mut flat = Flat::<B::InnerBackend>(HashMap::new());
    read_moments(layout, module, tensors, &mut flat)?;
    Ok(flat.0)
}

/// Where [`read_moments`] puts each parameter's moments.
trait MomentSink<B: AutodiffBackend> {
    fn take<const D: usize>(
        &mut self,
        path: &str,
        id: ParamId,
        momentum: AdaptiveMomentumState<B::InnerBackend, D>,
    ) -> Result<(), CheckpointError>;
}

/// Hands `sink` this rank's part of the moments of every parameter of `module` that `tensors`
/// holds a step count for (a copy's are its original's, see [`ModuleLayout::with_copy`]).
fn read_moments<B: AutodiffBackend, M: Module<B>, S: MomentSink<B>>(
    layout: &ModuleLayout,
    module: &M,
    tensors: &BTreeMap<String, TensorData>,
    sink: &mut S,
) -> Result<(), CheckpointError> {
    struct Read<'a, S> {
        layout: &'a ModuleLayout,
        tensors: &'a BTreeMap<String, TensorData>,
        sink: &'a mut S,
        error: Option<CheckpointError>,
    }
    impl<B: AutodiffBackend, S: MomentSink<B>> ParamFn<B> for Read<'_, S> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            if self.error.is_some() {
                return;
            }
            let device = param.lazy_device();
            let read =
                local_momentum::<B::InnerBackend, D>(self.layout, self.tensors, path, &device);
            let taken = match read.and_then(|read| fits(read, path, param)) {
                Ok(Some(momentum)) => self.sink.take(path, param.id, momentum),
                Ok(None) => Ok(()),
                Err(error) => Err(error),
            };
            if let Err(error) = taken {
                self.error = Some(error);
            }
        }
    }
    let mut read = Read {
        layout,
        tensors,
        sink,
        error: None,
    };
    for_each_param(module, layout.paths.clone(), &mut read);
    read.error.map_or(Ok(()), Err)
}

/// `momentum` when its moments have the shape of `param` (this rank's part of parameter
/// `path`); refused naming the moment otherwise.
fn fits<B: AutodiffBackend, const D: usize>(
    momentum: Option<AdaptiveMomentumState<B::InnerBackend, D>>,
    path: &str,
    param: &Param<Tensor<B, D>>,
) -> Result<Option<AdaptiveMomentumState<B::InnerBackend, D>>, CheckpointError> {
    let Some(momentum) = momentum else {
        return Ok(None);
    };
    let expected = param.lazy_shape().dims::<D>();
    let part = momentum.moment_1.dims();
    if part != expected {
        let reason = format!(
            "gives this rank a part of {part:?}, but the parameter is {expected:?} (is the \
             layout's plan the one that split the module?)"
        );
        return Err(invalid_slice(&format!("{EXP_AVG}{path}"), reason));
    }
    Ok(Some(momentum))
}

/// This rank's part under `layout`'s plan of the moments of parameter `path` in `tensors`
/// (whole, by stored name), with their step count; `None` when `tensors` has no step count for
/// it.
fn local_momentum<B: Backend, const D: usize>(
    layout: &ModuleLayout,
    tensors: &BTreeMap<String, TensorData>,
    path: &str,
    device: &B::Device,
) -> Result<Option<AdaptiveMomentumState<B, D>>, CheckpointError> {
    let stored = layout.stored_path(path);
    let Some(step) = tensors.get(&format!("{STEP}{stored}")) else {
        return Ok(None);
    };
    let step = (step.to_vec::<i64>().ok())
        .and_then(|steps| steps.first().copied())
        .and_then(|step| usize::try_from(step).ok());
    let step = step.ok_or_else(|| {
        invalid_slice(&format!("{STEP}{stored}"), "is not one i64 ≥ 0".to_string())
    })?;
    let whole_shape = layout.shape(path)?;
    let moment = |prefix: &str| {
        let name = format!("{prefix}{stored}");
        let data = tensors.get(&name)?;
        if data.shape.to_vec() != whole_shape {
            let reason = format!(
                "it is {:?} in the checkpoint, but the whole parameter is {whole_shape:?}",
                data.shape.to_vec()
            );
            return Some(Err(invalid_slice(&name, reason)));
        }
        let whole = Tensor::<B, D>::from_data(data.clone(), device);
        Some(Ok(layout.plan.local_part(path, whole)))
    };
    let needed = |prefix: &str| {
        moment(prefix).unwrap_or_else(|| {
            let reason = format!("is missing, but {STEP}{stored} is in the checkpoint");
            Err(invalid_slice(&format!("{prefix}{stored}"), reason))
        })
    };
    Ok(Some(AdaptiveMomentumState {
        time: step,
        moment_1: needed(EXP_AVG)?,
        moment_2: needed(EXP_AVG_SQ)?,
        max_moment_2: moment(MAX_EXP_AVG_SQ).transpose()?,
    }))
}
