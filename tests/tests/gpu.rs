//! The decorator and the collectives on the CUDA backend (`--features cuda`; run by
//! `scripts/gpu-check.sh`). Without a CUDA driver and device each test says it is skipped.
//! At world size 1 collectives on CUDA tensors stay on the device without NCCL (the NCCL probe
//! covers that case); at 2+ ranks, one GPU each, they run through NCCL on the device buffers.

use std::time::Duration;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use wildfire_backend::Parallel;
use wildfire_backend::comm::{nccl_device, run_thread_ranks, selfcheck};
use wildfire_backend::device::FusedCuda;
use wildfire_backend::kernels::probe;
use wildfire_tests::options;
use wildfire_tests::training::mlp_training_bits;

macro_rules! require_cuda {
    () => {
        if probe::for_test(probe::cuda(), "WILDFIRE_REQUIRE_CUDA").is_none() {
            return;
        }
    };
}

/// Bare, and under Burn's fusion (what `--device cuda` trains on).
#[test]
fn decorator_is_bitwise_identical_on_cuda() {
    require_cuda!();
    assert_eq!(
        mlp_training_bits::<Autodiff<Cuda>>(),
        mlp_training_bits::<Autodiff<Parallel<Cuda>>>()
    );
    assert_eq!(
        mlp_training_bits::<Autodiff<FusedCuda>>(),
        mlp_training_bits::<Autodiff<Parallel<FusedCuda>>>()
    );
}

#[test]
fn nccl_one_rank_probe_is_exact() {
    require_cuda!();
    match nccl_device::probe_one_rank(0, Duration::from_secs(120)) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("NCCL probe failed: {e}"),
    }
}

#[test]
fn every_op_is_exact_on_cuda_tensors() {
    require_cuda!();
    let gpus = nccl_device::cuda_device_count().expect("the driver answered above");
    let mut worlds = vec![1];
    if gpus >= 2 {
        worlds.push(gpus);
    } else {
        println!("skipped: NCCL between ranks needs 2+ GPUs (one per rank), {gpus} present");
    }
    // Bare CUDA tensors, and fused ones (resolved through the fusion stream and adopted back).
    for n in worlds {
        let summaries = run_thread_ranks(
            n,
            options(120.0, false),
            Duration::from_secs(300),
            |world| {
                let device = CudaDevice::new(world.rank());
                selfcheck::run::<Cuda>(&world, &device, true)?;
                selfcheck::run::<FusedCuda>(&world, &device, true)
            },
        );
        for summary in summaries {
            summary.expect("exact on CUDA tensors");
        }
    }
}
