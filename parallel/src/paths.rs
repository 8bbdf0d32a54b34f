//! Module paths: the dotted name of every module and parameter of a Burn module
//! (`blocks.3.attn.c_attn.weight`), as Burn's `enter_module`/`exit_module` report them to a
//! visitor or mapper. A parameter's path is the field that holds it, so the current path when
//! a visitor meets it is its name.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::host_data::aligned;

/// The path of the module or parameter a visitor or mapper is at.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PathStack {
    parts: Vec<String>,
    /// A top-level list whose entries are named from an index other than 0 (see
    /// [`PathStack::numbered_from`]).
    numbering: Option<(String, usize)>,
}

/// Burn enters an enum module's variant like a field (`c_attn.Column.weight`); a path leaves the
/// variant out (`c_attn.weight`), so it is the same whichever variant holds the parameter.
fn is_variant(container: &str) -> bool {
    container.starts_with("Enum:")
}

impl PathStack {
    /// Paths of a part of a model whose top-level list `field` holds the whole model's entries
    /// from index `first` on (a pipeline stage's blocks): each entry is named by its index in
    /// the whole model (`blocks.5` for a stage's second block when `first` is 4).
    pub fn numbered_from(field: &str, first: usize) -> Self {
        Self {
            parts: Vec::new(),
            numbering: Some((field.to_string(), first)),
        }
    }

    pub fn enter(&mut self, name: &str, container: &str) {
        if is_variant(container) {
            return;
        }
        let name = match (
            &self.numbering,
            self.parts.as_slice(),
            name.parse::<usize>(),
        ) {
            (Some((field, first)), [top], Ok(local)) if top == field => (local + first).to_string(),
            _ => name.to_string(),
        };
        self.parts.push(name);
    }

    pub fn exit(&mut self, container: &str) {
        if !is_variant(container) {
            self.parts.pop();
        }
    }

    /// The current path, components joined by dots.
    pub fn current(&self) -> String {
        self.parts.join(".")
    }

    /// The path of the module holding the current one (empty at the top).
    pub fn parent(&self) -> String {
        self.parts[..self.parts.len().saturating_sub(1)].join(".")
    }
}

/// Something done to every float parameter, with its path.
pub trait ParamFn<B: Backend> {
    fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>);
}

/// Burn reports the field holding a parameter (`weight`) as the last `enter_module`, so the
/// parameter's path is the current path itself.
struct Visit<'a, F> {
    path: PathStack,
    f: &'a mut F,
}

impl<B: Backend, F: ParamFn<B>> ModuleVisitor<B> for Visit<'_, F> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        self.path.exit(container);
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.f.visit(&self.path.current(), param);
    }
}

/// Calls `f` on every float parameter of `module` with its path (named as `path` names them:
/// `PathStack::default()`, or [`PathStack::numbered_from`]), in module order.
pub fn for_each_param<B: Backend, M: Module<B>, F: ParamFn<B>>(
    module: &M,
    path: PathStack,
    f: &mut F,
) {
    module.visit(&mut Visit { path, f });
}

/// Every float parameter of `module` as `(path, shape)`, in module order.
pub fn param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    param_shapes_at(module, PathStack::default())
}

/// Every float parameter of `module` as `(path, shape)`, named as `path` names them.
pub fn param_shapes_at<B: Backend, M: Module<B>>(
    module: &M,
    path: PathStack,
) -> Vec<(String, Vec<usize>)> {
    struct Shapes(Vec<(String, Vec<usize>)>);
    impl<B: Backend> ParamFn<B> for Shapes {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            self.0.push((path.to_string(), param.lazy_shape().to_vec()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    for_each_param(module, path, &mut shapes);
    shapes.0
}

/// Every float parameter's value by path: a module's whole state, to load into the same module
/// on another backend or device ([`crate::checkpoint::ModuleLayout::load`]).
pub fn param_values<B: Backend, M: Module<B>>(module: &M) -> BTreeMap<String, TensorData> {
    struct Values(BTreeMap<String, TensorData>);
    impl<B: Backend> ParamFn<B> for Values {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            self.0
                .insert(path.to_string(), aligned(param.val().into_data()));
        }
    }
    let mut values = Values(BTreeMap::new());
    for_each_param(module, PathStack::default(), &mut values);
    values.0
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    #[derive(Module, Debug)]
    enum Either<B: Backend> {
        One(Linear<B>),
    }

    #[derive(Module, Debug)]
    struct Net<B: Backend> {
        layers: Vec<Linear<B>>,
        head: Option<Either<B>>,
    }

    #[test]
    fn paths_name_fields_and_indices_and_skip_enum_variants() {
        let device = Default::default();
        let net = Net::<Flex> {
            layers: vec![LinearConfig::new(2, 3).init(&device)],
            head: Some(Either::One(
                LinearConfig::new(3, 4).with_bias(false).init(&device),
            )),
        };
        let shapes = param_shapes(&net);
        let expected = [
            ("layers.0.weight", vec![2, 3]),
            ("layers.0.bias", vec![3]),
            ("head.weight", vec![3, 4]),
        ];
        let expected: Vec<(String, Vec<usize>)> = expected
            .into_iter()
            .map(|(path, shape)| (path.to_string(), shape))
            .collect();
        assert_eq!(shapes, expected);
    }
}
