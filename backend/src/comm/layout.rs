//! Index maps between a row-major tensor and the parts collectives split it into.
//!
//! A tensor of shape `[.., S, ..]` viewed along dimension `d` is `outer × S × inner` elements,
//! with `outer = ∏ shape[..d]` and `inner = ∏ shape[d+1..]`. Rows `[a, b)` along `d` are `outer`
//! runs of `(b - a) · inner` contiguous elements.
//!
//! **Uneven splits.** Splitting `S` rows among `n` ranks follows `torch.tensor_split`: the first
//! `S mod n` parts get `⌈S/n⌉` rows, the others `⌊S/n⌋`. Part sizes differ by at most one, a part
//! may be empty (S < n), and concatenating the parts in rank order gives the tensor back, so
//! `all_gather(reduce_scatter(x))` has the shape of `x`.

use std::ops::Range;

/// Sizes of the `n` parts of `total` rows (see the module docs).
pub fn split_sizes(total: usize, n: usize) -> Vec<usize> {
    let (base, extra) = (total / n, total % n);
    (0..n).map(|i| base + usize::from(i < extra)).collect()
}

/// Row ranges of the `n` parts of `total` rows.
pub fn split_ranges(total: usize, n: usize) -> Vec<Range<usize>> {
    let mut start = 0;
    split_sizes(total, n)
        .into_iter()
        .map(|len| {
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// A shape seen along one dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AlongDim {
    pub outer: usize,
    pub size: usize,
    pub inner: usize,
}

impl AlongDim {
    pub(crate) fn new(shape: &[usize], dim: usize) -> Self {
        Self {
            outer: shape[..dim].iter().product(),
            size: shape[dim],
            inner: shape[dim + 1..].iter().product(),
        }
    }

    /// Whether rows `rows` form one contiguous run of the flat buffer.
    pub(crate) fn is_contiguous(&self, rows: &Range<usize>) -> bool {
        self.outer <= 1 || rows.is_empty()
    }

    /// The flat range of rows `rows` when they are contiguous.
    pub(crate) fn flat(&self, rows: &Range<usize>) -> Range<usize> {
        if self.outer == 0 {
            return 0..0;
        }
        rows.start * self.inner..rows.end * self.inner
    }

    /// Copies rows `rows` out of `data` into a new row-major buffer of shape `[outer, len, inner]`.
    pub(crate) fn pack<E: Copy>(&self, data: &[E], rows: &Range<usize>) -> Vec<E> {
        let run = rows.len() * self.inner;
        let mut out = Vec::with_capacity(self.outer * run);
        for o in 0..self.outer {
            let start = (o * self.size + rows.start) * self.inner;
            out.extend_from_slice(&data[start..start + run]);
        }
        out
    }
}

/// Concatenates parts along one dimension. Part `q` has `outer × sizes[q] × inner` elements.
pub(crate) fn concat<E: Copy>(
    parts: &[&[E]],
    sizes: &[usize],
    outer: usize,
    inner: usize,
) -> Vec<E> {
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for (part, size) in parts.iter().zip(sizes) {
            let run = size * inner;
            out.extend_from_slice(&part[o * run..(o + 1) * run]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_split_puts_the_extra_rows_first() {
        assert_eq!(split_sizes(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(split_sizes(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(split_sizes(0, 3), vec![0, 0, 0]);
        assert_eq!(split_ranges(7, 3), vec![0..3, 3..5, 5..7]);
    }

    #[test]
    fn pack_then_concat_restores_the_tensor() {
        // shape [2, 5, 3] split along dim 1 into 2 parts (3 and 2 rows).
        let data: Vec<u32> = (0..30).collect();
        let along = AlongDim::new(&[2, 5, 3], 1);
        let ranges = split_ranges(5, 2);
        let parts: Vec<Vec<u32>> = ranges.iter().map(|r| along.pack(&data, r)).collect();
        assert_eq!(parts[1][..6], [9, 10, 11, 12, 13, 14]);
        let refs: Vec<&[u32]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(concat(&refs, &[3, 2], 2, 3), data);
    }

    #[test]
    fn contiguity_along_the_first_dimension() {
        let along = AlongDim::new(&[6, 4], 0);
        assert!(along.is_contiguous(&(2..4)));
        assert_eq!(along.flat(&(2..4)), 8..16);
        assert!(!AlongDim::new(&[6, 4], 1).is_contiguous(&(1..2)));
    }
}
