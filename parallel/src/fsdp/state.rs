//! What a ZeRO rank holds, as numbers and as data: the bytes of its model state, the owned
//! pieces a checkpoint stores, and restoring moments from a checkpoint's whole tensors.

use std::collections::HashMap;

use burn::module::ParamId;
use burn::optim::AdamWState;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::comm::{CommError, ProcessGroup};
use wildfire_backend::host_data::host_values;

use super::{Flat, Moments, ZeroError, ZeroOptimizer, ZeroStage, intersect, owned_part, to_host};

/// Bytes a rank holds for its model state (f32), by kind and by memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer_device: usize,
    /// Moments and master parameters in host memory (offload).
    pub optimizer_host: usize,
}

impl StateBytes {
    /// Device-side model state: parameters, gradients and on-device optimizer state.
    pub fn device_total(&self) -> usize {
        self.params + self.grads + self.optimizer_device
    }

    /// Every rank's figures, by rank of `group` (a collective over it).
    pub fn gather(&self, group: &ProcessGroup) -> Result<Vec<Self>, CommError> {
        let kinds = [
            self.params,
            self.grads,
            self.optimizer_device,
            self.optimizer_host,
        ];
        let rows = group.all_gather_values(&kinds.map(|bytes| bytes as f64))?;
        Ok(rows
            .iter()
            .map(|row| Self {
                params: row[0] as usize,
                grads: row[1] as usize,
                optimizer_device: row[2] as usize,
                optimizer_host: row[3] as usize,
            })
            .collect())
    }
}

/// In MiB: parameters, gradients, optimizer state on the device and in host memory.
impl std::fmt::Display for StateBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
        write!(
            f,
            "parameters {:.2} MiB, gradients {:.2} MiB, optimizer {:.2} MiB on the device + \
             {:.2} MiB in host memory",
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer_device),
            mib(self.optimizer_host)
        )
    }
}

/// One saved piece of the sharded state: elements `offset..offset + len` of parameter `id`'s
/// flattened tensor.
#[derive(Debug, Clone)]
pub struct Piece {
    pub id: ParamId,
    /// Elements of the whole parameter.
    pub param_numel: usize,
    pub offset: usize,
    pub numel: usize,
    pub param: Option<Vec<f32>>,
    pub exp_avg: Option<Vec<f32>>,
    pub exp_avg_sq: Option<Vec<f32>>,
    pub time: usize,
}

/// AdamW moments of one whole parameter (flat), to restore from.
#[derive(Debug, Clone)]
pub struct FullMoments<B: Backend> {
    pub exp_avg: Tensor<B, 1>,
    pub exp_avg_sq: Tensor<B, 1>,
    pub time: usize,
}

impl<B: Backend> ZeroOptimizer<B> {
    /// Restores the moments of every bucket whose parameters all appear in `moments` (a
    /// checkpoint's whole, flat moments by parameter id).
    pub fn set_moments(
        &mut self,
        moments: &HashMap<ParamId, FullMoments<B>>,
    ) -> Result<(), ZeroError> {
        for (bucket, shard) in self.layout.buckets.iter().zip(&mut self.shards) {
            let found: Vec<_> = bucket
                .slots
                .iter()
                .map(|slot| moments.get(&slot.param.id))
                .collect();
            if found.iter().all(Option::is_none) {
                continue;
            }
            let shapes = || {
                let shapes: Vec<_> = bucket.slots.iter().map(|s| &s.param.shape).collect();
                format!("{shapes:?}")
            };
            let Some(found) = found.into_iter().collect::<Option<Vec<_>>>() else {
                return Err(ZeroError::State(format!(
                    "a checkpoint has AdamW moments for some parameters of a bucket (shapes {}) \
                     but not all; it cannot be resumed under {}",
                    shapes(),
                    self.stage
                )));
            };
            let time = found[0].time;
            if let Some(other) = found.iter().find(|m| m.time != time) {
                return Err(ZeroError::State(format!(
                    "AdamW step counts {time} and {} within one bucket (shapes {}); the \
                     checkpoint's parameters were not updated together",
                    other.time,
                    shapes()
                )));
            }
            for (slot, moments) in bucket.slots.iter().zip(&found) {
                let lengths = [moments.exp_avg.dims()[0], moments.exp_avg_sq.dims()[0]];
                if lengths != [slot.param.numel(); 2] {
                    return Err(ZeroError::State(format!(
                        "AdamW moments of {lengths:?} elements for a parameter of shape {:?} \
                         ({} elements)",
                        slot.param.shape,
                        slot.param.numel()
                    )));
                }
            }
            let cat = |pick: fn(&FullMoments<B>) -> Tensor<B, 1>| {
                owned_part(
                    &Tensor::cat(found.iter().map(|m| pick(m)).collect(), 0),
                    &shard.range,
                )
            };
            let (m1, m2) = (cat(|m| m.exp_avg.clone()), cat(|m| m.exp_avg_sq.clone()));
            shard.moments = Some(if self.offload {
                Moments::Host(Box::new(AdamWState::new(
                    burn::optim::AdaptiveMomentumState::new(time, to_host(m1), to_host(m2)),
                )))
            } else {
                Moments::Device(AdamWState::new(burn::optim::AdaptiveMomentumState::new(
                    time, m1, m2,
                )))
            });
        }
        Ok(())
    }

    /// The bytes this rank holds between steps for parameters, gradients (as this stage keeps
    /// them after the reduction) and optimizer state, all f32: with `N` parameters and `p`
    /// ranks, stage 0 holds `4N + 4N + 8N`, stage 1 `4N + 4N + 8N/p`, stage 2
    /// `4N + 4N/p + 8N/p`, stage 3 `16N/p`. Offload moves the moments and a master copy of the
    /// owned parameters to host memory.
    pub fn state_bytes(&self) -> StateBytes {
        const F32: usize = 4;
        let total: usize = self.layout.numel();
        let owned: usize = self.shards.iter().map(|s| s.range.len()).sum();
        let moments = match self.stage {
            ZeroStage::Replicated => 2 * total * F32,
            _ => 2 * owned * F32,
        };
        let params = match self.stage {
            ZeroStage::ShardParameters => owned * F32,
            _ => total * F32,
        };
        let (optimizer_device, optimizer_host, params) = match (self.offload, self.stage) {
            (false, _) => (moments, 0, params),
            // The host master is the only copy of a stage-3 rank's parameters.
            (true, ZeroStage::ShardParameters) => (0, moments + owned * F32, 0),
            (true, _) => (0, moments + owned * F32, params),
        };
        let grads = match self.stage {
            ZeroStage::Replicated | ZeroStage::ShardOptimizer => total * F32,
            ZeroStage::ShardGradients | ZeroStage::ShardParameters => owned * F32,
        };
        StateBytes {
            params,
            grads,
            optimizer_device,
            optimizer_host,
        }
    }

    /// The owned pieces of every parameter, for a checkpoint: moments always, parameter values
    /// under stage 3 (the other stages' replicas hold them whole).
    pub fn pieces(&self) -> Result<Vec<Piece>, ZeroError> {
        let mut pieces = Vec::new();
        for (bucket, shard) in self.layout.buckets.iter().zip(&self.shards) {
            let (m1, m2, time) = match &shard.moments {
                Some(Moments::Device(s)) => (
                    Some(f32_values(s.momentum.moment_1.clone().into_data())?),
                    Some(f32_values(s.momentum.moment_2.clone().into_data())?),
                    s.momentum.time,
                ),
                Some(Moments::Host(s)) => (
                    Some(f32_values(s.momentum.moment_1.clone().into_data())?),
                    Some(f32_values(s.momentum.moment_2.clone().into_data())?),
                    s.momentum.time,
                ),
                None => (None, None, 0),
            };
            let master = match (&shard.master, self.stage) {
                (Some(Flat::Device(t)), ZeroStage::ShardParameters) => {
                    Some(f32_values(t.clone().into_data())?)
                }
                (Some(Flat::Host(t)), ZeroStage::ShardParameters) => {
                    Some(f32_values(t.clone().into_data())?)
                }
                _ => None,
            };
            for slot in &bucket.slots {
                let owned = intersect(&slot.range(), &shard.range);
                if owned.is_empty() {
                    continue;
                }
                let local = owned.start - shard.range.start..owned.end - shard.range.start;
                let cut =
                    |values: &Option<Vec<f32>>| values.as_ref().map(|v| v[local.clone()].to_vec());
                pieces.push(Piece {
                    id: slot.param.id,
                    param_numel: slot.param.numel(),
                    offset: owned.start - slot.offset,
                    numel: owned.len(),
                    param: cut(&master),
                    exp_avg: cut(&m1),
                    exp_avg_sq: cut(&m2),
                    time,
                });
            }
        }
        Ok(pieces)
    }
}

/// The values of f32 `data`.
fn f32_values(data: TensorData) -> Result<Vec<f32>, ZeroError> {
    let dtype = data.dtype;
    host_values(data)
        .map_err(|_| ZeroError::State(format!("sharded state is {dtype:?}; checkpoints store f32")))
}
