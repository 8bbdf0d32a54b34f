//! Burn's Adam and AdamW state in a checkpoint, by parameter path. Each moment has its
//! parameter's shape and is updated elementwise, so a rank's moment is the same part of the
//! whole moment as its parameter is of the whole parameter: it is stored as the parameter's
//! boxes, under PyTorch's names (`optim.exp_avg.<path>`, `optim.exp_avg_sq.<path>`), and the
//! step count `t` of the bias correction as `optim.step.<path>` (one i64, written by the first
//! tensor-parallel rank). Loaded into the optimizer of the module under another plan or pipeline
//! cut ([`ModuleLayout`]), each rank's state is its part of the whole moments, keyed by the ids
//! of its parameters.

use std::collections::BTreeMap;

use burn::module::{AutodiffModule, Param};
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
    struct Load<'a, O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        layout: &'a ModuleLayout,
        tensors: &'a BTreeMap<String, TensorData>,
        records: Vec<(burn::module::ParamId, AdaptorRecord<O, B>)>,
        error: Option<CheckpointError>,
    }
    impl<O: MomentState<B::InnerBackend>, B: AutodiffBackend> Load<'_, O, B> {
        fn record<const D: usize>(
            &self,
            path: &str,
            param: &Param<Tensor<B, D>>,
        ) -> Result<Option<AdaptorRecord<O, B>>, CheckpointError> {
            let Some(step) = self.tensors.get(&format!("{STEP}{path}")) else {
                return Ok(None);
            };
            let step = (step.to_vec::<i64>().ok())
                .and_then(|steps| steps.first().copied())
                .and_then(|step| usize::try_from(step).ok());
            let step = step.ok_or_else(|| {
                invalid_slice(&format!("{STEP}{path}"), "is not one i64 ≥ 0".to_string())
            })?;
            let whole_shape = self.layout.shape(path)?;
            let device = param.lazy_device();
            let moment = |prefix: &str| {
                let stored = format!("{prefix}{path}");
                let data = self.tensors.get(&stored)?;
                if data.shape.to_vec() != whole_shape {
                    let reason = format!(
                        "it is {:?} in the checkpoint, but the whole parameter is {whole_shape:?}",
                        data.shape.to_vec()
                    );
                    return Some(Err(invalid_slice(&stored, reason)));
                }
                let whole = Tensor::<B::InnerBackend, D>::from_data(data.clone(), &device);
                Some(Ok(self.layout.plan.local_part(path, whole)))
            };
            let needed = |prefix: &str| {
                moment(prefix).unwrap_or_else(|| {
                    let reason = format!("is missing, but {STEP}{path} is in the checkpoint");
                    Err(invalid_slice(&format!("{prefix}{path}"), reason))
                })
            };
            let momentum = AdaptiveMomentumState {
                time: step,
                moment_1: needed(EXP_AVG)?,
                moment_2: needed(EXP_AVG_SQ)?,
                max_moment_2: moment(MAX_EXP_AVG_SQ).transpose()?,
            };
            Ok(Some(AdaptorRecord::from_state(O::from_momentum(momentum))))
        }
    }
    impl<O: MomentState<B::InnerBackend>, B: AutodiffBackend> ParamFn<B> for Load<'_, O, B> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            if self.error.is_some() {
                return;
            }
            match self.record(path, param) {
                Ok(Some(record)) => self.records.push((param.id, record)),
                Ok(None) => {}
                Err(error) => self.error = Some(error),
            }
        }
    }
    let mut load = Load::<O, B> {
        layout,
        tensors,
        records: Vec::new(),
        error: None,
    };
    for_each_param(module, layout.paths.clone(), &mut load);
    if let Some(error) = load.error {
        return Err(error);
    }
    let mut record = optimizer.to_record();
    record.extend(load.records);
    Ok(optimizer.load_record(record))
}
