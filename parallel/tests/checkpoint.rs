//! Any module's tensor-parallel checkpoint resharded on load: a model of wildfire's parallel
//! layers (a vocabulary-parallel embedding of 11 rows, which no degree here divides, a
//! column-parallel layer in 3 sections, a row-parallel one, a replicated Burn `Linear`) split at
//! tp 2, each rank's slices saved through the store and joined again; loaded at tp 1 it is the
//! whole model, at tp 2 and 4 each rank's part is the part the plan cuts from the whole model,
//! all bitwise. AdamW's moments go the same way: whole moments loaded at tp 2 and 4 and saved
//! again join into the same whole moments, bitwise. A checkpoint missing a parameter or a
//! moment, or one whose tensors do not fit the model, is refused naming the tensor. ZeRO's flat
//! moments are the same parts, flattened; a parameter that copies another (a tied embedding's
//! copy) is stored as the original and loads from it.

use std::collections::BTreeMap;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::comm::{CommOptions, ProcessGroup};
use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::checkpoint::optimizer::{
    flat_moments, load_optimizer, optimizer_records, optimizer_slices,
};
use wildfire_parallel::checkpoint::slices::join_slices;
use wildfire_parallel::checkpoint::store::{self, CheckpointError};
use wildfire_parallel::tp::{ParallelEmbedding, ParallelLinear, TpPlan, TpStyle, apply_plan};

type B = Flex;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    embedding: ParallelEmbedding<B>,
    qkv: ParallelLinear<B>,
    out: ParallelLinear<B>,
    head: Linear<B>,
}

const PLAN: &[(&str, TpStyle)] = &[
    ("embedding", TpStyle::VocabRows),
    (
        "qkv",
        TpStyle::Column {
            sections: 3,
            gather_output: false,
        },
    ),
    ("out", TpStyle::Row),
];

/// Tests run in parallel and share the backend's RNG: one draws at a time.
static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The whole model, drawn from `seed` (every parameter now: Burn draws on first use).
fn net(seed: u64) -> Net<B> {
    net_on::<B>(seed)
}

fn net_on<B: Backend>(seed: u64) -> Net<B> {
    let device = Default::default();
    let _draw = DRAW.lock().unwrap_or_else(|p| p.into_inner());
    B::seed(&device, seed);
    let net = Net {
        embedding: EmbeddingConfig::new(11, 8).init(&device).into(),
        qkv: LinearConfig::new(8, 24).init(&device).into(),
        out: LinearConfig::new(8, 8).init(&device).into(),
        head: LinearConfig::new(8, 3).init(&device),
    };
    for_each_value(&net);
    net
}

/// Reads every parameter (Burn draws a parameter on its first read).
fn for_each_value<B: Backend, M: Module<B>>(module: &M) {
    struct Draw;
    impl<B: Backend> ModuleVisitor<B> for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            param.val();
        }
    }
    module.visit(&mut Draw);
}

/// Every parameter's path → values.
fn values<M: Module<B>>(module: &M) -> BTreeMap<String, Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().into_data().to_vec().unwrap());
        }
    }
    let mut collect = Values(Vec::new());
    module.visit(&mut collect);
    let paths = wildfire_parallel::paths::param_shapes(module);
    paths.into_iter().map(|(p, _)| p).zip(collect.0).collect()
}

fn ranks(n: usize) -> Vec<ProcessGroup> {
    ProcessGroup::local_world(n, CommOptions::default()).unwrap()
}

/// `net(seed)` split for rank `group`, with its layout.
fn split(seed: u64, group: &ProcessGroup) -> (Net<B>, ModuleLayout) {
    let plan = TpPlan::new(PLAN, group.rank(), group.size());
    let whole = net(seed);
    let layout = ModuleLayout::of(&whole, plan.clone());
    (apply_plan(whole, &plan, group).unwrap(), layout)
}

/// The whole tensors of a tp 2 checkpoint of `net(1)`, written and read through the store.
fn saved_at_tp_2(dir: &std::path::Path) -> BTreeMap<String, TensorData> {
    let staging = store::create_staging(dir, 1).unwrap();
    let entries = (ranks(2).iter())
        .map(|group| {
            let (model, layout) = split(1, group);
            let slices = layout.slices(&model).unwrap();
            store::write_shard(&staging, group.rank(), &slices).unwrap()
        })
        .collect();
    store::commit(dir, &staging, 1, 2, entries, serde_json::Value::Null).unwrap();
    let (_, slices) =
        store::read_checkpoint(&store::latest_checkpoint(dir).unwrap().unwrap()).unwrap();
    join_slices(slices).unwrap()
}

#[test]
fn a_tp_2_checkpoint_loads_at_tp_1_2_and_4() {
    let dir = std::env::temp_dir().join(format!("wildfire-module-ckpt-{}", std::process::id()));
    let tensors = saved_at_tp_2(&dir);
    let whole = values(&net(1));
    for tp in [1, 2, 4] {
        for group in ranks(tp) {
            // Drawn from another seed: every value must come from the checkpoint.
            let (model, layout) = split(2, &group);
            let loaded = values(&layout.load(model, &tensors).unwrap());
            let plan = TpPlan::new(PLAN, group.rank(), group.size());
            let expected = values(&apply_plan(net(1), &plan, &group).unwrap());
            assert_eq!(loaded, expected, "tp {tp}, rank {}", group.rank());
            if tp == 1 {
                assert_eq!(loaded, whole, "tp 1 is the whole model");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_that_does_not_fit_is_refused_naming_the_parameter() {
    let dir = std::env::temp_dir().join(format!("wildfire-module-bad-{}", std::process::id()));
    let mut tensors = saved_at_tp_2(&dir);
    let group = ranks(1).remove(0);
    let (model, layout) = split(2, &group);
    let mut missing = tensors.clone();
    missing.remove("out.bias");
    let error = layout.load(model.clone(), &missing).unwrap_err();
    assert!(
        matches!(&error, CheckpointError::InvalidSlice { name, .. } if name == "out.bias"),
        "{error}"
    );
    let wrong = TensorData::new(vec![0f32; 8 * 12], [8, 12]);
    tensors.insert("qkv.weight".into(), wrong);
    let error = layout.load(model, &tensors).unwrap_err().to_string();
    assert!(
        error.contains("qkv.weight") && error.contains("[8, 24]"),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

type A = Autodiff<Flex>;

/// Whole AdamW state for every parameter of the model: two moments of distinct values and a
/// step count, by stored name.
fn whole_moments() -> BTreeMap<String, TensorData> {
    let mut tensors = BTreeMap::new();
    let shapes = wildfire_parallel::paths::param_shapes(&net(1));
    for (i, (path, shape)) in shapes.into_iter().enumerate() {
        let len: usize = shape.iter().product();
        for (k, prefix) in ["optim.exp_avg.", "optim.exp_avg_sq."]
            .into_iter()
            .enumerate()
        {
            let values: Vec<f32> = (0..len)
                .map(|j| (k * 100_000 + i * 1000 + j) as f32)
                .collect();
            let data = TensorData::new(values, shape.clone());
            tensors.insert(format!("{prefix}{path}"), data);
        }
        tensors.insert(
            format!("optim.step.{path}"),
            TensorData::new(vec![7i64], [1]),
        );
    }
    tensors
}

/// The slices of an AdamW loaded from `tensors` into the model split for rank `group` (on the
/// autodiff backend), saved again.
fn loaded_adamw(
    group: &ProcessGroup,
    tensors: &BTreeMap<String, TensorData>,
) -> Result<Vec<store::TensorSlice>, CheckpointError> {
    let plan = TpPlan::new(PLAN, group.rank(), group.size());
    let whole = net_on::<A>(2);
    let layout = ModuleLayout::of(&whole, plan.clone());
    let model = apply_plan(whole, &plan, group).unwrap();
    let adamw = load_optimizer(&layout, &model, AdamWConfig::new().init(), tensors)?;
    optimizer_slices(&layout, &model, &adamw)
}

#[test]
fn adamw_moments_load_at_tp_2_and_4_and_save_as_the_whole_moments() {
    let whole = whole_moments();
    for tp in [1, 2, 4] {
        let slices: Vec<_> = (ranks(tp).iter())
            .flat_map(|group| loaded_adamw(group, &whole).unwrap())
            .collect();
        let joined = join_slices(slices).unwrap();
        assert_eq!(
            joined.keys().collect::<Vec<_>>(),
            whole.keys().collect::<Vec<_>>(),
            "tp {tp}: every moment and step, once"
        );
        for (name, data) in &whole {
            assert_eq!(&joined[name], data, "tp {tp}: {name}");
        }
    }
}

#[test]
fn moments_that_do_not_fit_are_refused_naming_the_tensor() {
    let group = ranks(2).remove(0);
    let mut missing = whole_moments();
    missing.remove("optim.exp_avg_sq.out.bias");
    let error = loaded_adamw(&group, &missing).unwrap_err().to_string();
    assert!(
        error.contains("optim.exp_avg_sq.out.bias") && error.contains("missing"),
        "{error}"
    );
    let mut wrong = whole_moments();
    let moment = TensorData::new(vec![0f32; 8 * 12], [8, 12]);
    wrong.insert("optim.exp_avg.qkv.weight".into(), moment);
    let error = loaded_adamw(&group, &wrong).unwrap_err().to_string();
    assert!(
        error.contains("optim.exp_avg.qkv.weight") && error.contains("[8, 24]"),
        "{error}"
    );
}

/// ZeRO's form of the moments: each parameter's part at tp 2, flattened, is what the Burn
/// optimizer's record holds of it, bitwise.
#[test]
fn flat_moments_are_the_records_moments_flattened() {
    let whole = whole_moments();
    for group in ranks(2) {
        let plan = TpPlan::new(PLAN, group.rank(), group.size());
        let full = net_on::<A>(2);
        let layout = ModuleLayout::of(&full, plan.clone());
        let model = apply_plan(full, &plan, &group).unwrap();
        let flat = flat_moments(&layout, &model, &whole).unwrap();
        let records = optimizer_records::<A, _, AdamW>(&layout, &model, &whole).unwrap();
        assert_eq!(flat.len(), records.len(), "rank {}", group.rank());
        let dims: BTreeMap<_, _> = (wildfire_parallel::dp::param_specs(&model).into_iter())
            .map(|spec| (spec.id, spec.shape.len()))
            .collect();
        for (id, record) in records {
            let moments = &flat[&id];
            assert_eq!(moments.time, 7);
            let expected = match dims[&id] {
                1 => flattened(record.into_state::<1>().momentum),
                2 => flattened(record.into_state::<2>().momentum),
                other => panic!("no parameter of rank {other} in the model"),
            };
            let values = |t: &Tensor<B, 1>| t.to_data().to_vec::<f32>().unwrap();
            let found = (values(&moments.exp_avg), values(&moments.exp_avg_sq));
            assert_eq!(found, expected, "rank {}", group.rank());
        }
    }
}

/// Both moments of `momentum`, flattened.
fn flattened<const D: usize>(
    momentum: burn::optim::AdaptiveMomentumState<B, D>,
) -> (Vec<f32>, Vec<f32>) {
    let values = |t: Tensor<B, D>| t.flatten::<1>(0, D - 1).into_data().to_vec().unwrap();
    (values(momentum.moment_1), values(momentum.moment_2))
}

/// Two layers of one shape, the second holding a copy of the first's weight (as a tied
/// embedding's copy on a later pipeline stage).
#[derive(Module, Debug)]
struct Pair<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
}

/// A copy is neither saved nor missed: it loads its original's weight and moments.
#[test]
fn a_copy_is_stored_as_its_original_and_loads_from_it() {
    let pair = || {
        let device = Default::default();
        let _draw = DRAW.lock().unwrap_or_else(|p| p.into_inner());
        let pair = Pair::<A> {
            first: LinearConfig::new(4, 4).init(&device),
            second: LinearConfig::new(4, 4).init(&device),
        };
        for_each_value(&pair);
        pair
    };
    let saved = pair();
    let layout = ModuleLayout::of(&saved, TpPlan::new(&[], 0, 1))
        .with_copy("second.weight", "first.weight")
        .unwrap();
    let names: Vec<_> = (layout.slices(&saved).unwrap().into_iter())
        .map(|slice| slice.name)
        .collect();
    assert_eq!(names, ["first.weight", "first.bias", "second.bias"]);
    let tensors: BTreeMap<_, _> = (layout.slices(&saved).unwrap().into_iter())
        .map(|slice| wildfire_parallel::checkpoint::slices::to_data(slice).unwrap())
        .collect();
    let loaded = layout.load(pair(), &tensors).unwrap();
    let weight = |linear: &Linear<A>| linear.weight.val().into_data();
    assert_eq!(weight(&loaded.second), weight(&saved.first));
    assert_eq!(weight(&loaded.first), weight(&saved.first));
    let mut moments = BTreeMap::new();
    for prefix in ["optim.exp_avg.", "optim.exp_avg_sq."] {
        let values: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let data = TensorData::new(values, [4, 4]);
        moments.insert(format!("{prefix}first.weight"), data);
    }
    moments.insert(
        "optim.step.first.weight".into(),
        TensorData::new(vec![3i64], [1]),
    );
    let flat = flat_moments(&layout, &loaded, &moments).unwrap();
    assert_eq!(flat.len(), 2, "the weight and its copy");
    let copy = &flat[&loaded.second.weight.id];
    let original = &flat[&loaded.first.weight.id];
    assert_eq!(copy.time, 3);
    let values = |t: &Tensor<B, 1>| t.to_data().to_vec::<f32>().unwrap();
    assert_eq!(values(&copy.exp_avg_sq), values(&original.exp_avg_sq));
}
