//! The wire format of a message, shared by the byte-stream transports (`tcp`, `shm`).
//!
//! Frame: magic, key (group, channel, id, part), descriptor (op, seq, dtype, arg, shape), payload
//! (dtype, element count, raw little-endian elements). A payload that does not fit the tensor its
//! descriptor announces is refused before memory is reserved for it.

use std::io::{self, Read};

use crate::comm::buffer::Payload;
use crate::comm::element::{WireDType, with_elem_type};
use crate::comm::mailbox::{Channel, Descriptor, Key, Message, OpKind};

const FRAME_MAGIC: u32 = 0x5746_4d31; // "WFM1"
/// No payload is larger, whatever its descriptor says.
const MAX_PAYLOAD: usize = 1 << 40;

/// Everything of a frame before its payload's bytes.
pub(crate) fn frame_head(message: &Message) -> Vec<u8> {
    let Message { key, desc, payload } = message;
    let mut head = Vec::with_capacity(64 + 8 * desc.shape.len());
    head.extend_from_slice(&FRAME_MAGIC.to_le_bytes());
    head.extend_from_slice(&key.group.to_le_bytes());
    head.push(key.channel.code());
    head.extend_from_slice(&key.id.to_le_bytes());
    head.extend_from_slice(&key.part.to_le_bytes());
    head.push(desc.op.code());
    head.extend_from_slice(&desc.seq.to_le_bytes());
    head.push(desc.dtype as u8);
    head.extend_from_slice(&desc.arg.to_le_bytes());
    head.extend_from_slice(&(desc.shape.len() as u32).to_le_bytes());
    for d in &desc.shape {
        head.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    head.push(payload.dtype() as u8);
    head.extend_from_slice(&(payload.elems() as u64).to_le_bytes());
    head
}

/// A decoded frame head: the message without its payload, and what the payload will be.
pub(crate) struct Head {
    key: Key,
    desc: Descriptor,
    payload_dtype: WireDType,
    elems: usize,
}

pub(crate) fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed frame: {what}"),
    )
}

/// Reads a frame head and checks that the payload it announces fits its op.
pub(crate) fn read_head(r: &mut impl Read) -> io::Result<Head> {
    fn bytes<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
        let mut b = [0u8; N];
        r.read_exact(&mut b)?;
        Ok(b)
    }
    let u8s = |r: &mut _| bytes::<1>(r).map(|b| b[0]);
    let u32s = |r: &mut _| bytes::<4>(r).map(u32::from_le_bytes);
    let u64s = |r: &mut _| bytes::<8>(r).map(u64::from_le_bytes);
    if u32s(r)? != FRAME_MAGIC {
        return Err(invalid("bad magic"));
    }
    let group = u64s(r)?;
    let channel = Channel::from_code(u8s(r)?).ok_or_else(|| invalid("channel"))?;
    let id = u64s(r)?;
    let part = u32s(r)?;
    let op = OpKind::from_code(u8s(r)?).ok_or_else(|| invalid("op"))?;
    let seq = u64s(r)?;
    let dtype = WireDType::from_code(u8s(r)?).ok_or_else(|| invalid("dtype"))?;
    let arg = u64s(r)?;
    let ndim = u32s(r)? as usize;
    if ndim > 64 {
        return Err(invalid("rank of shape"));
    }
    let shape = (0..ndim)
        .map(|_| u64s(r).map(|d| d as usize))
        .collect::<io::Result<Vec<_>>>()?;
    let payload_dtype = WireDType::from_code(u8s(r)?).ok_or_else(|| invalid("payload dtype"))?;
    let elems = u64s(r)? as usize;
    check_announced(op, dtype, &shape, payload_dtype, elems)?;
    Ok(Head {
        key: Key {
            group,
            channel,
            id,
            part,
        },
        desc: Descriptor {
            op,
            seq,
            dtype,
            shape,
            arg,
        },
        payload_dtype,
        elems,
    })
}

/// Refuses a payload that cannot belong to the op its frame announces, before anything is
/// allocated for it. Every message of a collective carries a part of its sender's input (the
/// descriptor's shape) in the op's dtype, or nothing: at most `∏ shape` elements of `dtype`.
fn check_announced(
    op: OpKind,
    dtype: WireDType,
    shape: &[usize],
    payload_dtype: WireDType,
    elems: usize,
) -> io::Result<()> {
    if elems == 0 {
        return Ok(());
    }
    let most = shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
    if payload_dtype == dtype && most.is_some_and(|most| elems <= most) {
        return Ok(());
    }
    Err(invalid(&format!(
        "a payload of {elems} {payload_dtype:?} elements does not fit the {op} it announces \
         ({dtype:?}, shape {shape:?}); refused before reading it"
    )))
}

/// The message of `head`, its payload allocated (not zeroed) and then written by `fill`, which
/// gets the destination and its length in bytes and must write every byte or fail.
pub(crate) fn read_payload(
    head: Head,
    fill: impl FnOnce(*mut u8, usize) -> io::Result<()>,
) -> io::Result<Message> {
    let Head {
        key,
        desc,
        payload_dtype,
        elems,
    } = head;
    let payload = with_elem_type!(payload_dtype, E => {
        Payload::owned(filled_vec::<E>(elems, fill)?)
    });
    Ok(Message { key, desc, payload })
}

fn filled_vec<E: bytemuck::Pod>(
    elems: usize,
    fill: impl FnOnce(*mut u8, usize) -> io::Result<()>,
) -> io::Result<Vec<E>> {
    let len = elems
        .checked_mul(size_of::<E>())
        .filter(|len| *len <= MAX_PAYLOAD)
        .ok_or_else(|| invalid("payload size"))?;
    let mut data: Vec<E> = Vec::new();
    data.try_reserve_exact(elems).map_err(|_| {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("cannot allocate a payload of {len} bytes"),
        )
    })?;
    fill(data.as_mut_ptr().cast::<u8>(), len)?;
    // SAFETY: `fill` wrote all `len` bytes, and any bytes are a valid `E` (Pod).
    unsafe { data.set_len(elems) };
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of an all-reduce of four f32 values.
    fn all_reduce_of_four() -> Message {
        Message {
            key: Key {
                group: 7,
                channel: Channel::Collective,
                id: 3,
                part: 0,
            },
            desc: Descriptor {
                op: OpKind::AllReduce,
                seq: 3,
                dtype: WireDType::F32,
                shape: vec![4],
                arg: 0,
            },
            payload: Payload::owned(vec![1.5f32, -2.0, 0.25, 8.0]),
        }
    }

    /// Decodes one frame from `bytes`.
    fn read(mut bytes: &[u8]) -> io::Result<Message> {
        let head = read_head(&mut bytes)?;
        read_payload(head, |dst, len| {
            if bytes.len() < len {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // SAFETY: `dst` has room for `len` bytes, and `bytes` holds at least as many.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, len) };
            Ok(())
        })
    }

    #[test]
    fn a_frame_reads_back_as_sent() {
        let message = all_reduce_of_four();
        let mut bytes = frame_head(&message);
        bytes.extend_from_slice(message.payload.bytes());
        let read = read(&bytes).unwrap();
        assert_eq!((read.key, &read.desc), (message.key, &message.desc));
        assert_eq!(read.payload.slice::<f32>(), message.payload.slice::<f32>());
    }

    /// The head of `message` with its payload's element count (the head's last field) replaced.
    fn announcing(message: &Message, elems: u64) -> Vec<u8> {
        let mut head = frame_head(message);
        let at = head.len() - 8;
        head[at..].copy_from_slice(&elems.to_le_bytes());
        head
    }

    #[test]
    fn a_payload_larger_than_its_op_is_refused_before_it_is_allocated() {
        let message = all_reduce_of_four();
        // 4 GiB of f32 for an all-reduce of 4 elements: allocating it first would show in the
        // heap's peak, whatever other tests of this binary allocate meanwhile.
        let announced = 1u64 << 30;
        crate::TEST_HEAP.enable();
        crate::TEST_HEAP.reset_peak();
        let before = crate::TEST_HEAP.current();
        let error = read(&announcing(&message, announced)).unwrap_err();
        let grown = crate::TEST_HEAP.peak().saturating_sub(before);
        assert!(
            grown < 1 << 30,
            "the heap grew by {grown} bytes while refusing a frame"
        );
        assert!(
            error
                .to_string()
                .contains("does not fit the all_reduce it announces")
                && error.to_string().contains("shape [4]"),
            "{error}"
        );
    }

    #[test]
    fn a_payload_of_another_dtype_or_an_overflowing_shape_is_refused() {
        let mut bytes_as_f32 = all_reduce_of_four();
        bytes_as_f32.payload = Payload::owned(vec![0u8; 4]);
        let error = read(&frame_head(&bytes_as_f32)).unwrap_err();
        assert!(error.to_string().contains("4 U8 elements"), "{error}");

        let mut huge = all_reduce_of_four();
        huge.desc.shape = vec![1 << 40, 1 << 40];
        let error = read(&announcing(&huge, 1 << 41)).unwrap_err();
        assert!(
            error.to_string().contains("refused before reading"),
            "{error}"
        );
    }
}
