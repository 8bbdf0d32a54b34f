//! `Parallel<B>` changes nothing by itself: training an MLP on 2-D inputs on
//! `Autodiff<Parallel<B>>` ends with bitwise the same parameters as on `Autodiff<B>`, for the CPU
//! backend and for Wgpu, bare and under Burn's fusion (on Vulkan; CI installs Mesa's lavapipe
//! driver, elsewhere the Wgpu test says it is skipped and why). Every op but the linear layer's forwards to `B`, and for 2-D
//! inputs the linear layer's override is the one product Burn computes, so the two run the same
//! arithmetic on any SIMD width. (On 3-D and larger inputs the override takes the weight
//! gradient as one product over all rows where Burn sums one per batch entry: other roundings.)

use burn::backend::{Autodiff, Flex, Wgpu};
use wildfire_backend::Parallel;
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::probe;
use wildfire_tests::training::{mlp_training_bits, values};

#[test]
fn training_through_the_decorator_is_bitwise_identical() {
    let bare = mlp_training_bits::<Autodiff<Flex>>();
    let decorated = mlp_training_bits::<Autodiff<Parallel<Flex>>>();
    assert_eq!(bare.len(), 8 * 16 + 16 + 16 * 4);
    assert_eq!(bare, decorated);
    // And the run did train: parameters moved away from their initial values.
    let initial: Vec<u32> = values(8 * 16, 7).into_iter().map(f32::to_bits).collect();
    assert_ne!(&bare[..initial.len()], &initial[..]);
}

#[test]
fn training_through_the_decorator_is_bitwise_identical_on_wgpu() {
    if probe::for_test(probe::wgpu(), "WILDFIRE_REQUIRE_WGPU").is_none() {
        return;
    }
    let bare = mlp_training_bits::<Autodiff<Wgpu>>();
    assert_eq!(bare, mlp_training_bits::<Autodiff<Parallel<Wgpu>>>());
    let initial: Vec<u32> = values(8 * 16, 7).into_iter().map(f32::to_bits).collect();
    assert_ne!(&bare[..initial.len()], &initial[..]);
    // Under Burn's fusion (what `--device wgpu` trains on) too.
    let fused = mlp_training_bits::<Autodiff<FusedWgpu>>();
    assert_eq!(fused, mlp_training_bits::<Autodiff<Parallel<FusedWgpu>>>());
    assert_ne!(&fused[..initial.len()], &initial[..]);
}
