//! Module paths: the dotted name of every module and parameter of a Burn module
//! (`blocks.3.attn.c_attn.weight`), as Burn's `enter_module`/`exit_module` report them to a
//! visitor or mapper. A parameter's path is the field that holds it, so the current path when
//! a visitor meets it is its name.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// The path of the module or parameter a visitor or mapper is at.
#[derive(Debug, Default, Clone)]
pub struct PathStack {
    parts: Vec<String>,
}

/// Burn enters an enum module's variant like a field (`c_attn.Column.weight`); a path leaves the
/// variant out (`c_attn.weight`), so it is the same whichever variant holds the parameter.
fn is_variant(container: &str) -> bool {
    container.starts_with("Enum:")
}

impl PathStack {
    pub fn enter(&mut self, name: &str, container: &str) {
        if !is_variant(container) {
            self.parts.push(name.to_string());
        }
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

/// Every float parameter of `module` as `(path, shape)`, in module order.
pub fn param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    struct Shapes {
        path: PathStack,
        found: Vec<(String, Vec<usize>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, container: &str) {
            self.path.exit(container);
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let shape = param.lazy_shape().to_vec();
            self.found.push((self.path.current(), shape));
        }
    }
    let mut shapes = Shapes {
        path: PathStack::default(),
        found: Vec::new(),
    };
    module.visit(&mut shapes);
    shapes.found
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
