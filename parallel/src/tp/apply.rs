//! [`apply_plan`]: one function that splits any Burn module by a [`TpPlan`].
//!
//! It walks the module twice. The first walk (a visitor, [`check_plan`]) surveys it: every
//! parameter's path and shape, and every [`TensorParallel`] slot's path and layer; the plan is
//! checked against them before anything is split. The second walk (a mapper) cuts each parameter the plan splits to this rank's part,
//! as a copy with the same id, and fills in every slot. Slots hold no parameters, so they
//! learn where they are from the walk ([`super::walk`]).

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::ProcessGroup;

use super::plan::{PlanError, TpPlan, TpStyle};
use super::walk::{Layer, WalkGuard, with_walk};

/// The survey: parameters' paths and shapes (slots report themselves to the walk).
struct Survey(Vec<(String, Vec<usize>)>);

impl<B: Backend> ModuleVisitor<B> for Survey {
    fn enter_module(&mut self, name: &str, container: &str) {
        with_walk(|walk| walk.path.enter(name, container));
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        with_walk(|walk| walk.path.exit(container));
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = with_walk(|walk| walk.path.current()).unwrap_or_default();
        self.0.push((path, param.lazy_shape().to_vec()));
    }
}

/// The second walk: each parameter the plan splits becomes this rank's part of it.
struct Cut;

impl<B: Backend> ModuleMapper<B> for Cut {
    fn enter_module(&mut self, name: &str, container: &str) {
        with_walk(|walk| walk.path.enter(name, container));
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        with_walk(|walk| walk.path.exit(container));
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let at = with_walk(|walk| {
            let (plan, ..) = walk.apply.as_ref()?;
            Some((walk.path.current(), plan.clone()))
        });
        let Some((path, plan)) = at.flatten() else {
            return param;
        };
        if !plan.is_split(&path, D) {
            return param;
        }
        param.map(|whole| {
            let require_grad = whole.is_require_grad();
            plan.local_part(&path, whole).set_require_grad(require_grad)
        })
    }
}

/// `module` split over `group` by `plan`: each parameter the plan splits replaced by this
/// rank's part of it (a copy with the parameter's id, so parts are bitwise slices of the whole),
/// and every [`TensorParallel`] slot filled in, so that the parallel layers issue the
/// collectives their styles need (see [`super::layers`]). Apply it to the whole model, before
/// an optimizer is built or a pipeline split.
///
/// Refused before anything is split, naming the path and sizes, where [`check_plan`] refuses
/// the plan. (The module is consumed either way; call [`check_plan`] first to keep it.)
pub fn apply_plan<B: Backend, M: Module<B>>(
    module: M,
    plan: &TpPlan,
    group: &ProcessGroup,
) -> Result<M, PlanError> {
    let params = check_plan(&module, plan, group)?;
    let shapes = params.into_iter().collect();
    let _guard = WalkGuard::start(Some((plan.clone(), group.clone(), shapes)));
    Ok(module.map(&mut Cut))
}

/// Checks that `plan` fits `module` over `group`, returning the module's parameters as
/// `(path, shape)`. Refused, naming the path and sizes: a rule that matches no parameter, a
/// parameter two rules match, a split that does not divide ([`TpPlan::check`]), a split style
/// on a module that is not one of wildfire's parallel layers (Burn's `Linear` would compute with
/// its slice and never communicate), a style its layer cannot take (a row split of an
/// embedding), and a plan for another rank or group size than `group`'s.
pub fn check_plan<B: Backend, M: Module<B>>(
    module: &M,
    plan: &TpPlan,
    group: &ProcessGroup,
) -> Result<Vec<(String, Vec<usize>)>, PlanError> {
    if (plan.rank, plan.size) != (group.rank(), group.size()) {
        return Err(PlanError::WrongGroup {
            plan_rank: plan.rank,
            plan_size: plan.size,
            group_rank: group.rank(),
            group_size: group.size(),
        });
    }
    let (params, slots) = {
        let guard = WalkGuard::start(None);
        let mut survey = Survey(Vec::new());
        module.visit(&mut survey);
        (survey.0, guard.slots())
    };
    plan.check(&params)?;
    check_layers(plan, &params, &slots)?;
    Ok(params)
}

/// Every split parameter belongs to a parallel layer that takes its style (or, split by
/// vocabulary rows, is a table the plan names exactly: a tied head's copy), and every layer the
/// plan names takes its style.
fn check_layers(
    plan: &TpPlan,
    params: &[(String, Vec<usize>)],
    slots: &[(String, Layer)],
) -> Result<(), PlanError> {
    let layers: HashMap<&str, Layer> = slots.iter().map(|(p, l)| (p.as_str(), *l)).collect();
    for (path, layer) in slots {
        let Some(style) = plan.exact_style(path) else {
            continue;
        };
        let needed = match style {
            TpStyle::Column { .. }
            | TpStyle::ColumnHeads { .. }
            | TpStyle::Row
            | TpStyle::VocabColumns => Layer::Linear,
            TpStyle::VocabRows => Layer::Embedding,
            TpStyle::Replicated | TpStyle::SequenceRegion | TpStyle::HeadShared => *layer,
        };
        if needed != *layer {
            return Err(wrong_layer(path, layer.describe().to_string(), style));
        }
    }
    for (path, shape) in params {
        let (Some(style), true) = (plan.style(path), plan.is_split(path, shape.len())) else {
            continue;
        };
        let owner = path.rsplit_once('.').map_or("", |(owner, _)| owner);
        let owned_by_layer = layers.contains_key(owner) && plan.exact_style(owner) == Some(style);
        let bare_table = style == TpStyle::VocabRows && plan.exact_style(path).is_some();
        if !owned_by_layer && !bare_table {
            let found = format!("a parameter of `{owner}`, which is not a wildfire parallel layer");
            return Err(wrong_layer(path, found, style));
        }
    }
    Ok(())
}

fn wrong_layer(path: &str, found: String, style: TpStyle) -> PlanError {
    let needed = match style {
        TpStyle::VocabRows => "a ParallelEmbedding (or a table parameter named by the rule)",
        _ => "a ParallelLinear",
    };
    PlanError::WrongLayer {
        path: path.to_string(),
        found,
        style,
        needed,
    }
}
