//! Tensor-parallel layers (`ParallelLinear::split_from`, `ParallelEmbedding::split_from`: a
//! layer split on its own, as a plan splits it) against their serial counterparts on `Autodiff<Parallel<Flex>>`, ranks
//! as threads (2 and 4, with sizes that do not divide by them): forward outputs and the
//! gradients of inputs and weights.
//!
//! Exactness: a column-parallel output element and a weight-gradient element are the serial
//! layer's own dot products, so they are bitwise equal; the input gradient of a column-parallel
//! layer and the output of a row-parallel one are sums over ranks of partial dot products, a
//! different summation order: bitwise on integer-valued data (every partial sum exact), within
//! 1e-6 of the largest value on float data (the f32 rounding of a handful of terms). The
//! vocabulary-parallel cross-entropy, from the logits or fused with the head, sums `exp` per
//! rank, then over ranks: within 1e-6.
//!
//! The bitwise claims hold on every SIMD width (AVX2 or AVX-512): a compared element is the same
//! `k` products on both sides, and gemm adds them in order in one fused multiply-add chain on
//! every path these shapes take (`k ≤ 512`, one block of `k`), whatever its vector width; where
//! the serial product and a shard's both take gemm's small-matrix path, which sums lanes, they
//! take it with the same `k` and the same lanes.

use crate::common::{assert_close, threads, values};
use burn::backend::{Autodiff, Flex};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::gelu;
use burn::tensor::module::linear;
use burn::tensor::{Int, Tensor, TensorData};
use wildfire_backend::Parallel;
use wildfire_backend::comm::{OpKind, ProcessGroup, split_ranges};
use wildfire_backend::kernels::cross_entropy::{
    HeadLayout, IGNORE_INDEX, LinearCrossEntropy, logits_cross_entropy_sum,
};
use wildfire_parallel::tp::{
    ParallelEmbedding, ParallelLinear, TpStyle, vocab_parallel_cross_entropy,
};

type B = Autodiff<Parallel<Flex>>;

fn tensor<const D: usize>(seed: u64, shape: [usize; D], integer: bool) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(
        TensorData::new(values(seed, n, integer), shape),
        &Default::default(),
    )
}

fn data<BB: burn::tensor::backend::Backend, const D: usize>(t: Tensor<BB, D>) -> Vec<f32> {
    t.into_data().to_vec().unwrap()
}

/// A copy of `t` with its own autodiff node: clones share one, and ranks that made the same
/// node a leaf would share (and lock) one graph.
fn fresh<const D: usize>(t: &Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_data(t.to_data(), &Default::default())
}

/// Columns `cols` of a row-major `[rows, width]` matrix.
fn columns(m: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks(width)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

const N_IN: usize = 6;
/// A fused QKV-like output: 3 sections of 5 columns (5 does not divide by 2 or 4).
const SECTION: usize = 5;

/// Serial `y = xW + b` and the gradients of `Σ y·c`: (y, dx, dW, db). The product is Burn's
/// linear op, as the parallel layers compute theirs (on `Parallel<B>` its weight gradient sums
/// over all rows in one product; a batched matmul would sum per batch entry, then over them).
fn serial_linear(
    x: &Tensor<B, 3>,
    w: &Tensor<B, 2>,
    b: &Tensor<B, 1>,
    c: &Tensor<B, 3>,
) -> [Vec<f32>; 4] {
    let (x, w, b) = (
        x.clone().require_grad(),
        w.clone().require_grad(),
        b.clone().require_grad(),
    );
    let y = linear(x.clone(), w.clone(), None) + b.clone().unsqueeze();
    let grads = (y.clone() * c.clone()).sum().backward();
    [
        data(y),
        data(x.grad(&grads).unwrap()),
        data(w.grad(&grads).unwrap()),
        data(b.grad(&grads).unwrap()),
    ]
}

/// The output columns rank `rank` of `ranks` computes: its part of each of `sections` equal
/// column blocks of `n_out`.
fn column_part(n_out: usize, sections: usize, rank: usize, ranks: usize) -> Vec<usize> {
    let width = n_out / sections;
    let part = split_ranges(width, ranks)[rank].clone();
    (0..sections)
        .flat_map(|s| s * width + part.start..s * width + part.end)
        .collect()
}

/// Elements `cols` of every row of a row-major matrix of `width` columns.
fn pick(m: &[f32], width: usize, cols: &[usize]) -> Vec<f32> {
    m.chunks(width)
        .flat_map(|row| cols.iter().map(|&c| row[c]))
        .collect()
}

/// With the output gathered (one section of 15 columns) and left split (3 sections of 5, as a
/// fused QKV projection is); 15 and 5 do not divide by 2 or 4.
#[test]
fn column_parallel_matches_the_serial_layer() {
    let n_out = 3 * SECTION;
    for integer in [true, false] {
        let x = tensor(1, [2, 3, N_IN], integer);
        let w = tensor(2, [N_IN, n_out], integer);
        let b = tensor(3, [n_out], integer);
        let c = tensor(4, [2, 3, n_out], integer);
        let [y, dx, dw, db] = serial_linear(&x, &w, &b, &c);
        for (ranks, sections, gather) in [(2, 1, true), (4, 1, true), (2, 3, false), (4, 3, false)]
        {
            let (x, w, b, c) = (x.clone(), w.clone(), b.clone(), c.clone());
            let results = threads(ranks, move |group| {
                let style = TpStyle::Column {
                    sections,
                    gather_output: gather,
                };
                let layer =
                    ParallelLinear::split_from(w.clone(), Some(b.clone()), style, &group, None);
                let x = fresh(&x).require_grad();
                let y = layer.forward(x.clone());
                // Gathered, every rank scores all columns: the gather's backward keeps each rank's
                // own part of the gradient, so the replicated loss counts once. Split, each rank
                // scores its own columns.
                let cols = column_part(n_out, sections, group.rank(), ranks);
                let c = if gather {
                    c.clone()
                } else {
                    let parts: Vec<_> = cols
                        .iter()
                        .map(|&col| c.clone().slice([0..2, 0..3, col..col + 1]))
                        .collect();
                    Tensor::cat(parts, 2)
                };
                let grads = (y.clone() * c).sum().backward();
                let dw = layer.weight.val().grad(&grads).unwrap();
                let db = layer.bias.as_ref().unwrap().val().grad(&grads).unwrap();
                (
                    data(y),
                    data(x.grad(&grads).unwrap()),
                    data(dw),
                    data(db),
                    cols,
                )
            });
            for (y_r, dx_r, dw_r, db_r, cols) in results {
                let what = format!(
                    "column tp {ranks}, {sections} sections, integer {integer}, columns {cols:?}"
                );
                let expected_y = if gather {
                    y.clone()
                } else {
                    pick(&y, n_out, &cols)
                };
                assert_eq!(y_r, expected_y, "{what}: output");
                assert_eq!(dw_r, pick(&dw, n_out, &cols), "{what}: weight gradient");
                assert_eq!(db_r, pick(&db, n_out, &cols), "{what}: bias gradient");
                if integer {
                    assert_eq!(dx_r, dx, "{what}: input gradient");
                } else {
                    assert_close(&dx_r, &dx, 1e-6, &format!("{what}: input gradient"));
                }
            }
        }
    }
}

/// Key/value projections under more ranks than heads (`ColumnHeads`): 2 heads of 3 columns
/// over 4 ranks, 1 head over 2. Rank `r` holds head `r / (p/heads)` and scores it with a
/// coefficient tensor of its own, as its query heads would use it, so the serial layer's loss
/// scores each head with the sum of its ranks' coefficients. The head's weight and bias
/// gradients are then the sums over the ranks holding it, equal on each of them (the copies stay
/// equal through an update); against the serial layer they are the same sums in another order:
/// bitwise on integer data, within 1e-6 on float data, as the input gradient.
#[test]
fn column_heads_shared_by_ranks_sum_their_gradients() {
    const HEAD: usize = 3;
    for integer in [true, false] {
        for (ranks, heads) in [(4, 2), (2, 1)] {
            let n_out = heads * HEAD;
            let share = ranks / heads;
            let x = tensor(1, [2, 3, N_IN], integer);
            let w = tensor(2, [N_IN, n_out], integer);
            let b = tensor(3, [n_out], integer);
            let coefficients = move |rank: usize| tensor(10 + rank as u64, [2, 3, HEAD], integer);
            // The serial loss's coefficients: head j scored by the sum over its ranks'.
            let c = (0..heads).map(|j| {
                let sharing = (j * share..(j + 1) * share).map(coefficients);
                sharing.reduce(|sum, c| sum + c).unwrap()
            });
            let c = Tensor::cat(c.collect(), 2);
            let [_, dx, dw, db] = serial_linear(&x, &w, &b, &c);
            let (xs, ws, bs) = (x.clone(), w.clone(), b.clone());
            let results = threads(ranks, move |group| {
                let style = TpStyle::ColumnHeads { heads };
                let layer =
                    ParallelLinear::split_from(fresh(&ws), Some(fresh(&bs)), style, &group, None);
                let x = fresh(&xs).require_grad();
                let y = layer.forward(x.clone());
                let grads = (y * coefficients(group.rank())).sum().backward();
                let dw = layer.weight.val().grad(&grads).unwrap();
                let db = layer.bias.as_ref().unwrap().val().grad(&grads).unwrap();
                (data(x.grad(&grads).unwrap()), data(dw), data(db))
            });
            for (rank, (dx_r, dw_r, db_r)) in results.iter().enumerate() {
                let head = rank / share;
                let cols: Vec<usize> = (head * HEAD..(head + 1) * HEAD).collect();
                let what =
                    format!("{heads} heads over {ranks} ranks, rank {rank}, integer {integer}");
                let first = &results[head * share];
                assert_eq!(
                    (dw_r, db_r),
                    (&first.1, &first.2),
                    "{what}: copies' gradients"
                );
                let (serial_dw, serial_db) = (pick(&dw, n_out, &cols), pick(&db, n_out, &cols));
                if integer {
                    assert_eq!(dw_r, &serial_dw, "{what}: weight gradient");
                    assert_eq!(db_r, &serial_db, "{what}: bias gradient");
                    assert_eq!(dx_r, &dx, "{what}: input gradient");
                } else {
                    assert_close(dw_r, &serial_dw, 1e-6, &format!("{what}: weight gradient"));
                    assert_close(db_r, &serial_db, 1e-6, &format!("{what}: bias gradient"));
                    assert_close(dx_r, &dx, 1e-6, &format!("{what}: input gradient"));
                }
            }
        }
    }
}

#[test]
fn row_parallel_matches_the_serial_layer() {
    let n_in = 7;
    for integer in [true, false] {
        let x = tensor(5, [2, 3, n_in], integer);
        let w = tensor(6, [n_in, 4], integer);
        let b = tensor(7, [4], integer);
        let c = tensor(8, [2, 3, 4], integer);
        let [y, dx, dw, db] = serial_linear(&x, &w, &b, &c);
        for ranks in [2, 4] {
            let (x, w, b, c) = (x.clone(), w.clone(), b.clone(), c.clone());
            let results = threads(ranks, move |group| {
                let row = TpStyle::Row;
                let layer =
                    ParallelLinear::split_from(fresh(&w), Some(fresh(&b)), row, &group, None);
                let cols = split_ranges(n_in, group.size())[group.rank()].clone();
                let x_r = x.clone().slice([0..2, 0..3, cols]).require_grad();
                let y = layer.forward(x_r.clone());
                let grads = (y.clone() * c.clone()).sum().backward();
                let dw = layer.weight.val().grad(&grads).unwrap();
                let db = layer.bias.as_ref().unwrap().val().grad(&grads).unwrap();
                (
                    data(y),
                    data(x_r.grad(&grads).unwrap()),
                    data(dw),
                    data(db),
                    group.rank(),
                )
            });
            for (y_r, dx_r, dw_r, db_r, rank) in results {
                let what = format!("row tp {ranks} rank {rank} integer {integer}");
                if integer {
                    assert_eq!(y_r, y, "{what}: output");
                } else {
                    assert_close(&y_r, &y, 1e-6, &format!("{what}: output"));
                }
                let rows = split_ranges(n_in, ranks)[rank].clone();
                assert_eq!(
                    dw_r,
                    dw[rows.start * 4..rows.end * 4].to_vec(),
                    "{what}: weight gradient"
                );
                assert_eq!(dx_r, columns(&dx, n_in, rows), "{what}: input gradient");
                assert_eq!(db_r, db, "{what}: bias gradient");
            }
        }
    }
}

#[test]
fn vocab_parallel_embedding_matches_the_serial_table() {
    let vocab = 11;
    let table = tensor(9, [vocab, 4], false);
    let ids: Tensor<B, 2, Int> = Tensor::from_data(
        TensorData::new(
            (0..12).map(|i| (i * 5 % vocab) as i64).collect::<Vec<_>>(),
            [2, 6],
        ),
        &Default::default(),
    );
    let c = tensor(10, [2, 6, 4], false);
    let serial_table = table.clone().require_grad();
    let serial = burn::tensor::module::embedding(serial_table.clone(), ids.clone());
    let grads = (serial.clone() * c.clone()).sum().backward();
    let (y, dt) = (data(serial), data(serial_table.grad(&grads).unwrap()));
    for ranks in [2, 4] {
        let (table, ids, c) = (table.clone(), ids.clone(), c.clone());
        let results = threads(ranks, move |group| {
            let layer = ParallelEmbedding::split_from(table.clone(), &group);
            let out = layer.forward(ids.clone());
            let grads = (out.clone() * c.clone()).sum().backward();
            (
                data(out),
                data(layer.weight.val().grad(&grads).unwrap()),
                group.rank(),
            )
        });
        for (y_r, dt_r, rank) in results {
            assert_eq!(y_r, y, "tp {ranks} rank {rank}: lookups");
            let rows = split_ranges(vocab, ranks)[rank].clone();
            assert_eq!(
                dt_r,
                dt[rows.start * 4..rows.end * 4].to_vec(),
                "tp {ranks} rank {rank}: rows' gradient"
            );
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_matches_the_serial_loss() {
    let vocab = 11;
    let logits = tensor(11, [2, 5, vocab], false).mul_scalar(4.0);
    let targets: Tensor<B, 2, Int> = Tensor::from_data(
        TensorData::new(
            (0..10).map(|i| (i * 7 % vocab) as i64).collect::<Vec<_>>(),
            [2, 5],
        ),
        &Default::default(),
    );
    let serial_logits = logits.clone().require_grad();
    let mean = CrossEntropyLossConfig::new()
        .init(&Default::default())
        .forward(
            serial_logits.clone().reshape([10, vocab]),
            targets.clone().reshape([10]),
        );
    let serial = mean.mul_scalar(10.0);
    let grads = serial.clone().backward();
    let (loss, dl) = (data(serial), data(serial_logits.grad(&grads).unwrap()));
    for ranks in [2, 4] {
        let (logits, targets) = (logits.clone(), targets.clone());
        let results = threads(ranks, move |group| {
            let cols = split_ranges(vocab, group.size())[group.rank()].clone();
            let part = logits
                .clone()
                .slice([0..2, 0..5, cols.clone()])
                .require_grad();
            let loss = vocab_parallel_cross_entropy(
                part.clone(),
                targets.clone(),
                cols.start,
                IGNORE_INDEX,
                &group,
            )
            .unwrap();
            let grads = loss.clone().backward();
            (data(loss), data(part.grad(&grads).unwrap()), cols)
        });
        for (loss_r, dl_r, cols) in results {
            let what = format!("tp {ranks} columns {cols:?}");
            assert_close(&loss_r, &loss, 1e-6, &format!("{what}: loss"));
            assert_close(
                &dl_r,
                &columns(&dl, vocab, cols.clone()),
                1e-6,
                &format!("{what}: logit gradient"),
            );
        }
    }
}

/// Rows `rows` of a row-major `[.., width]` matrix.
fn rows_of(m: &[f32], width: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    m[rows.start * width..rows.end * width].to_vec()
}

const CE_VOCAB: usize = 13;
const CE_WIDTH: usize = 6;

/// Targets of the fused cross-entropy's `[2, 5]` rows: rows 2 and 7 ignored.
fn ce_targets() -> Tensor<B, 2, Int> {
    let ids = (0..10)
        .map(|i| match i {
            2 | 7 => IGNORE_INDEX,
            _ => (i * 5 + 3) as i64 % CE_VOCAB as i64,
        })
        .collect::<Vec<_>>();
    Tensor::from_data(TensorData::new(ids, [2, 5]), &Default::default())
}

/// The serial decomposed loss (whole logits, Burn's autodiff) of `x: [2, 5, d]` through
/// `weight` in `layout`: (loss, dx, dW).
fn serial_cross_entropy(
    x: &Tensor<B, 3>,
    weight: &Tensor<B, 2>,
    layout: HeadLayout,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x, weight) = (fresh(x).require_grad(), fresh(weight).require_grad());
    let logits = layout.logits(x.clone().reshape([10, CE_WIDTH]), weight.clone());
    let loss = logits_cross_entropy_sum(logits, ce_targets().reshape([10]), IGNORE_INDEX);
    let grads = loss.backward();
    let dx = data(x.grad(&grads).unwrap());
    (data(loss), dx, data(weight.grad(&grads).unwrap()))
}

/// The fused cross-entropy of a head split by vocabulary (13 tokens over 2 and 4 ranks, in
/// blocks of 3 of the 10 rows, rows 2 and 7 ignored) against the serial decomposed loss: an
/// untied head (`ParallelLinear` split by columns, `[d, V]`; at tp 2 also under sequence
/// parallelism, its input the rank's part of the sequence) and a tied one (this rank's rows of
/// an embedding table through the table's slot). Each rank's loss is the whole loss; the input's
/// gradient (summed over the ranks by the region's entry) is the serial one, or its part of the
/// sequence; each weight part's gradient is the slice of the serial one cut here by hand. The
/// loss joins per-rank softmax statistics in another order than the serial one, and the input's
/// gradient sums per-rank products: within 1e-6 of the largest value.
#[test]
fn fused_cross_entropy_under_a_vocabulary_split_matches_the_serial_loss() {
    let x = tensor(30, [2, 5, CE_WIDTH], false).mul_scalar(2.0);
    let table = tensor(31, [CE_VOCAB, CE_WIDTH], false);
    let head = table.clone().transpose();
    let loss = LinearCrossEntropy::new().with_chunk_rows(3);
    for (layout, weight) in [
        (HeadLayout::VocabRows, table),
        (HeadLayout::VocabColumns, head),
    ] {
        let (serial_loss, serial_dx, serial_dw) = serial_cross_entropy(&x, &weight, layout);
        for (ranks, sequence_parallel) in [(2, false), (4, false), (2, true)] {
            if sequence_parallel && layout == HeadLayout::VocabRows {
                continue;
            }
            let (x, weight, loss) = (x.clone(), weight.clone(), loss.clone());
            let results = threads(ranks, move |group| {
                let cols = split_ranges(CE_VOCAB, group.size())[group.rank()].clone();
                let seq = split_ranges(5, group.size())[group.rank()].clone();
                let x = match sequence_parallel {
                    true => fresh(&x).slice([0..2, seq.clone(), 0..CE_WIDTH]),
                    false => fresh(&x),
                }
                .require_grad();
                let (value, weight) = match layout {
                    HeadLayout::VocabColumns => {
                        let sequence_dim = sequence_parallel.then_some(1);
                        let head = ParallelLinear::split_from(
                            fresh(&weight),
                            None,
                            TpStyle::VocabColumns,
                            &group,
                            sequence_dim,
                        );
                        let value = head.cross_entropy_sum(x.clone(), ce_targets(), &loss);
                        (value, head.weight.val())
                    }
                    HeadLayout::VocabRows => {
                        let table = ParallelEmbedding::split_from(fresh(&weight), &group);
                        let part = (table.weight.val(), layout);
                        let value = (table.tp).head_cross_entropy_sum(
                            x.clone(),
                            part,
                            CE_VOCAB,
                            ce_targets(),
                            &loss,
                        );
                        (value, table.weight.val())
                    }
                };
                let grads = value.backward();
                let dx = data(x.grad(&grads).unwrap());
                let dw = data(weight.grad(&grads).unwrap());
                (data(value), dx, dw, cols, seq)
            });
            for (loss_r, dx_r, dw_r, cols, seq) in results {
                let what =
                    format!("{layout:?} at tp {ranks}, sp {sequence_parallel}, columns {cols:?}");
                assert_close(&loss_r, &serial_loss, 1e-6, &format!("{what}: loss"));
                let dx = match sequence_parallel {
                    true => sequence_part(&serial_dx, 5, CE_WIDTH, seq),
                    false => serial_dx.clone(),
                };
                assert_close(&dx_r, &dx, 1e-6, &format!("{what}: input gradient"));
                let dw = match layout {
                    HeadLayout::VocabRows => rows_of(&serial_dw, CE_WIDTH, cols),
                    HeadLayout::VocabColumns => columns(&serial_dw, CE_VOCAB, cols),
                };
                assert_close(&dw_r, &dw, 1e-6, &format!("{what}: weight gradient"));
            }
        }
    }
}

/// Rows `rows` of dimension 1 of a `[batch, seq, width]` tensor (row-major values).
fn sequence_part(m: &[f32], seq: usize, width: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks(seq * width)
        .flat_map(|batch| batch[rows.start * width..rows.end * width].to_vec())
        .collect()
}

/// Collectives issued so far: [all-gather, reduce-scatter, all-reduce].
fn counts(group: &ProcessGroup) -> [u64; 3] {
    [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce].map(|op| group.op_count(op))
}

fn since(now: [u64; 3], before: [u64; 3]) -> [u64; 3] {
    [now[0] - before[0], now[1] - before[1], now[2] - before[2]]
}

/// Under sequence parallelism (sequence 5, split unevenly), a column-parallel layer takes its
/// part of the sequence and a row-parallel layer leaves its part: a column-then-row pair equals
/// the serial pair on each rank's part of the sequence, the input's gradient is the serial
/// one's part (integer data: bitwise), and the pair issues an all-gather and a reduce-scatter
/// each way, no all-reduce.
#[test]
fn sequence_parallel_layers_match_the_serial_pair() {
    let seq = 5;
    let x = tensor(20, [2, seq, 4], true);
    let w1 = tensor(21, [4, 6], true);
    let w2 = tensor(22, [6, 4], true);
    let b2 = tensor(23, [4], true);
    let c = tensor(24, [2, seq, 4], true);
    let serial_x = x.clone().require_grad();
    let y = serial_x
        .clone()
        .matmul(w1.clone().unsqueeze())
        .matmul(w2.clone().unsqueeze())
        + b2.clone().unsqueeze();
    let grads = (y.clone() * c.clone()).sum().backward();
    let (y, dx) = (data(y), data(serial_x.grad(&grads).unwrap()));
    for ranks in [2, 4] {
        let (x, w1, w2, b2, c) = (x.clone(), w1.clone(), w2.clone(), b2.clone(), c.clone());
        let results = threads(ranks, move |group| {
            let rows = split_ranges(seq, group.size())[group.rank()].clone();
            let sequence = Some(1);
            let up =
                ParallelLinear::split_from(fresh(&w1), None, TpStyle::COLUMN, &group, sequence);
            let b2 = Some(fresh(&b2));
            let down = ParallelLinear::split_from(fresh(&w2), b2, TpStyle::Row, &group, sequence);
            let x_r = x.clone().slice([0..2, rows.clone(), 0..4]).require_grad();
            let before = counts(&group);
            let y_r = down.forward(up.forward(x_r.clone()));
            let forward = counts(&group);
            let c_r = c.clone().slice([0..2, rows.clone(), 0..4]);
            let grads = (y_r.clone() * c_r).sum().backward();
            let backward = since(counts(&group), forward);
            let dx_r = data(x_r.grad(&grads).unwrap());
            (data(y_r), dx_r, rows, since(forward, before), backward)
        });
        for (y_r, dx_r, rows, forward, backward) in results {
            let what = format!("sp tp {ranks} rows {rows:?}");
            assert_eq!(
                y_r,
                sequence_part(&y, seq, 4, rows.clone()),
                "{what}: output"
            );
            assert_eq!(
                dx_r,
                sequence_part(&dx, seq, 4, rows),
                "{what}: input gradient"
            );
            assert_eq!(forward, [1, 1, 0], "{what}: forward collectives");
            assert_eq!(backward, [1, 1, 0], "{what}: backward collectives");
        }
    }
}

/// A column-parallel layer (output left split), GELU, a row-parallel layer: one all-reduce
/// forward (after the row-parallel layer) and one backward (the column-parallel input's
/// gradient), as Megatron's analysis of a tensor-parallel MLP says.
#[test]
fn a_parallel_mlp_issues_one_all_reduce_each_way() {
    let x = tensor(12, [2, 3, 4], false);
    let w1 = tensor(13, [4, 10], false);
    let w2 = tensor(14, [10, 4], false);
    let counts = threads(2, move |group| {
        let up = ParallelLinear::split_from(w1.clone(), None, TpStyle::COLUMN, &group, None);
        let down = ParallelLinear::split_from(fresh(&w2), None, TpStyle::Row, &group, None);
        let x = fresh(&x).require_grad();
        let before = group.op_count(OpKind::AllReduce);
        let y = down.forward(gelu(up.forward(x.clone())));
        let forward = group.op_count(OpKind::AllReduce) - before;
        let _grads = y.sum().backward();
        let backward = group.op_count(OpKind::AllReduce) - before - forward;
        (forward, backward)
    });
    assert_eq!(counts, [(1, 1), (1, 1)]);
}
