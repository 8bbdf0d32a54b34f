//! How far apart two sets of host values are, with no NaN slipping through: `f32::max` and
//! `f64::max` return the other operand when one is NaN, so a fold with them scores an output
//! that is partly or wholly NaN as 0 apart. Here a NaN anywhere makes the result NaN, which
//! fails every `≤ bound` check, and values of different lengths are an error, never a
//! comparison of the shorter prefix. The tests, benches and checks of every crate compare
//! through these.

/// The largest of `values`; NaN when any is NaN; 0 for none.
pub fn nan_max(values: impl IntoIterator<Item = f64>) -> f64 {
    // Once NaN, it stays NaN: `f64::max(NaN, x)` would give `x` back.
    values
        .into_iter()
        .fold(0.0, |worst, x| match worst.is_nan() || x.is_nan() {
            true => f64::NAN,
            false => worst.max(x),
        })
}

/// `max |a − b|` elementwise (NaN when any difference is NaN, 0 for none).
///
/// # Panics
/// When `a` and `b` differ in length, naming both.
pub fn max_abs_difference<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    assert_same_length(a.len(), b.len());
    nan_max(a.iter().zip(b).map(|(&x, &y)| (x.into() - y.into()).abs()))
}

/// `max |a − b| / max |b|`: the largest difference relative to the reference `b`'s largest
/// magnitude (the smallest positive f64 when `b` is all zeros); NaN when any value is NaN.
///
/// # Panics
/// When `a` and `b` differ in length, naming both.
pub fn relative_difference<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    let scale = nan_max(b.iter().map(|&y| y.into().abs())).max(f64::MIN_POSITIVE);
    max_abs_difference(a, b) / scale
}

/// Whether `difference` is within `bound`: false for a NaN difference.
pub fn within(difference: f64, bound: f64) -> bool {
    difference <= bound
}

/// # Panics
/// When the lengths differ, naming both.
pub fn assert_same_length(a: usize, b: usize) {
    assert_eq!(a, b, "comparing {a} values with {b}: the lengths differ");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_anywhere_is_never_within_a_bound() {
        assert_eq!(nan_max([1.0, 3.0, 2.0]), 3.0);
        assert_eq!(nan_max([]), 0.0);
        assert!(nan_max([1.0, f64::NAN, 2.0]).is_nan());
        assert!(nan_max([f64::NAN]).is_nan());

        let good = [1.0f32, 2.0, -3.0];
        assert_eq!(max_abs_difference(&good, &[1.0, 2.5, -3.0]), 0.5);
        for nan_at in 0..3 {
            let mut bad = good;
            bad[nan_at] = f32::NAN;
            let difference = max_abs_difference(&bad, &good);
            assert!(
                !within(difference, 1e30),
                "a NaN at {nan_at} scored {difference}"
            );
            assert!(!within(relative_difference(&bad, &good), 1e30));
            assert!(
                !within(relative_difference(&good, &bad), 1e30),
                "a NaN in the reference"
            );
        }
        assert!(!within(
            max_abs_difference(&[f32::NAN; 3], &[f32::NAN; 3]),
            1e30
        ));
        assert_eq!(relative_difference(&[2.0f64, 4.0], &[2.0, 5.0]), 0.2);
        assert_eq!(relative_difference(&[0.0f64], &[0.0]), 0.0);
    }

    #[test]
    #[should_panic(expected = "comparing 2 values with 3: the lengths differ")]
    fn a_short_result_is_an_error_not_a_prefix() {
        max_abs_difference(&[1.0f32, 2.0], &[1.0, 2.0, 3.0]);
    }

    #[test]
    #[should_panic(expected = "comparing 3 values with 2")]
    fn a_short_reference_is_an_error_too() {
        relative_difference(&[1.0f64, 2.0, 3.0], &[1.0, 2.0]);
    }
}
