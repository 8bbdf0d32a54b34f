//! The autodiff-aware collectives on `Autodiff<Parallel<Flex>>`, ranks as threads:
//! - forward and backward are exact on rank-stamped data, at 2 and 4 ranks and in sub-groups;
//! - each backward is the adjoint of its forward: ⟨F(x), y⟩ = ⟨x, Fᵀ(y)⟩ over all ranks, exactly
//!   on integer data (a replicated side — the input of f, the output of g — is counted once);
//! - a Megatron tensor-parallel MLP issues exactly one all-reduce forward and one backward.

use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::gelu;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::Parallel;
use wildfire_backend::collective::{self, Mapping};
use wildfire_backend::comm::{
    CommError, OpKind, ProcessGroup, ReduceOp, run_thread_ranks, split_ranges,
};
use wildfire_tests::options;

type B = Autodiff<Parallel<Flex>>;
const LIMIT: Duration = Duration::from_secs(120);
const ROWS: usize = 5;
const COLS: usize = 7;

/// A host copy of a rank's 2-D tensor.
#[derive(Debug, Clone, PartialEq)]
struct Grid {
    rows: usize,
    cols: usize,
    values: Vec<f64>,
}

impl Grid {
    fn stamped(rank: usize, salt: usize) -> Self {
        let values = (0..ROWS * COLS)
            .map(|i| ((rank * 7 + i * 3 + salt) % 11) as f64 - 5.0)
            .collect();
        Grid {
            rows: ROWS,
            cols: COLS,
            values,
        }
    }
    fn at(&self, r: usize, c: usize) -> f64 {
        self.values[r * self.cols + c]
    }
    fn build(rows: usize, cols: usize, f: impl Fn(usize, usize) -> f64) -> Self {
        Grid {
            rows,
            cols,
            values: (0..rows * cols).map(|i| f(i / cols, i % cols)).collect(),
        }
    }
    fn sum(grids: &[Grid]) -> Grid {
        Grid::build(grids[0].rows, grids[0].cols, |r, c| {
            grids.iter().map(|g| g.at(r, c)).sum()
        })
    }
    fn concat(grids: &[Grid], dim: usize) -> Grid {
        let (rows, cols) = if dim == 0 {
            (grids.iter().map(|g| g.rows).sum(), grids[0].cols)
        } else {
            (grids[0].rows, grids.iter().map(|g| g.cols).sum())
        };
        let mut values = Vec::with_capacity(rows * cols);
        if dim == 0 {
            grids.iter().for_each(|g| values.extend(&g.values));
        } else {
            for r in 0..rows {
                grids
                    .iter()
                    .for_each(|g| values.extend(&g.values[r * g.cols..(r + 1) * g.cols]));
            }
        }
        Grid { rows, cols, values }
    }
    fn part(&self, rank: usize, n: usize, dim: usize) -> Grid {
        let size = if dim == 0 { self.rows } else { self.cols };
        let range = split_ranges(size, n)[rank].clone();
        if dim == 0 {
            Grid::build(range.len(), self.cols, |r, c| self.at(range.start + r, c))
        } else {
            Grid::build(self.rows, range.len(), |r, c| self.at(r, range.start + c))
        }
    }
    fn dot(&self, other: &Grid) -> f64 {
        assert_eq!((self.rows, self.cols), (other.rows, other.cols));
        self.values
            .iter()
            .zip(&other.values)
            .map(|(a, b)| a * b)
            .sum()
    }
    fn tensor(&self) -> Tensor<B, 2> {
        let values: Vec<f32> = self.values.iter().map(|v| *v as f32).collect();
        Tensor::from_data(
            TensorData::new(values, [self.rows, self.cols]),
            &Default::default(),
        )
    }
    fn of(t: Tensor<B, 2>) -> Grid {
        let [rows, cols] = t.dims();
        Grid {
            rows,
            cols,
            values: t.into_data().iter::<f64>().collect(),
        }
    }
}

/// What the mapping gives rank `rank` from every rank's input.
fn reference(mapping: Mapping, inputs: &[Grid], rank: usize) -> Grid {
    let n = inputs.len();
    match mapping {
        Mapping::Identity => inputs[rank].clone(),
        Mapping::AllReduce(ReduceOp::Sum) => Grid::sum(inputs),
        Mapping::AllGather(dim) => Grid::concat(inputs, dim),
        Mapping::ReduceScatter(dim) => Grid::sum(inputs).part(rank, n, dim),
        Mapping::LocalPart(dim) => inputs[rank].part(rank, n, dim),
        other => unreachable!("{other:?} is not used here"),
    }
}

type Function = fn(Tensor<B, 2>, &ProcessGroup, usize) -> Result<Tensor<B, 2>, CommError>;

/// A function under test: how to call it, its mappings, and which sides are replicated.
struct Case {
    name: &'static str,
    call: Function,
    forward: Mapping,
    backward: Mapping,
    replicated_input: bool,
    replicated_output: bool,
}

fn cases(dim: usize) -> Vec<Case> {
    vec![
        Case {
            name: "all_reduce",
            call: |x, g, _| collective::all_reduce(x, g, ReduceOp::Sum),
            forward: Mapping::AllReduce(ReduceOp::Sum),
            backward: Mapping::AllReduce(ReduceOp::Sum),
            replicated_input: false,
            replicated_output: false,
        },
        Case {
            name: "copy_to_parallel_region",
            call: |x, g, _| collective::copy_to_parallel_region(x, g),
            forward: Mapping::Identity,
            backward: Mapping::AllReduce(ReduceOp::Sum),
            replicated_input: true,
            replicated_output: false,
        },
        Case {
            name: "reduce_from_parallel_region",
            call: |x, g, _| collective::reduce_from_parallel_region(x, g),
            forward: Mapping::AllReduce(ReduceOp::Sum),
            backward: Mapping::Identity,
            replicated_input: false,
            replicated_output: true,
        },
        Case {
            name: "scatter_to_parallel_region",
            call: collective::scatter_to_parallel_region,
            forward: Mapping::LocalPart(dim),
            backward: Mapping::AllGather(dim),
            replicated_input: true,
            replicated_output: false,
        },
        Case {
            name: "gather_from_parallel_region",
            call: collective::gather_from_parallel_region,
            forward: Mapping::AllGather(dim),
            backward: Mapping::LocalPart(dim),
            replicated_input: false,
            replicated_output: true,
        },
        Case {
            name: "reduce_scatter_to_sequence_region",
            call: collective::reduce_scatter_to_sequence_region,
            forward: Mapping::ReduceScatter(dim),
            backward: Mapping::AllGather(dim),
            replicated_input: false,
            replicated_output: false,
        },
        Case {
            name: "all_gather_from_sequence_region",
            call: collective::all_gather_from_sequence_region,
            forward: Mapping::AllGather(dim),
            backward: Mapping::ReduceScatter(dim),
            replicated_input: false,
            replicated_output: false,
        },
    ]
}

/// Rank `rank`'s input: the same on every rank where the input is replicated.
fn input(case: &Case, rank: usize) -> Grid {
    Grid::stamped(if case.replicated_input { 0 } else { rank }, 1)
}

/// Runs every case on `group` (this rank's view): returns, per case, (⟨F(x), y⟩, ⟨x, Fᵀ(y)⟩)
/// for this rank, after checking forward and backward against the reference.
fn check_all(group: &ProcessGroup) -> Vec<(f64, f64)> {
    let (me, n) = (group.rank(), group.size());
    let mut dots = Vec::new();
    for dim in [0, 1] {
        for case in cases(dim) {
            let inputs: Vec<Grid> = (0..n).map(|r| input(&case, r)).collect();
            let x = inputs[me].tensor().require_grad();
            let y =
                (case.call)(x.clone(), group, dim).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let y = Grid::of(y.detach()).clone();
            let expected = reference(case.forward, &inputs, me);
            assert_eq!(
                y,
                expected,
                "{} dim {dim} forward on rank {me} of {}",
                case.name,
                group.describe()
            );

            // Incoming gradient: rank-stamped, shaped as each rank's output, and the same on
            // every rank where the output is replicated.
            let grads_in: Vec<Grid> = (0..n)
                .map(|r| {
                    let shape = reference(case.forward, &inputs, r);
                    let seed = Grid::stamped(if case.replicated_output { 0 } else { r }, 2);
                    Grid::build(shape.rows, shape.cols, |i, j| {
                        seed.values[(i * shape.cols + j) % seed.values.len()]
                    })
                })
                .collect();
            let out = (case.call)(x.clone(), group, dim).expect("forward");
            let loss = (out * grads_in[me].tensor()).sum();
            let grads = loss.backward();
            // Thread ranks share Burn's autodiff graph registry: after a backward pass a rank
            // briefly locks every graph, including one a peer is running its next backward on
            // (and blocking in a collective). A barrier between backward passes avoids that
            // wait cycle; ranks in separate processes do not need it.
            group.barrier().expect("barrier");
            let gx = Grid::of(Tensor::from_inner(
                x.grad(&grads).expect("x has a gradient"),
            ));
            let expected_grad = reference(case.backward, &grads_in, me);
            assert_eq!(
                gx,
                expected_grad,
                "{} dim {dim} backward on rank {me} of {}",
                case.name,
                group.describe()
            );

            let share = |replicated: bool| if replicated { 1.0 / n as f64 } else { 1.0 };
            dots.push((
                y.dot(&grads_in[me]) * share(case.replicated_output),
                inputs[me].dot(&gx) * share(case.replicated_input),
            ));
        }
    }
    dots
}

fn assert_adjoint(per_rank: &[Vec<(f64, f64)>]) {
    for case in 0..per_rank[0].len() {
        let lhs: f64 = per_rank.iter().map(|d| d[case].0).sum();
        let rhs: f64 = per_rank.iter().map(|d| d[case].1).sum();
        assert_eq!(
            lhs, rhs,
            "case {case}: ⟨F(x), y⟩ = {lhs} but ⟨x, Fᵀ(y)⟩ = {rhs}"
        );
        assert_ne!(lhs, 0.0, "case {case}: a zero inner product proves nothing");
    }
}

#[test]
fn forward_backward_exact_and_adjoint_at_two_and_four_ranks() {
    for n in [2, 4] {
        let dots = run_thread_ranks(n, options(60.0, false), LIMIT, |world| check_all(&world));
        assert_adjoint(&dots);
    }
}

#[test]
fn forward_backward_exact_and_adjoint_in_subgroups() {
    let dots = run_thread_ranks(6, options(60.0, false), LIMIT, |world| {
        // Two groups of three: {0, 2, 4} and {1, 3, 5}, as interleaved TP groups would be.
        let members: Vec<usize> = (0..6).filter(|r| r % 2 == world.rank() % 2).collect();
        let group = world.subgroup(&members).expect("subgroup");
        (world.rank() % 2, check_all(&group))
    });
    for parity in 0..2 {
        let group: Vec<Vec<(f64, f64)>> = dots
            .iter()
            .filter(|(p, _)| *p == parity)
            .map(|(_, d)| d.clone())
            .collect();
        assert_adjoint(&group);
    }
}

/// Megatron's MLP: Y = g(GELU(f(X) W1_r) W2_r), W1 split by columns, W2 by rows. One all-reduce
/// forward (g) and one backward (f's); the result equals the serial MLP up to the reordering of
/// the row-parallel sum (relative 1e-5: partial sums are added in rank order, not in one pass).
#[test]
fn tensor_parallel_mlp_issues_one_all_reduce_each_way() {
    let (d_model, d_ff, tokens) = (8, 16, 6);
    let weights = |salt: usize, rows: usize, cols: usize| -> Vec<f32> {
        (0..rows * cols)
            .map(|i| (((i * 7 + salt) % 13) as f32 - 6.0) / 20.0)
            .collect()
    };
    let device = Default::default();
    let x_all = Tensor::<B, 2>::from_data(
        TensorData::new(weights(1, tokens, d_model), [tokens, d_model]),
        &device,
    );
    let w1 = Tensor::<B, 2>::from_data(
        TensorData::new(weights(2, d_model, d_ff), [d_model, d_ff]),
        &device,
    );
    let w2 = Tensor::<B, 2>::from_data(
        TensorData::new(weights(3, d_ff, d_model), [d_ff, d_model]),
        &device,
    );
    let serial: Vec<f32> = gelu(x_all.clone().matmul(w1.clone()))
        .matmul(w2.clone())
        .into_data()
        .to_vec()
        .expect("f32");
    let x_data = x_all.into_data();
    let (w1_data, w2_data) = (w1.into_data(), w2.into_data());

    let results = run_thread_ranks(2, options(60.0, false), LIMIT, move |group| {
        let device = Default::default();
        let cols = split_ranges(d_ff, group.size())[group.rank()].clone();
        let w1 = Tensor::<B, 2>::from_data(w1_data.clone(), &device)
            .slice([0..d_model, cols.clone()])
            .require_grad();
        let w2 = Tensor::<B, 2>::from_data(w2_data.clone(), &device)
            .slice([cols, 0..d_model])
            .require_grad();
        let x = Tensor::<B, 2>::from_data(x_data.clone(), &device).require_grad();

        let before = group.op_count(OpKind::AllReduce);
        let h = gelu(
            collective::copy_to_parallel_region(x.clone(), &group)
                .expect("f")
                .matmul(w1.clone()),
        );
        let y = collective::reduce_from_parallel_region(h.matmul(w2.clone()), &group).expect("g");
        let forward = group.op_count(OpKind::AllReduce) - before;
        let values: Vec<f32> = y.clone().detach().into_data().to_vec().expect("f32");
        let grads = y.sum().backward();
        let backward = group.op_count(OpKind::AllReduce) - before - forward;
        assert!(x.grad(&grads).is_some() && w1.grad(&grads).is_some());
        (forward, backward, values)
    });
    for (rank, (forward, backward, values)) in results.into_iter().enumerate() {
        assert_eq!(
            (forward, backward),
            (1, 1),
            "rank {rank}: all-reduces forward, backward"
        );
        for (got, want) in values.iter().zip(&serial) {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "rank {rank}: {got} vs serial {want}"
            );
        }
    }
}
