//! Collectives of host values rather than tensors: a number summed over the group, a row of
//! numbers from every rank, and any serde value (as JSON) gathered from every rank or broadcast
//! from the first. For the bookkeeping of a run (losses, norms, statistics, checkpoint outcomes);
//! each is one or two host collectives, so it keeps the group's order and deadline.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::algorithms::HostTensor;
use super::element::ReduceOp;
use super::error::CommError;
use super::group::ProcessGroup;
use super::mailbox::OpKind;

impl ProcessGroup {
    /// `value` summed over the group (itself in a group of one, without communicating).
    pub fn sum_value(&self, value: f64) -> Result<f64, CommError> {
        if self.size() == 1 {
            return Ok(value);
        }
        let sum = self.all_reduce_host(HostTensor::new(vec![value], vec![1]), ReduceOp::Sum)?;
        Ok(sum.data[0])
    }

    /// Every rank's `values`, in rank order (every rank gives as many).
    pub fn all_gather_values(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, CommError> {
        let row = HostTensor::new(values.to_vec(), vec![1, values.len()]);
        let all = self.all_gather_host(row, 0)?;
        Ok(all
            .data
            .chunks(values.len().max(1))
            .map(<[f64]>::to_vec)
            .collect())
    }

    /// Every rank's `value`, in rank order, sent as JSON.
    pub fn all_gather_json<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
    ) -> Result<Vec<T>, CommError> {
        let op = OpKind::AllGather;
        let bytes = serde_json::to_vec(value).map_err(|e| unreadable(op, "this rank", e))?;
        let lengths =
            self.all_gather_host(HostTensor::new(vec![bytes.len() as i64], vec![1]), 0)?;
        let joined = self.all_gather_host(bytes_tensor(bytes), 0)?;
        let mut start = 0;
        (lengths.data.iter().enumerate())
            .map(|(rank, &len)| {
                let part = &joined.data[start..start + len as usize];
                start += len as usize;
                serde_json::from_slice(part).map_err(|e| unreadable(op, &format!("rank {rank}"), e))
            })
            .collect()
    }

    /// Rank 0's `value` on every rank (`value` is ignored elsewhere, where it may be `None`),
    /// sent as JSON.
    pub fn broadcast_json<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
    ) -> Result<T, CommError> {
        let op = OpKind::Broadcast;
        let bytes = (self.rank() == 0)
            .then(|| value.map(serde_json::to_vec).transpose())
            .transpose()
            .map_err(|e| unreadable(op, "rank 0", e))?
            .flatten()
            .unwrap_or_default();
        let len = self.broadcast_host(HostTensor::new(vec![bytes.len() as i64], vec![1]), 0)?;
        let mut padded = bytes;
        padded.resize(len.data[0] as usize, 0);
        let shared = self.broadcast_host(bytes_tensor(padded), 0)?;
        serde_json::from_slice(&shared.data).map_err(|e| unreadable(op, "rank 0", e))
    }
}

fn bytes_tensor(bytes: Vec<u8>) -> HostTensor<u8> {
    let len = bytes.len();
    HostTensor::new(bytes, vec![len])
}

fn unreadable(op: OpKind, who: &str, error: serde_json::Error) -> CommError {
    CommError::TensorData {
        op,
        detail: format!("{who} sent a value that is not its JSON: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::comm::{CommOptions, run_thread_ranks};

    #[test]
    fn values_and_json_reach_every_rank_in_rank_order() {
        let options = CommOptions {
            timeout: Duration::from_secs(20),
            debug: false,
        };
        let results = run_thread_ranks(3, options, Duration::from_secs(60), |group| {
            let rank = group.rank();
            let sum = group.sum_value(rank as f64 + 0.5).unwrap();
            let rows = group
                .all_gather_values(&[rank as f64, 10.0 * rank as f64])
                .unwrap();
            let names = group.all_gather_json(&format!("rank {rank}")).unwrap();
            let mine = vec![rank; rank + 1];
            let from_first: Vec<usize> = group.broadcast_json(Some(&mine)).unwrap();
            (sum, rows, names, from_first)
        });
        for (sum, rows, names, from_first) in results {
            assert_eq!(sum, 4.5);
            assert_eq!(rows, vec![vec![0.0, 0.0], vec![1.0, 10.0], vec![2.0, 20.0]]);
            assert_eq!(names, ["rank 0", "rank 1", "rank 2"]);
            assert_eq!(from_first, vec![0]);
        }
    }
}
