//! TensorBoard event files: scalar summaries in TFRecord framing, written without TensorFlow.
//!
//! The format is small enough to write by hand, which saves a protobuf dependency:
//! - a file is a sequence of records `len: u64 LE | masked_crc32c(len) | data | masked_crc32c(data)`
//!   (tensorflow `core/lib/io/record_writer.cc`);
//! - each record is one `tensorflow.Event` protobuf (`core/util/event.proto`), encoded here by
//!   hand for the three shapes we need: the `file_version` header and scalar summaries.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The first event of every file; readers use it to pick the format version.
const FILE_VERSION: &str = "brain.Event:2";

/// Appends scalar events to one event file, writing each call through to the OS so that a
/// killed run keeps everything it logged.
pub(super) struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` and `events.out.tfevents.<unix_secs>.<hostname>.lakeml` in it. TensorBoard
    /// reads every file with `tfevents` in its name, in name order, so a resumed run that opens
    /// a second file in the same directory continues the same curves.
    pub(super) fn create(dir: &Path, wall_time: f64) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let name = format!(
            "events.out.tfevents.{}.{}.lakeml",
            wall_time as u64,
            hostname()
        );
        let path = dir.join(name);
        // Append, not truncate: two opens within the same second must not erase each other.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let mut writer = Self { file, path };
        let mut event = Vec::new();
        encode_event(
            &mut event,
            wall_time,
            0,
            &EventBody::FileVersion(FILE_VERSION),
        );
        let mut out = Vec::new();
        frame_record(&mut out, &event);
        writer.write(&out)?;
        Ok(writer)
    }

    /// One event per value, as PyTorch's SummaryWriter writes them.
    pub(super) fn scalars(
        &mut self,
        wall_time: f64,
        step: u64,
        values: &[(&str, f64)],
    ) -> Result<()> {
        let mut out = Vec::new();
        let mut event = Vec::new();
        for (tag, value) in values {
            event.clear();
            encode_event(
                &mut event,
                wall_time,
                step,
                &EventBody::Scalar {
                    tag,
                    value: *value as f32,
                },
            );
            frame_record(&mut out, &event);
        }
        self.write(&out)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        // One write per call, so a reader never sees half of a batch for longer than a syscall.
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

/// The machine's name for the file name, as TensorFlow writers put it there; only characters
/// that are safe in a file name are kept.
fn hostname() -> String {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let clean: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if clean.is_empty() {
        "localhost".to_string()
    } else {
        clean
    }
}

enum EventBody<'a> {
    FileVersion(&'a str),
    Scalar { tag: &'a str, value: f32 },
}

// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn key(out: &mut Vec<u8>, field: u8, wire_type: u8) {
    out.push((field << 3) | wire_type);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn len_delimited(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    key(out, field, LEN);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 | summary = 5 }` with
/// `Summary { repeated Value value = 1 }` and `Value { tag = 1, simple_value = 2 (float) }`.
fn encode_event(out: &mut Vec<u8>, wall_time: f64, step: u64, body: &EventBody) {
    key(out, 1, FIXED64);
    out.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        // int64 is a plain varint of the two's-complement bits; proto3 omits zero.
        key(out, 2, VARINT);
        varint(out, step);
    }
    match body {
        EventBody::FileVersion(version) => len_delimited(out, 3, version.as_bytes()),
        EventBody::Scalar { tag, value } => {
            let mut value_msg = Vec::with_capacity(tag.len() + 8);
            len_delimited(&mut value_msg, 1, tag.as_bytes());
            key(&mut value_msg, 2, FIXED32);
            value_msg.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::with_capacity(value_msg.len() + 4);
            len_delimited(&mut summary, 1, &value_msg);
            len_delimited(out, 5, &summary);
        }
    }
}

/// Appends one TFRecord holding `data` to `out`.
fn frame_record(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// TFRecord stores CRCs rotated and offset, so that a CRC of data that itself holds CRCs does
/// not degenerate (tensorflow `core/lib/hash/crc32c.h`, `Mask`).
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli), reflected polynomial 0x82F63B78, one table lookup per byte. Event
/// files are small and written a few records at a time, so the simple table is fast enough.
pub(super) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = CRC32C_TABLE[((crc ^ byte as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
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
