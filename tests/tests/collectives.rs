//! Collectives with ranks as threads (local transport): exactness for every op, dtype and size,
//! bitwise agreement across ranks, and errors for bad input. Every test has a hard timeout.

use std::time::Duration;

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use wildfire_backend::comm::{HostTensor, ProcessGroup, ReduceOp, run_thread_ranks, selfcheck};
use wildfire_tests::options;

type B = Flex;
const LIMIT: Duration = Duration::from_secs(180);

/// The headline check: 8 ranks in two groups of 4, all-reduce of `ones * rank` gives
/// exactly 6 on ranks 0–3 and 22 on ranks 4–7, in every dtype.
#[test]
fn all_reduce_of_rank_stamped_ones_in_two_groups_of_four() {
    let results = run_thread_ranks(8, options(60.0, false), LIMIT, |world| {
        let me = world.rank();
        let half: Vec<usize> = if me < 4 {
            (0..4).collect()
        } else {
            (4..8).collect()
        };
        let group = world.subgroup(&half).expect("subgroup");
        let device = Default::default();
        let mut seen = Vec::new();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let x = Tensor::<B, 1>::ones([1000], (&device, dtype)).mul_scalar(me as f64);
            let y = group.all_reduce(x, ReduceOp::Sum).expect("all_reduce");
            assert_eq!(y.dtype(), dtype);
            seen.extend(y.into_data().iter::<f64>().collect::<Vec<_>>());
        }
        let x = Tensor::<B, 1, Int>::ones([1000], (&device, DType::I64)).mul_scalar(me as i64);
        let y = group.all_reduce(x, ReduceOp::Sum).expect("all_reduce i64");
        assert_eq!(y.dtype(), DType::I64);
        seen.extend(y.into_data().iter::<f64>().collect::<Vec<_>>());
        seen
    });
    for (rank, values) in results.iter().enumerate() {
        let want = if rank < 4 { 6.0 } else { 22.0 };
        assert_eq!(values.len(), 4000);
        assert!(
            values.iter().all(|v| *v == want),
            "rank {rank}: expected all {want}"
        );
    }
}

/// Every op, every dtype (f32, f16, bf16, i32, i64), sizes 0, 1, 7, n+1 and 4 MiB, on the world
/// of 8 and on its halves, compared exactly with closed-form results; and the reductions of
/// seeded non-integer f32 and bf16 values, bitwise the serial fold.
#[test]
fn every_op_is_exact_on_eight_threads() {
    let summaries = run_thread_ranks(8, options(120.0, false), LIMIT, |world| {
        selfcheck::run::<B>(&world, &Default::default(), true)
    });
    for (rank, summary) in summaries.into_iter().enumerate() {
        let summary = summary.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            summary.checks >= 500,
            "rank {rank} ran only {} checks",
            summary.checks
        );
        // Two groups (the world and a half) × 4 sizes × f32 and bf16 × sum, mean, reduce-scatter.
        assert_eq!(summary.fold_checks, 48, "rank {rank}: fold checks");
    }
}

#[test]
fn every_op_is_exact_on_two_and_three_threads() {
    for n in [2, 3] {
        let summaries = run_thread_ranks(n, options(60.0, false), LIMIT, |world| {
            selfcheck::run::<B>(&world, &Default::default(), false)
        });
        for summary in summaries {
            let summary = summary.expect("exact");
            if n == 3 {
                // A float mean over 3 ranks has no exact result: those checks are reported skipped.
                assert!(
                    summary
                        .skipped
                        .iter()
                        .any(|s| s.contains("mean over 3 ranks"))
                );
            }
        }
    }
}

/// Random (non-integer) data: every rank gets bitwise the same all-reduce result, and it equals
/// the left fold in rank order computed serially.
#[test]
fn all_reduce_is_bitwise_identical_across_ranks_and_equals_the_serial_fold() {
    let n = 4;
    let len = 100_003;
    let input = move |rank: usize| -> Vec<f32> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ rank as u64;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / 1e4 - 800.0
            })
            .collect()
    };
    let results = run_thread_ranks(n, options(60.0, false), LIMIT, move |world| {
        let x = HostTensor::new(input(world.rank()), vec![len]);
        world
            .all_reduce_host(x, ReduceOp::Sum)
            .expect("all_reduce")
            .data
    });
    let inputs: Vec<Vec<f32>> = (0..n).map(input).collect();
    let serial: Vec<f32> = (0..len)
        .map(|i| (1..n).fold(inputs[0][i], |acc, r| acc + inputs[r][i]))
        .collect();
    for (rank, result) in results.iter().enumerate() {
        let same = result
            .iter()
            .zip(&serial)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank} differs from the serial rank-order fold");
    }
}

#[test]
fn uneven_reduce_scatter_gives_the_first_ranks_one_more_row() {
    let shapes = run_thread_ranks(4, options(30.0, false), LIMIT, |world| {
        let x = HostTensor::new(vec![1i64; 10 * 2], vec![10, 2]);
        let part = world
            .reduce_scatter_host(x, 0, ReduceOp::Sum)
            .expect("reduce_scatter");
        assert!(part.data.iter().all(|v| *v == 4));
        let back = world.all_gather_host(part.clone(), 0).expect("all_gather");
        assert_eq!(back.shape, vec![10, 2]);
        part.shape
    });
    assert_eq!(shapes, vec![vec![3, 2], vec![3, 2], vec![2, 2], vec![2, 2]]);
}

#[test]
fn tagged_messages_are_matched_by_tag_not_arrival_order() {
    let got = run_thread_ranks(2, options(30.0, false), LIMIT, |world| {
        let device = Default::default();
        if world.rank() == 0 {
            for tag in [7u64, 8] {
                let t =
                    Tensor::<B, 1>::from_data(TensorData::new(vec![tag as f32; 3], [3]), &device);
                world.send(t, 1, tag).expect("send");
            }
            Vec::new()
        } else {
            let eight = world
                .recv::<B, 1, burn::tensor::Float>(0, 8, &device)
                .expect("recv 8");
            let seven = world
                .recv::<B, 1, burn::tensor::Float>(0, 7, &device)
                .expect("recv 7");
            [eight, seven]
                .into_iter()
                .flat_map(|t| t.into_data().to_vec::<f32>().expect("f32"))
                .collect()
        }
    });
    assert_eq!(got[1], vec![8.0, 8.0, 8.0, 7.0, 7.0, 7.0]);
}

#[test]
fn bad_input_is_an_error_naming_the_values() {
    let err = ProcessGroup::local_world(0, options(1.0, false)).expect_err("world 0");
    assert!(err.to_string().contains("world size 0"), "{err}");

    let messages = run_thread_ranks(2, options(5.0, false), LIMIT, |world| {
        let me = world.rank();
        let mut errors: Vec<String> = Vec::new();
        let x = || HostTensor::new(vec![1.0f32; 4], vec![4]);
        errors.push(
            world
                .send_host(x(), me, 0)
                .expect_err("send to self")
                .to_string(),
        );
        errors.push(
            world
                .send_host(x(), 5, 0)
                .expect_err("send outside")
                .to_string(),
        );
        errors.push(
            world
                .subgroup(&[0, 9])
                .expect_err("bad subgroup")
                .to_string(),
        );
        errors.push(
            world
                .all_gather_host(x(), 3)
                .expect_err("bad dim")
                .to_string(),
        );
        errors.push(
            world
                .broadcast_host(x(), 2)
                .expect_err("bad root")
                .to_string(),
        );
        let device = Default::default();
        let bools = Tensor::<B, 1>::ones([2], &device).greater_elem(0.5);
        errors.push(
            world
                .all_reduce(bools, ReduceOp::Sum)
                .expect_err("bool")
                .to_string(),
        );
        // Shapes that differ across ranks: rank 1 passes 5 elements.
        let shape_error = world
            .all_reduce_host(
                HostTensor::new(vec![1.0f32; 4 + me], vec![4 + me]),
                ReduceOp::Sum,
            )
            .expect_err("shape mismatch");
        errors.push(shape_error.to_string());
        errors
    });
    let rank0 = &messages[0];
    assert!(
        rank0[0].contains("rank 0 cannot send itself"),
        "{}",
        rank0[0]
    );
    assert!(
        rank0[1].contains("destination rank 5 is outside the group (size 2)"),
        "{}",
        rank0[1]
    );
    assert!(rank0[2].contains("rank 9 is out of range"), "{}", rank0[2]);
    assert!(
        rank0[3].contains("dimension 3 is out of range for shape [4]"),
        "{}",
        rank0[3]
    );
    assert!(
        rank0[4].contains("root 2 is outside the group"),
        "{}",
        rank0[4]
    );
    assert!(rank0[5].contains("is not supported"), "{}", rank0[5]);
    assert!(
        rank0[6].contains("rank 1 disagrees")
            && rank0[6].contains("[5]")
            && rank0[6].contains("[4]"),
        "{}",
        rank0[6]
    );
    assert!(
        messages[1][6].contains("rank 0 disagrees"),
        "{}",
        messages[1][6]
    );
}

#[test]
fn a_subgroup_only_takes_members() {
    let errors = run_thread_ranks(3, options(5.0, false), LIMIT, |world| {
        world.subgroup(&[0, 1]).err().map(|e| e.to_string())
    });
    assert!(errors[0].is_none() && errors[1].is_none());
    let err = errors[2].as_ref().expect("rank 2 is not a member");
    assert!(err.contains("rank 2") && err.contains("[0, 1]"), "{err}");
}
