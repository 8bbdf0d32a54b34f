//! `Parallel<B>` changes nothing by itself: training on `Autodiff<Parallel<B>>` ends with
//! bitwise the same parameters as on `Autodiff<B>`, for the CPU backend and for Wgpu (on Vulkan;
//! CI installs Mesa's lavapipe driver, elsewhere the Wgpu test says it is skipped and why).

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::Tensor;
use wildfire_backend::Parallel;
use wildfire_tests::panic_text;
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

/// Whether wgpu finds an adapter (a GPU, or lavapipe on CPU); the reason when not.
fn wgpu_device() -> Result<(), String> {
    let probe = std::panic::catch_unwind(|| {
        Tensor::<Wgpu, 1>::zeros([1], &WgpuDevice::default()).into_data()
    });
    probe.map(drop).map_err(|panic| {
        let text = panic_text(&*panic).unwrap_or_default();
        format!("no wgpu adapter ({text}); install mesa-vulkan-drivers for a CPU Vulkan device")
    })
}

#[test]
fn training_through_the_decorator_is_bitwise_identical_on_wgpu() {
    if let Err(why) = wgpu_device() {
        println!("skipped: {why}");
        return;
    }
    let bare = mlp_training_bits::<Autodiff<Wgpu>>();
    assert_eq!(bare, mlp_training_bits::<Autodiff<Parallel<Wgpu>>>());
    let initial: Vec<u32> = values(8 * 16, 7).into_iter().map(f32::to_bits).collect();
    assert_ne!(&bare[..initial.len()], &initial[..]);
}
