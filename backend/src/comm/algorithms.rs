//! The collectives, on host buffers, written once over the [`Transport`](super::transport) trait.
//!
//! All-reduce works in place in the caller's buffer. Rank r owns chunk r of the flat buffer
//! (chunks split as in `layout`) and folds chunk r of all n buffers in rank order. Where ranks
//! share memory, it writes the result straight back into every buffer; over a network it sends
//! the result to every peer (reduce-scatter, then all-gather, pipelined in pieces). One owner
//! computes each element, so every rank ends bitwise equal, and equal to the serial fold.

use std::ops::Range;

use super::buffer::{Payload, SharedBuf};
use std::sync::Arc;

use super::element::{CommElem, ReduceOp, WireDType, fold_in_place, fold_regions};
use super::error::CommError;
use super::group::{OpCtx, ProcessGroup};
use super::layout::{AlongDim, concat, split_ranges};
use super::mailbox::{Channel, Descriptor, Key, Message, OpKind, RecvFailure};

/// A tensor in host memory: row-major elements and a shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor<E> {
    pub data: Vec<E>,
    pub shape: Vec<usize>,
}

impl<E> HostTensor<E> {
    /// Pairs data with a shape; panics if the element count does not match.
    pub fn new(data: Vec<E>, shape: Vec<usize>) -> Self {
        assert_eq!(
            data.len(),
            shape.iter().product::<usize>(),
            "HostTensor: {} elements do not fill shape {shape:?}",
            data.len()
        );
        Self { data, shape }
    }
}

/// Message parts: the phase in the high bits, the piece index in the low 24.
fn part(phase: u32, piece: usize) -> u32 {
    debug_assert!(
        piece < 1 << 24,
        "piece index {piece} overflows the 24 bits of a message part"
    );
    (phase << 24) | piece as u32
}

/// Cuts `range` into pieces of at most `max` elements; an empty range is one empty piece, so
/// that even empty tensors exchange a message (and shapes get checked).
fn pieces(range: &Range<usize>, max: usize) -> Vec<Range<usize>> {
    if range.is_empty() {
        return vec![range.clone()];
    }
    let max = max.max(1);
    (range.start..range.end)
        .step_by(max)
        .map(|s| s..s.saturating_add(max).min(range.end))
        .collect()
}

/// Collects the results of every send and returns the first failure: a dead peer must not leave
/// the healthy ones waiting on this rank.
fn all_sent(results: impl IntoIterator<Item = Result<(), CommError>>) -> Result<(), CommError> {
    let mut first = Ok(());
    for result in results {
        // Not `?` or `try_fold`: the remaining sends must still run.
        if first.is_ok() {
            first = result;
        }
    }
    first
}

/// The elements of messages already checked by `recv_same_shape`.
fn slices<E: CommElem>(messages: &[Message]) -> Vec<&[E]> {
    messages
        .iter()
        .map(|m| m.payload.slice::<E>().expect("dtype checked on receipt"))
        .collect()
}

pub(crate) fn peers_of(group: &ProcessGroup) -> Vec<usize> {
    (0..group.size()).filter(|p| *p != group.rank()).collect()
}

impl OpCtx<'_> {
    /// `peer`'s size along `dim` in an all-gather, after checking that its shape `theirs`
    /// agrees with this rank's `shape` everywhere else.
    pub(crate) fn gathered_size(
        &self,
        peer: usize,
        theirs: &[usize],
        shape: &[usize],
        dim: usize,
    ) -> Result<usize, CommError> {
        let compatible = theirs.len() == shape.len()
            && theirs
                .iter()
                .zip(shape)
                .enumerate()
                .all(|(d, (a, b))| d == dim || a == b);
        if !compatible {
            return Err(self.mismatch(
                peer,
                format!("its shape {theirs:?} differs from {shape:?} outside dimension {dim}"),
            ));
        }
        Ok(theirs[dim])
    }

    /// The elements of a message from `peer`, which must hold `len` elements of `E`.
    fn elements<'m, E: CommElem>(
        &self,
        peer: usize,
        message: &'m Message,
        len: usize,
    ) -> Result<&'m [E], CommError> {
        let values = message.payload.slice::<E>().ok_or_else(|| {
            self.mismatch(
                peer,
                format!(
                    "it sent {:?} data, expected {:?}",
                    message.payload.dtype(),
                    E::DTYPE
                ),
            )
        })?;
        if values.len() != len {
            return Err(self.mismatch(
                peer,
                format!("it sent {} elements, expected {len}", values.len()),
            ));
        }
        Ok(values)
    }

    /// Sends step `part` to each of `peers`, every send attempted (see [`all_sent`]).
    pub(crate) fn send_each(
        &self,
        peers: &[usize],
        part: u32,
        payload: impl Fn(usize) -> Payload,
    ) -> Result<(), CommError> {
        all_sent(peers.iter().map(|&q| self.send(q, part, payload(q))))
    }

    /// Receives step `part` from each of `peers`, checking that every one has this rank's shape
    /// and sent `len` elements of `E`.
    fn recv_same_shape<E: CommElem>(
        &self,
        peers: &[usize],
        part: u32,
        len: usize,
    ) -> Result<Vec<Message>, CommError> {
        let messages = self.recv_all(peers, part)?;
        for (message, &q) in messages.iter().zip(peers) {
            self.check_same_shape(q, &message.desc)?;
            self.elements::<E>(q, message, len)?;
        }
        Ok(messages)
    }

    /// Takes back a buffer whose views were sent to peers, once they are done with it.
    fn reclaim<E: CommElem>(&self, buf: Arc<SharedBuf<E>>) -> Result<Vec<E>, CommError> {
        SharedBuf::into_vec(buf, self.deadline).map_err(|_| CommError::Timeout {
            op: self.desc.op,
            seq: self.desc.seq,
            group: self.group.describe(),
            missing: Vec::new(),
            waited: self.group.options().timeout,
        })
    }

    fn piece_elems<E>(&self) -> usize {
        self.group.inner.transport.piece_bytes() / size_of::<E>().max(1)
    }

    /// All-reduce of ranks that share memory: every rank grants each peer q its chunk q; rank r
    /// folds chunk r of all buffers and writes the result straight back into all of them, then
    /// tells the peers it is done. Per rank that reads and writes the buffer once, the volume
    /// of a memcpy, whatever the group size.
    fn all_reduce_shared<E: CommElem>(
        &self,
        buf: &Arc<SharedBuf<E>>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (me, peers) = (self.group.rank(), peers_of(self.group));
        let chunks = split_ranges(buf.len(), self.group.size());
        self.send_each(&peers, part(0, 0), |q| {
            Payload::view(buf, chunks[q].clone())
        })?;
        let granted = self.recv_same_shape::<E>(&peers, part(0, 0), chunks[me].len())?;
        let mut regions = Vec::with_capacity(self.group.size());
        for message in &granted {
            let (ptr, _) = message
                .payload
                .region_ptr::<E>()
                .expect("dtype checked on receipt");
            regions.push(ptr);
        }
        regions.insert(me, buf.ptr_at(chunks[me].start));
        // SAFETY: every peer granted this rank its chunk `me` until the `done` message below and
        // touches it no more; no other rank touches chunk `me` of this rank's buffer.
        unsafe { fold_regions(&regions, chunks[me].len(), op) };
        drop(granted);
        self.send_each(&peers, part(1, 0), |_| Payload::empty())?;
        // Once every peer is done, all chunks of this buffer hold their results.
        self.recv_all(&peers, part(1, 0)).map(drop)
    }

    /// All-reduce over a network: reduce-scatter then all-gather, in place, in pieces of the
    /// transport's `piece_bytes` so that receiving a piece overlaps folding the previous one.
    /// Per rank, 2(n−1)/n of the buffer goes out and comes in: the bandwidth-optimal volume.
    fn all_reduce_streamed<E: CommElem>(
        &self,
        buf: &Arc<SharedBuf<E>>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (me, peers) = (self.group.rank(), peers_of(self.group));
        let chunks = split_ranges(buf.len(), self.group.size());
        let max = self.piece_elems::<E>();
        all_sent(peers.iter().flat_map(|&q| {
            let sends = pieces(&chunks[q], max).into_iter().enumerate();
            sends.map(move |(p, piece)| self.send(q, part(0, p), Payload::view(buf, piece)))
        }))?;
        for (p, piece) in pieces(&chunks[me], max).into_iter().enumerate() {
            let messages = self.recv_same_shape::<E>(&peers, part(0, p), piece.len())?;
            let inputs = slices::<E>(&messages);
            // SAFETY: peers never read chunk `me` of this buffer before the sends just below.
            fold_in_place(unsafe { buf.region_mut(piece.clone()) }, me, &inputs, op);
            drop(messages);
            self.send_each(&peers, part(1, p), |_| Payload::view(buf, piece.clone()))?;
        }
        for &q in &peers {
            for (p, piece) in pieces(&chunks[q], max).into_iter().enumerate() {
                let message = self.recv(q, part(1, p))?;
                let reduced = self.elements::<E>(q, &message, piece.len())?;
                // SAFETY: rank q sent its result for this piece, so it has finished reading it; no
                // other rank reads chunk q of this buffer.
                unsafe { buf.region_mut(piece) }.copy_from_slice(reduced);
            }
        }
        Ok(())
    }
}

impl ProcessGroup {
    pub(crate) fn check_dim(
        &self,
        op: OpKind,
        shape: &[usize],
        dim: usize,
    ) -> Result<(), CommError> {
        if dim >= shape.len() {
            return Err(self.invalid(
                op,
                format!("dimension {dim} is out of range for shape {shape:?}"),
            ));
        }
        Ok(())
    }

    /// Every rank gets `op` over all ranks' tensors, which must have the same shape.
    pub fn all_reduce_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        op: ReduceOp,
    ) -> Result<HostTensor<E>, CommError> {
        let ctx = self.begin(OpKind::AllReduce, E::DTYPE, &input.shape, op.code())?;
        if self.size() == 1 {
            return Ok(input);
        }
        let buf = SharedBuf::new(input.data);
        if self.inner.transport.shares_memory() {
            ctx.all_reduce_shared(&buf, op)?;
        } else {
            ctx.all_reduce_streamed(&buf, op)?;
        }
        Ok(HostTensor {
            data: ctx.reclaim(buf)?,
            shape: input.shape,
        })
    }

    /// Reduces all ranks' tensors (same shape) and leaves rank r with part r along `dim`
    /// (uneven sizes as in `layout`: the first `S mod n` parts get one more row).
    pub fn reduce_scatter_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<HostTensor<E>, CommError> {
        self.check_dim(OpKind::ReduceScatter, &input.shape, dim)?;
        let ctx = self.begin(
            OpKind::ReduceScatter,
            E::DTYPE,
            &input.shape,
            op.code() | (dim as u64) << 8,
        )?;
        if self.size() == 1 {
            return Ok(input);
        }
        let (me, peers) = (self.rank(), peers_of(self));
        let along = AlongDim::new(&input.shape, dim);
        let rows = split_ranges(along.size, self.size());
        // Rank-major order: part q's rows become one contiguous chunk.
        let packed = if along.outer <= 1 {
            input.data
        } else {
            rows.iter()
                .flat_map(|r| along.pack(&input.data, r))
                .collect()
        };
        let chunk = |q: usize| {
            let scale = along.outer * along.inner;
            rows[q].start * scale..rows[q].end * scale
        };
        let buf = SharedBuf::new(packed);
        ctx.send_each(&peers, 0, |q| Payload::view(&buf, chunk(q)))?;
        let messages = ctx.recv_same_shape::<E>(&peers, 0, chunk(me).len())?;
        let inputs = slices::<E>(&messages);
        // SAFETY: nobody writes this buffer during a reduce-scatter.
        let mut output = unsafe { buf.region(chunk(me)) }.to_vec();
        fold_in_place(&mut output, me, &inputs, op);
        let mut shape = input.shape;
        shape[dim] = rows[me].len();
        Ok(HostTensor {
            data: output,
            shape,
        })
    }

    /// Concatenates all ranks' tensors along `dim`, in rank order. Ranks may contribute
    /// different sizes along `dim`; all other dimensions must agree.
    pub fn all_gather_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        dim: usize,
    ) -> Result<HostTensor<E>, CommError> {
        self.check_dim(OpKind::AllGather, &input.shape, dim)?;
        let ctx = self.begin(OpKind::AllGather, E::DTYPE, &input.shape, dim as u64)?;
        if self.size() == 1 {
            return Ok(input);
        }
        let (me, peers) = (self.rank(), peers_of(self));
        let shape = input.shape;
        let len = input.data.len();
        let buf = SharedBuf::new(input.data);
        ctx.send_each(&peers, 0, |_| Payload::view(&buf, 0..len))?;
        let messages = ctx.recv_all(&peers, 0)?;
        let mut sizes = Vec::with_capacity(self.size());
        let mut parts = Vec::with_capacity(self.size());
        for (message, &q) in messages.iter().zip(&peers) {
            let theirs = &message.desc.shape;
            sizes.push(ctx.gathered_size(q, theirs, &shape, dim)?);
            parts.push(ctx.elements::<E>(q, message, theirs.iter().product())?);
        }
        sizes.insert(me, shape[dim]);
        // SAFETY: nobody writes this buffer during an all-gather.
        parts.insert(me, unsafe { buf.region(0..len) });
        let along = AlongDim::new(&shape, dim);
        let data = concat(&parts, &sizes, along.outer, along.inner);
        let mut shape = shape;
        shape[dim] = sizes.iter().sum();
        Ok(HostTensor { data, shape })
    }

    /// Every rank gets `root`'s tensor; all ranks pass a tensor of the same shape.
    pub fn broadcast_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        root: usize,
    ) -> Result<HostTensor<E>, CommError> {
        if root >= self.size() {
            return Err(self.invalid(
                OpKind::Broadcast,
                format!("root {root} is outside the group (size {})", self.size()),
            ));
        }
        let ctx = self.begin(OpKind::Broadcast, E::DTYPE, &input.shape, root as u64)?;
        if self.size() == 1 {
            return Ok(input);
        }
        let HostTensor { mut data, shape } = input;
        if self.rank() == root {
            let len = data.len();
            let buf = SharedBuf::new(data);
            ctx.send_each(&peers_of(self), 0, |_| Payload::view(&buf, 0..len))?;
            data = ctx.reclaim(buf)?;
        } else {
            let message = ctx.recv(root, 0)?;
            ctx.check_same_shape(root, &message.desc)?;
            let len = data.len();
            data.copy_from_slice(ctx.elements::<E>(root, &message, len)?);
        }
        Ok(HostTensor { data, shape })
    }

    /// Splits the tensor along `scatter_dim` into one part per rank (uneven as in `layout`),
    /// sends part q to rank q, and concatenates the parts received along `gather_dim` in rank
    /// order. All ranks pass the same shape.
    pub fn all_to_all_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        scatter_dim: usize,
        gather_dim: usize,
    ) -> Result<HostTensor<E>, CommError> {
        self.check_dim(OpKind::AllToAll, &input.shape, scatter_dim)?;
        self.check_dim(OpKind::AllToAll, &input.shape, gather_dim)?;
        let arg = scatter_dim as u64 | (gather_dim as u64) << 32;
        let ctx = self.begin(OpKind::AllToAll, E::DTYPE, &input.shape, arg)?;
        if self.size() == 1 {
            return Ok(input);
        }
        let (me, peers, n) = (self.rank(), peers_of(self), self.size());
        let along = AlongDim::new(&input.shape, scatter_dim);
        let rows = split_ranges(along.size, n);
        let mine_len = along.outer * rows[me].len() * along.inner;
        let mut part_shape = input.shape.clone();
        part_shape[scatter_dim] = rows[me].len();

        let buf = SharedBuf::new(input.data);
        // SAFETY: nobody writes this buffer during an all-to-all.
        let data = unsafe { buf.region(0..buf.len()) };
        // Parts along the first dimension are views; others are packed into their own buffers.
        let contiguous = rows.iter().all(|r| along.is_contiguous(r));
        let part_payload = |q: usize| {
            if contiguous {
                Payload::view(&buf, along.flat(&rows[q]))
            } else {
                Payload::owned(along.pack(data, &rows[q]))
            }
        };
        ctx.send_each(&peers, 0, part_payload)?;
        let packed_own;
        let own_part: &[E] = if contiguous {
            &data[along.flat(&rows[me])]
        } else {
            packed_own = along.pack(data, &rows[me]);
            &packed_own
        };
        let messages = ctx.recv_same_shape::<E>(&peers, 0, mine_len)?;
        let mut parts = slices::<E>(&messages);
        parts.insert(me, own_part);
        let gather = AlongDim::new(&part_shape, gather_dim);
        let data = concat(&parts, &vec![gather.size; n], gather.outer, gather.inner);
        let mut shape = part_shape;
        shape[gather_dim] *= n;
        Ok(HostTensor { data, shape })
    }

    /// Returns once every rank of the group has entered the barrier.
    pub fn barrier(&self) -> Result<(), CommError> {
        let ctx = self.begin(OpKind::Barrier, WireDType::U8, &[], 0)?;
        let peers = peers_of(self);
        ctx.send_each(&peers, 0, |_| Payload::empty())?;
        ctx.recv_all(&peers, 0).map(drop)
    }

    fn p2p_key(&self, tag: u64) -> Key {
        Key {
            group: self.inner.id,
            channel: Channel::PointToPoint,
            id: tag,
            part: 0,
        }
    }

    /// Sends a tensor to group rank `dst`, to be received with the same `tag`. Returns once the
    /// message is queued; messages with the same (sender, tag) arrive in order.
    pub fn send_host<E: CommElem>(
        &self,
        input: HostTensor<E>,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError> {
        self.check_peer(OpKind::Send, dst, "destination")?;
        let message = Message {
            key: self.p2p_key(tag),
            desc: Descriptor {
                op: OpKind::Send,
                seq: tag,
                dtype: E::DTYPE,
                shape: input.shape,
                arg: tag,
            },
            payload: Payload::owned(input.data),
        };
        let global = self.inner.ranks[dst];
        self.inner
            .transport
            .send(global, message)
            .map_err(|reason| CommError::PeerLost {
                op: OpKind::Send,
                seq: tag,
                group: self.describe(),
                rank: global,
                reason,
                missing: vec![global],
            })
    }

    /// Waits for the next message from group rank `src` with `tag`.
    pub(crate) fn recv_message(&self, src: usize, tag: u64) -> Result<Message, CommError> {
        self.check_peer(OpKind::Recv, src, "source")?;
        let started = std::time::Instant::now();
        let global = self.inner.ranks[src];
        let deadline = started + self.options().timeout;
        self.inner
            .transport
            .mailbox()
            .take(global, self.p2p_key(tag), deadline)
            .map_err(|failure| match failure {
                RecvFailure::Timeout => CommError::Timeout {
                    op: OpKind::Recv,
                    seq: tag,
                    group: self.describe(),
                    missing: vec![global],
                    waited: started.elapsed(),
                },
                RecvFailure::PeerLost(reason) => CommError::PeerLost {
                    op: OpKind::Recv,
                    seq: tag,
                    group: self.describe(),
                    rank: global,
                    reason,
                    missing: vec![global],
                },
            })
    }

    /// Receives a tensor of element type `E` sent by group rank `src` with `tag`.
    pub fn recv_host<E: CommElem>(&self, src: usize, tag: u64) -> Result<HostTensor<E>, CommError> {
        let message = self.recv_message(src, tag)?;
        message_into_host(self, message, src)
    }
}

/// The tensor a point-to-point message carries.
pub(crate) fn message_into_host<E: CommElem>(
    group: &ProcessGroup,
    message: Message,
    src: usize,
) -> Result<HostTensor<E>, CommError> {
    let dtype = message.payload.dtype();
    let shape = message.desc.shape;
    let data = message.payload.into_vec::<E>().ok_or_else(|| {
        group.invalid(
            OpKind::Recv,
            format!(
                "rank {src} sent {dtype:?} data, the receiver expected {:?}",
                E::DTYPE
            ),
        )
    })?;
    if data.len() != shape.iter().product::<usize>() {
        return Err(group.invalid(
            OpKind::Recv,
            format!(
                "rank {src} sent {} elements for shape {shape:?}",
                data.len()
            ),
        ));
    }
    Ok(HostTensor { data, shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_and_empty_is_one_piece() {
        assert_eq!(pieces(&(3..10), 3), vec![3..6, 6..9, 9..10]);
        assert_eq!(pieces(&(4..4), 3), vec![4..4]);
        assert_eq!(pieces(&(0..5), usize::MAX), vec![0..5]);
    }
}
