//! Cutting a model's layers into pipeline stages.
//!
//! Stages are contiguous runs of layers, in order: stage `s` holds layers
//! `Σ_{t<s} n_t .. Σ_{t≤s} n_t`. The embedding goes with stage 0 and the final norm and head with
//! the last stage, so those stages carry extra work; an explicit list lets the user balance that.

use std::ops::Range;

/// A partition that cannot be built, with every number involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    #[error(
        "{stages} pipeline stages (pp {pp} × virtual stages {virtual_stages}) over {layers} \
         layers would leave {empty} stage(s) empty: use at most {layers} stages"
    )]
    TooManyStages {
        stages: usize,
        pp: usize,
        virtual_stages: usize,
        layers: usize,
        empty: usize,
    },
    #[error(
        "the layer list {list:?} has {given} entries, but the pipeline has {stages} stages \
         (pp {pp} × virtual stages {virtual_stages})"
    )]
    WrongLength {
        list: Vec<usize>,
        given: usize,
        stages: usize,
        pp: usize,
        virtual_stages: usize,
    },
    #[error("the layer list {list:?} sums to {sum}, but the model has {layers} layers")]
    WrongSum {
        list: Vec<usize>,
        sum: usize,
        layers: usize,
    },
    #[error(
        "the layer list {list:?} gives stage {stage} no layers: every stage needs at least one"
    )]
    EmptyStage { list: Vec<usize>, stage: usize },
}

/// The layer range of each of the `pp · virtual_stages` stages: as even as possible (the first
/// `layers mod S` stages get one layer more), or `layers_per_stage` when given.
pub fn partition(
    layers: usize,
    pp: usize,
    virtual_stages: usize,
    layers_per_stage: Option<&[usize]>,
) -> Result<Vec<Range<usize>>, PartitionError> {
    let stages = pp * virtual_stages;
    let counts = match layers_per_stage {
        Some(list) => checked_list(list, layers, pp, virtual_stages)?,
        None if stages > layers => {
            return Err(PartitionError::TooManyStages {
                stages,
                pp,
                virtual_stages,
                layers,
                empty: stages - layers,
            });
        }
        None => (0..stages)
            .map(|s| layers / stages + usize::from(s < layers % stages))
            .collect(),
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|count| {
            start += count;
            start - count..start
        })
        .collect())
}

fn checked_list(
    list: &[usize],
    layers: usize,
    pp: usize,
    virtual_stages: usize,
) -> Result<Vec<usize>, PartitionError> {
    let stages = pp * virtual_stages;
    if list.len() != stages {
        return Err(PartitionError::WrongLength {
            list: list.to_vec(),
            given: list.len(),
            stages,
            pp,
            virtual_stages,
        });
    }
    if let Some(stage) = list.iter().position(|&n| n == 0) {
        return Err(PartitionError::EmptyStage {
            list: list.to_vec(),
            stage,
        });
    }
    let sum: usize = list.iter().sum();
    if sum != layers {
        return Err(PartitionError::WrongSum {
            list: list.to_vec(),
            sum,
            layers,
        });
    }
    Ok(list.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_layers_spread_from_the_front() {
        assert_eq!(partition(7, 3, 1, None).unwrap(), [0..3, 3..5, 5..7]);
        assert_eq!(partition(4, 2, 2, None).unwrap(), [0..1, 1..2, 2..3, 3..4]);
        let whole = partition(12, 1, 1, None).unwrap();
        assert_eq!((whole.len(), whole[0].clone()), (1, 0..12));
    }

    #[test]
    fn a_given_list_is_followed() {
        assert_eq!(partition(6, 2, 1, Some(&[1, 5])).unwrap(), [0..1, 1..6]);
    }

    #[test]
    fn bad_partitions_name_the_numbers() {
        assert_eq!(
            partition(4, 4, 2, None).unwrap_err().to_string(),
            "8 pipeline stages (pp 4 × virtual stages 2) over 4 layers would leave 4 stage(s) \
             empty: use at most 4 stages"
        );
        assert_eq!(
            partition(4, 2, 1, Some(&[4, 0])).unwrap_err().to_string(),
            "the layer list [4, 0] gives stage 1 no layers: every stage needs at least one"
        );
        assert_eq!(
            partition(4, 2, 1, Some(&[1, 2])).unwrap_err().to_string(),
            "the layer list [1, 2] sums to 3, but the model has 4 layers"
        );
        assert_eq!(
            partition(4, 2, 1, Some(&[4])).unwrap_err().to_string(),
            "the layer list [4] has 1 entries, but the pipeline has 2 stages (pp 2 × virtual \
             stages 1)"
        );
    }
}
