//! Writes TensorBoard event files without depending on TensorFlow or a protobuf library.
//!
//! An event file is a sequence of TFRecord records, each carrying one serialized `Event`
//! protobuf. [`EventWriter`] writes the file-version header event, then one event per scalar
//! or text summary. TensorBoard (2.x) picks the file up from the run directory by its name,
//! `events.out.tfevents.{unix_secs}.{hostname}.{pid}.wildfire`.
//!
//! The few protobuf messages needed are encoded by hand below. Field numbers follow
//! TensorBoard's `event.proto`, `summary.proto`, `tensor.proto` and `tensor_shape.proto`.
//! Each record is framed as
//!
//! ```text
//! u64 LE  data length
//! u32 LE  masked CRC-32C of the 8 length bytes
//! [u8]    data
//! u32 LE  masked CRC-32C of data
//! ```
//!
//! where `masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8` (a rotate right by 15, then
//! a wrapping add).

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Appends scalar and text summaries to one TensorBoard event file.
///
/// Each `add_*` call writes one record and flushes it to the OS, so TensorBoard sees
/// progress while a run is still going and a crash loses at most the event being written.
/// Dropping the writer flushes too (errors on drop are ignored; call [`EventWriter::flush`]
/// to see them).
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` (and its parents) if needed, creates a new event file inside it, and
    /// writes the `brain.Event:2` file-version event TensorBoard expects first.
    ///
    /// Fails with `AlreadyExists` if a file of the same name is already there (two writers
    /// created in the same second by the same process in the same directory).
    pub fn create(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = format!(
            "events.out.tfevents.{secs}.{}.{}.wildfire",
            hostname(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        let mut event = Proto::default();
        event.double(1, wall_time());
        event.bytes(3, b"brain.Event:2");
        writer.write_event(&event)?;
        Ok(writer)
    }

    /// The path of the event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `value` for `tag` at `step`; TensorBoard shows it in the Scalars tab.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> io::Result<()> {
        let mut summary_value = Proto::default();
        summary_value.bytes(1, tag.as_bytes());
        summary_value.float(2, value);
        self.write_summary(&summary_value, step)
    }

    /// Records `text` for `tag` at `step`; TensorBoard renders it (as Markdown) in the Text tab.
    ///
    /// Written the way the text plugin's own summary op does it: a scalar `DT_STRING` tensor
    /// tagged with plugin name `"text"`.
    pub fn add_text(&mut self, tag: &str, text: &str, step: i64) -> io::Result<()> {
        let mut plugin_data = Proto::default();
        plugin_data.bytes(1, b"text");
        let mut metadata = Proto::default();
        metadata.message(1, &plugin_data);

        let mut tensor = Proto::default();
        tensor.varint_field(1, DT_STRING);
        tensor.message(2, &Proto::default()); // TensorShapeProto with no dims: a scalar.
        tensor.bytes(8, text.as_bytes());

        let mut summary_value = Proto::default();
        summary_value.bytes(1, tag.as_bytes());
        summary_value.message(8, &tensor);
        summary_value.message(9, &metadata);
        self.write_summary(&summary_value, step)
    }

    /// Pushes buffered bytes to the OS.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Wraps one `Summary.Value` in `Event { wall_time, step, summary { value } }` and writes it.
    fn write_summary(&mut self, summary_value: &Proto, step: i64) -> io::Result<()> {
        let mut summary = Proto::default();
        summary.message(1, summary_value);
        let mut event = Proto::default();
        event.double(1, wall_time());
        event.varint_field(2, step as u64);
        event.message(5, &summary);
        self.write_event(&event)
    }

    fn write_event(&mut self, event: &Proto) -> io::Result<()> {
        self.out.write_all(&frame_record(&event.0))?;
        self.out.flush()
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// `tensorflow.DataType::DT_STRING`.
const DT_STRING: u64 = 7;

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn hostname() -> String {
    fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Frames `data` as one TFRecord record.
fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&len);
    record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    record
}

fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli), the checksum TFRecord uses; reflected polynomial 0x82F63B78.
fn crc32c(data: &[u8]) -> u32 {
    let crc = data.iter().fold(!0u32, |crc, &byte| {
        CRC32C_TABLE[((crc ^ u32::from(byte)) & 0xff) as usize] ^ (crc >> 8)
    });
    !crc
}

/// `CRC32C_TABLE[b]` is the CRC register after shifting byte `b` through it.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// A protobuf message under construction: just the bytes, fields appended in call order.
#[derive(Debug, Default)]
struct Proto(Vec<u8>);

impl Proto {
    const VARINT: u32 = 0;
    const FIXED64: u32 = 1;
    const LEN: u32 = 2;
    const FIXED32: u32 = 5;

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire_type: u32) {
        self.varint(u64::from(field << 3 | wire_type));
    }

    /// `int64`, `uint64` and enum fields (a negative `int64` is cast to `u64` first).
    fn varint_field(&mut self, field: u32, v: u64) {
        self.key(field, Self::VARINT);
        self.varint(v);
    }

    fn double(&mut self, field: u32, v: f64) {
        self.key(field, Self::FIXED64);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn float(&mut self, field: u32, v: f32) {
        self.key(field, Self::FIXED32);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// `string` and `bytes` fields.
    fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, Self::LEN);
        self.varint(v.len() as u64);
        self.0.extend_from_slice(v);
    }

    fn message(&mut self, field: u32, m: &Proto) {
        self.bytes(field, &m.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    #[test]
    fn varint_encoding() {
        let mut p = Proto::default();
        p.varint(1);
        p.varint(300);
        p.varint(u64::MAX);
        assert_eq!(p.0[..3], [0x01, 0xac, 0x02]);
        assert_eq!(p.0.len(), 3 + 10);
    }

    /// Splits an event file into record payloads, checking the framing and both CRCs.
    fn read_records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        while !bytes.is_empty() {
            let (len_bytes, rest) = bytes.split_at(8);
            let (len_crc, rest) = rest.split_at(4);
            assert_eq!(len_crc, masked_crc32c(len_bytes).to_le_bytes());
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let (data, rest) = rest.split_at(len);
            let (data_crc, rest) = rest.split_at(4);
            assert_eq!(data_crc, masked_crc32c(data).to_le_bytes());
            records.push(data.to_vec());
            bytes = rest;
        }
        records
    }

    /// A decoded field: varints and fixed-width values as raw `u64`, length-delimited as bytes.
    #[derive(Debug, PartialEq)]
    enum Field {
        Int(u64),
        Bytes(Vec<u8>),
    }

    fn decode(mut msg: &[u8]) -> Vec<(u32, Field)> {
        fn varint(buf: &mut &[u8]) -> u64 {
            let mut v = 0;
            for shift in (0..64).step_by(7) {
                let b = buf[0];
                *buf = &buf[1..];
                v |= u64::from(b & 0x7f) << shift;
                if b < 0x80 {
                    break;
                }
            }
            v
        }
        let mut fields = Vec::new();
        while !msg.is_empty() {
            let key = varint(&mut msg);
            let value = match key & 7 {
                0 => Field::Int(varint(&mut msg)),
                1 | 5 => {
                    let n = if key & 7 == 1 { 8 } else { 4 };
                    let mut raw = [0u8; 8];
                    raw[..n].copy_from_slice(&msg[..n]);
                    msg = &msg[n..];
                    Field::Int(u64::from_le_bytes(raw))
                }
                2 => {
                    let n = varint(&mut msg) as usize;
                    let (data, rest) = msg.split_at(n);
                    msg = rest;
                    Field::Bytes(data.to_vec())
                }
                w => panic!("unexpected wire type {w}"),
            };
            fields.push(((key >> 3) as u32, value));
        }
        fields
    }

    fn get(fields: &[(u32, Field)], number: u32) -> &Field {
        &fields.iter().find(|(n, _)| *n == number).unwrap().1
    }

    fn sub(fields: &[(u32, Field)], number: u32) -> Vec<(u32, Field)> {
        match get(fields, number) {
            Field::Bytes(b) => decode(b),
            other => panic!("field {number} is not a message: {other:?}"),
        }
    }

    #[test]
    fn written_file_reads_back() {
        let dir = std::env::temp_dir().join(format!(
            "wildfire-tensorboard-test-{}-{}",
            std::process::id(),
            wall_time()
        ));
        let path = {
            let mut writer = EventWriter::create(&dir).unwrap();
            writer.add_scalar("train/loss", 2.5, 7).unwrap();
            writer.add_text("config", "lr = 0.1", -1).unwrap();
            writer.path().to_owned()
        };
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("events.out.tfevents.") && name.ends_with(".wildfire"));
        let records = read_records(&fs::read(&path).unwrap());
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(records.len(), 3);

        let header = decode(&records[0]);
        assert!(matches!(get(&header, 1), Field::Int(t) if f64::from_bits(*t) > 1.0e9));
        assert_eq!(get(&header, 3), &Field::Bytes(b"brain.Event:2".to_vec()));

        let scalar = decode(&records[1]);
        assert_eq!(get(&scalar, 2), &Field::Int(7));
        let value = sub(&sub(&scalar, 5), 1);
        assert_eq!(get(&value, 1), &Field::Bytes(b"train/loss".to_vec()));
        assert_eq!(get(&value, 2), &Field::Int(u64::from(2.5f32.to_bits())));

        let text = decode(&records[2]);
        assert_eq!(get(&text, 2), &Field::Int(-1i64 as u64));
        let value = sub(&sub(&text, 5), 1);
        assert_eq!(get(&value, 1), &Field::Bytes(b"config".to_vec()));
        let plugin = sub(&sub(&value, 9), 1);
        assert_eq!(get(&plugin, 1), &Field::Bytes(b"text".to_vec()));
        let tensor = sub(&value, 8);
        assert_eq!(get(&tensor, 1), &Field::Int(DT_STRING));
        assert_eq!(get(&tensor, 2), &Field::Bytes(Vec::new()));
        assert_eq!(get(&tensor, 8), &Field::Bytes(b"lr = 0.1".to_vec()));
    }
}
