//! AdamW moments in a checkpoint that every ZeRO stage resumes.
//!
//! Each stage holds the moments differently: DDP every parameter whole (Burn's optimizer
//! adaptor, by parameter id), ZeRO 1/2 the owned elements of flat buckets, ZeRO 3 by units the
//! rows of the units' parameters and the other parameters whole. A checkpoint therefore stores
//! them in one form: pieces `(position, offset, m, v, time)`, elements `offset..` of the
//! flattened moments of the parameter at `position` in the module's registration order (ids
//! change from run to run; positions do not).
//!
//! To resume, every rank rebuilds the whole moments `M` of every parameter and takes what its
//! stage holds. A DDP checkpoint holds them whole on every rank. The others hold disjoint
//! pieces (ZeRO 3's whole parameters are written by data-parallel rank 0 alone): each rank
//! places its pieces in zeros and the ranks sum, `M = Σ_r M_r`, which is exact (`x + 0 = x`;
//! AdamW's moments start at +0 and never become −0). A resume under the stage that saved it
//! therefore restores bitwise what that stage held; under another stage it holds the same
//! values, cut differently.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Device, Tensor, TensorData};
use wildfire_backend::comm::{HostTensor, ProcessGroup, ReduceOp, split_ranges};
use wildfire_backend::host_data::host_values;

use crate::dp::{self, ParamSpec};
use crate::fsdp::{FullMoments, ZeroError, ZeroOptimizer, unit_params};
use crate::offload::{PlacedAdamW, PlacedMoments};

/// Elements `offset..offset + len` of the flattened AdamW moments of the parameter at
/// `position` (registration order), after `time` steps.
#[derive(burn::record::Record, Debug)]
pub struct MomentPiece<B: Backend> {
    pub position: usize,
    pub offset: usize,
    pub time: usize,
    pub exp_avg: Tensor<B, 1>,
    pub exp_avg_sq: Tensor<B, 1>,
}

/// A checkpoint's pieces, waiting for the model they resume (its parameters' ids and device).
#[derive(Debug)]
pub struct SavedMoments<A: Backend> {
    /// Whether every rank's pieces are whole (saved under DDP).
    pub whole: bool,
    /// The data-parallel degree that saved them.
    pub ranks: usize,
    pub pieces: Vec<MomentPiece<A>>,
}

/// One parameter as a Burn optimizer holds it on this rank.
#[derive(Debug, Clone)]
struct Position {
    id: ParamId,
    /// The whole parameter's shape.
    shape: Vec<usize>,
    /// The rows this rank holds (inside a `ShardedUnit` under ZeRO 3), or `None`: whole.
    rows: Option<Range<usize>>,
}

impl Position {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn row_numel(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// The elements of the flattened whole parameter held here.
    fn held(&self) -> Range<usize> {
        match &self.rows {
            Some(rows) => rows.start * self.row_numel()..rows.end * self.row_numel(),
            None => 0..self.numel(),
        }
    }

    /// The shape held here.
    fn held_shape(&self) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(rows) = &self.rows {
            shape[0] = rows.len();
        }
        shape
    }
}

/// The parameters of a model whose moments Burn's optimizer adaptor over [`PlacedAdamW`] holds,
/// by position: DDP's (all whole), or ZeRO 3's by units (the units' rows, the rest whole).
#[derive(Debug, Clone)]
pub struct AdaptorPositions {
    params: Vec<Position>,
}

impl AdaptorPositions {
    /// The parameters of the whole `model`; with `units` (the data-parallel group under ZeRO 3
    /// by units), those inside `ShardedUnit`s held by this rank's rows.
    pub fn new<B: Backend, M: burn::module::Module<B>>(
        model: &M,
        units: Option<&ProcessGroup>,
    ) -> Self {
        let by_rows = units.map(|_| unit_params(model)).unwrap_or_default();
        let params = dp::param_specs(model)
            .into_iter()
            .map(|spec| Position {
                rows: (units.filter(|_| by_rows.contains(&spec.id)))
                    .map(|group| split_ranges(spec.shape[0], group.size())[group.rank()].clone()),
                id: spec.id,
                shape: spec.shape,
            })
            .collect();
        Self { params }
    }

    /// Follows the model's parameters to their current ids (a loaded record brings its own).
    pub fn follow(&mut self, specs: &[ParamSpec]) {
        for (position, spec) in self.params.iter_mut().zip(specs) {
            position.id = spec.id;
        }
    }

    /// The pieces of `optimizer`'s moments a checkpoint keeps from this rank (as tensors on
    /// `device`): every parameter whole under DDP; the rows under ZeRO 3, and the whole
    /// parameters only from data-parallel rank 0 (`writes_whole`).
    pub fn pieces<A, M>(
        &self,
        optimizer: &OptimizerAdaptor<PlacedAdamW, M, A>,
        writes_whole: bool,
        device: &Device<A::InnerBackend>,
    ) -> Vec<MomentPiece<A>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A>,
    {
        let mut records = optimizer.to_record();
        let mut pieces = Vec::new();
        for (position, param) in self.params.iter().enumerate() {
            if param.rows.is_none() && !writes_whole {
                continue;
            }
            let Some(record) = records.remove(&param.id) else {
                continue;
            };
            let moments = flat_moments::<A>(record, param.shape.len(), device);
            pieces.push(MomentPiece {
                position,
                offset: param.held().start,
                time: moments.time,
                exp_avg: Tensor::from_inner(moments.exp_avg),
                exp_avg_sq: Tensor::from_inner(moments.exp_avg_sq),
            });
        }
        pieces
    }

    /// `optimizer` holding `whole`'s moments of what this rank holds, on `device` or in host
    /// memory (`offload`).
    pub fn restore<A, M>(
        &self,
        optimizer: OptimizerAdaptor<PlacedAdamW, M, A>,
        whole: &WholeMoments,
        device: &Device<A::InnerBackend>,
        offload: bool,
    ) -> OptimizerAdaptor<PlacedAdamW, M, A>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A>,
    {
        let mut records = Vec::new();
        for (param, moments) in self.params.iter().zip(&whole.params) {
            let Some(moments) = moments else { continue };
            let held = param.held();
            let cut = |values: &[f32]| {
                let data = TensorData::new(values[held.clone()].to_vec(), [held.len()]);
                Tensor::<A::InnerBackend, 1>::from_data(data, device)
            };
            let flat = FullMoments {
                exp_avg: cut(&moments.exp_avg),
                exp_avg_sq: cut(&moments.exp_avg_sq),
                time: moments.time,
            };
            let record = adaptor_record::<A>(flat, &param.held_shape(), offload, device);
            records.push((param.id, record));
        }
        optimizer.load_record(records.into_iter().collect())
    }

    /// The whole elements of each parameter, by position.
    pub fn numels(&self) -> Vec<usize> {
        self.params.iter().map(Position::numel).collect()
    }
}

/// The pieces of ZeRO 1/2's moments this rank owns (its layout covers every parameter).
pub fn zero_pieces<A: AutodiffBackend>(
    zero: &ZeroOptimizer<A::InnerBackend>,
) -> Result<Vec<MomentPiece<A>>, ZeroError> {
    let positions: HashMap<ParamId, usize> = (zero.layout().ids_in_order().into_iter())
        .enumerate()
        .map(|(position, id)| (id, position))
        .collect();
    let tensor = |values: Vec<f32>| {
        let data = TensorData::new(values.clone(), [values.len()]);
        Tensor::from_inner(Tensor::from_data(data, zero.device()))
    };
    let mut pieces = Vec::new();
    for piece in zero.pieces()? {
        let (Some(exp_avg), Some(exp_avg_sq)) = (piece.exp_avg, piece.exp_avg_sq) else {
            continue;
        };
        pieces.push(MomentPiece {
            position: positions[&piece.id],
            offset: piece.offset,
            time: piece.time,
            exp_avg: tensor(exp_avg),
            exp_avg_sq: tensor(exp_avg_sq),
        });
    }
    Ok(pieces)
}

/// `zero` holding its owned elements of `whole`'s moments.
pub fn restore_zero<B: Backend>(
    zero: &mut ZeroOptimizer<B>,
    whole: &WholeMoments,
) -> Result<(), ZeroError> {
    let ids = zero.layout().ids_in_order();
    let device = zero.device().clone();
    let tensor = |values: &[f32]| {
        Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [values.len()]), &device)
    };
    let moments: HashMap<ParamId, FullMoments<B>> = (ids.into_iter().zip(&whole.params))
        .filter_map(|(id, moments)| {
            let moments = moments.as_ref()?;
            let full = FullMoments {
                exp_avg: tensor(&moments.exp_avg),
                exp_avg_sq: tensor(&moments.exp_avg_sq),
                time: moments.time,
            };
            Some((id, full))
        })
        .collect();
    zero.set_moments(&moments)
}

/// One parameter's whole flattened moments.
#[derive(Debug, Clone)]
pub struct ParamMoments {
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    pub time: usize,
}

/// Every parameter's whole moments by position (`None`: never stepped).
#[derive(Debug, Clone)]
pub struct WholeMoments {
    pub params: Vec<Option<ParamMoments>>,
}

impl WholeMoments {
    /// The whole moments of parameters of `numels` elements (by position) from `saved`: this
    /// rank's pieces, summed over the data-parallel `group` unless they are whole already.
    pub fn assemble<A: Backend>(
        saved: SavedMoments<A>,
        numels: &[usize],
        group: &ProcessGroup,
    ) -> Result<Self, String> {
        if !saved.whole && saved.ranks != group.size() {
            return Err(format!(
                "the optimizer's moments were saved by {} data-parallel ranks, this run has {}: \
                 resume at the degree that saved them",
                saved.ranks,
                group.size()
            ));
        }
        let starts: Vec<usize> = (numels.iter())
            .scan(0, |next, n| {
                *next += n;
                Some(*next - n)
            })
            .collect();
        let total: usize = numels.iter().sum();
        // [m | v] of every parameter, and each parameter's step count.
        let mut flat = vec![0f32; 2 * total];
        let mut times = vec![0f64; numels.len()];
        for piece in saved.pieces {
            let values =
                |t: Tensor<A, 1>| host_values::<f32>(t.into_data()).map_err(|e| e.to_string());
            let (m, v) = (values(piece.exp_avg)?, values(piece.exp_avg_sq)?);
            let Some(&numel) = numels.get(piece.position) else {
                return Err(format!(
                    "the checkpoint holds AdamW moments of parameter {}, but this model has {} \
                     parameters",
                    piece.position,
                    numels.len()
                ));
            };
            if piece.offset + m.len() > numel || m.len() != v.len() {
                return Err(format!(
                    "the checkpoint holds AdamW moments ({} and {} values) for elements {}..{} \
                     of parameter {}, which has {numel} elements in this model",
                    m.len(),
                    v.len(),
                    piece.offset,
                    piece.offset + m.len(),
                    piece.position,
                ));
            }
            let at = starts[piece.position] + piece.offset;
            flat[at..at + m.len()].copy_from_slice(&m);
            flat[total + at..total + at + v.len()].copy_from_slice(&v);
            times[piece.position] = piece.time as f64;
        }
        if !saved.whole && group.size() > 1 {
            let sum = |data: Vec<f32>| {
                group.all_reduce_host(HostTensor::new(data, vec![2 * total]), ReduceOp::Sum)
            };
            flat = sum(flat).map_err(|e| e.to_string())?.data;
            let max =
                group.all_reduce_host(HostTensor::new(times, vec![numels.len()]), ReduceOp::Max);
            times = max.map_err(|e| e.to_string())?.data;
        }
        let params = (0..numels.len())
            .map(|p| {
                let range = starts[p]..starts[p] + numels[p];
                (times[p] > 0.0).then(|| ParamMoments {
                    exp_avg: flat[range.clone()].to_vec(),
                    exp_avg_sq: flat[total + range.start..total + range.end].to_vec(),
                    time: times[p] as usize,
                })
            })
            .collect();
        Ok(Self { params })
    }
}

/// Calls `$f::<$b, D>(args)` with the const `D` equal to `$rank` (1 to 8, what Burn's optimizer
/// adaptor records).
macro_rules! by_rank {
    ($rank:expr, $f:ident::<$b:ty>($($arg:expr),*)) => {
        match $rank {
            1 => $f::<$b, 1>($($arg),*),
            2 => $f::<$b, 2>($($arg),*),
            3 => $f::<$b, 3>($($arg),*),
            4 => $f::<$b, 4>($($arg),*),
            5 => $f::<$b, 5>($($arg),*),
            6 => $f::<$b, 6>($($arg),*),
            7 => $f::<$b, 7>($($arg),*),
            8 => $f::<$b, 8>($($arg),*),
            rank => panic!("Burn's optimizer adaptor keeps tensors of rank 1 to 8, not {rank}"),
        }
    };
}

/// The moments of an adaptor record of a rank-`rank` parameter, flattened, on `device`.
fn flat_moments<A: AutodiffBackend>(
    record: AdaptorRecord<PlacedAdamW, A>,
    rank: usize,
    device: &Device<A::InnerBackend>,
) -> FullMoments<A::InnerBackend> {
    fn flat<A: AutodiffBackend, const D: usize>(
        record: AdaptorRecord<PlacedAdamW, A>,
        device: &Device<A::InnerBackend>,
    ) -> FullMoments<A::InnerBackend> {
        let state: PlacedMoments<A::InnerBackend, D> = record.into_state::<D>();
        let momentum = state.on_device(device).momentum;
        let numel = momentum.moment_1.shape().num_elements();
        FullMoments {
            exp_avg: momentum.moment_1.reshape([numel]),
            exp_avg_sq: momentum.moment_2.reshape([numel]),
            time: momentum.time,
        }
    }
    by_rank!(rank, flat::<A>(record, device))
}

/// The adaptor record of flat `moments` for a parameter of `shape`, placed on `device` or in
/// host memory (`offload`).
fn adaptor_record<A: AutodiffBackend>(
    moments: FullMoments<A::InnerBackend>,
    shape: &[usize],
    offload: bool,
    device: &Device<A::InnerBackend>,
) -> AdaptorRecord<PlacedAdamW, A> {
    fn shaped<A: AutodiffBackend, const D: usize>(
        moments: FullMoments<A::InnerBackend>,
        shape: &[usize],
        offload: bool,
        device: &Device<A::InnerBackend>,
    ) -> AdaptorRecord<PlacedAdamW, A> {
        let dims: [usize; D] = shape.try_into().expect("the shape has D dimensions");
        let state = AdaptiveMomentumState::new(
            moments.time,
            moments.exp_avg.reshape(dims),
            moments.exp_avg_sq.reshape(dims),
        );
        let placed = PlacedMoments::Device(AdamWState::new(state)).placed(offload, device);
        AdaptorRecord::from_state::<D>(placed)
    }
    by_rank!(shape.len(), shaped::<A>(moments, shape, offload, device))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::backend::Flex;
    use wildfire_backend::comm::{CommOptions, run_thread_ranks};

    use super::*;

    fn piece(position: usize, offset: usize, m: &[f32], v: &[f32]) -> MomentPiece<Flex> {
        let tensor = |values: &[f32]| {
            Tensor::from_data(
                TensorData::new(values.to_vec(), [values.len()]),
                &Default::default(),
            )
        };
        MomentPiece {
            position,
            offset,
            time: 3,
            exp_avg: tensor(m),
            exp_avg_sq: tensor(v),
        }
    }

    fn options() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(20),
            debug: true,
        }
    }

    fn groups(ranks: usize) -> Vec<ProcessGroup> {
        ProcessGroup::local_world(ranks, options()).unwrap()
    }

    #[test]
    fn disjoint_pieces_of_two_ranks_sum_to_the_whole_moments() {
        // Parameters of 3 and 2 elements; rank 0 holds 0..2 of the first, rank 1 the rest;
        // the second parameter was never stepped.
        let wholes = run_thread_ranks(2, options(), Duration::from_secs(60), |group| {
            let pieces = match group.rank() {
                0 => vec![piece(0, 0, &[1.0, -2.0], &[4.0, 5.0])],
                _ => vec![piece(0, 2, &[3.0], &[6.0])],
            };
            let saved = SavedMoments {
                whole: false,
                ranks: 2,
                pieces,
            };
            WholeMoments::assemble(saved, &[3, 2], &group).unwrap()
        });
        for whole in wholes {
            let first = whole.params[0]
                .as_ref()
                .expect("the first parameter has moments");
            assert_eq!(first.exp_avg, [1.0, -2.0, 3.0]);
            assert_eq!(first.exp_avg_sq, [4.0, 5.0, 6.0]);
            assert_eq!(first.time, 3);
            assert!(whole.params[1].is_none(), "the second was never stepped");
        }
    }

    #[test]
    fn pieces_from_another_degree_or_model_are_refused_naming_the_numbers() {
        let group = groups(1).remove(0);
        let saved = |whole, ranks, pieces| SavedMoments {
            whole,
            ranks,
            pieces,
        };
        let error = WholeMoments::assemble(saved(false, 2, vec![]), &[3], &group).unwrap_err();
        assert!(
            error.contains("saved by 2 data-parallel ranks, this run has 1"),
            "{error}"
        );
        let beyond = vec![piece(0, 2, &[1.0, 1.0], &[1.0, 1.0])];
        let error = WholeMoments::assemble(saved(true, 1, beyond), &[3], &group).unwrap_err();
        assert!(
            error.contains("elements 2..4 of parameter 0, which has 3 elements"),
            "{error}"
        );
        let missing = vec![piece(4, 0, &[1.0], &[1.0])];
        let error = WholeMoments::assemble(saved(true, 1, missing), &[3], &group).unwrap_err();
        assert!(
            error.contains("parameter 4, but this model has 1 parameters"),
            "{error}"
        );
    }
}
