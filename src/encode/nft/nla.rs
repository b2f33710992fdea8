//! Netlink message and attribute (TLV) framing: a small writer that builds messages into one byte
//! buffer (so a whole batch is a single allocation and a single `sendmsg`), and a bounds-checked
//! reader for what the kernel sends back. Hand-rolled rather than the typed
//! `netlink-packet-netfilter` messages because the encoder needs exact control over attribute
//! layout (nested expression lists, NFTA_*_ID, user data) and the reader must tolerate any input.

use super::NftError;
use super::consts::*;

/// Builds netlink messages back to back in one buffer, or, for a long batch
/// ([`Writer::chunked`]), in a list of buffers sent together with one `sendmsg`.
#[derive(Default)]
pub struct Writer {
    /// The buffer being written (the last chunk of a chunked writer).
    pub buf: Vec<u8>,
    /// Offset of the message being built.
    msg_start: usize,
    /// Full chunks of a chunked writer, and its chunk size.
    done: Vec<Vec<u8>>,
    chunk: Option<usize>,
}

/// Room left in a fresh chunk beyond the chunk size: more than the largest message the encoder
/// writes (element lists are split at 48 KiB), so a chunk is never reallocated.
const CHUNK_SLACK: usize = 128 << 10;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    /// A writer that starts a new buffer at the next message boundary once the current one holds
    /// `chunk` bytes. The batch of a large ruleset then grows without doubling one buffer
    /// (each doubling copies it and briefly holds both); the kernel reads all chunks of one
    /// `sendmsg` into one datagram, as the batch must be.
    pub fn chunked(chunk: usize) -> Writer {
        Writer { chunk: Some(chunk), ..Writer::default() }
    }

    /// Every message written, in order, in one or more buffers.
    pub fn into_chunks(mut self) -> Vec<Vec<u8>> {
        self.done.push(self.buf);
        self.done
    }

    /// Starts a message: nlmsghdr + nfgenmsg. `res_id` is big endian on the wire.
    pub fn begin_msg(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) {
        if let Some(chunk) = self.chunk
            && self.buf.len() >= chunk
        {
            let full = std::mem::replace(&mut self.buf, Vec::with_capacity(chunk + CHUNK_SLACK));
            self.done.push(full);
        }
        self.msg_start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in end_msg
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: kernel fills it in
        self.buf.push(family);
        self.buf.push(NFNETLINK_V0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
    }

    pub fn end_msg(&mut self) {
        let len = (self.buf.len() - self.msg_start) as u32;
        self.buf[self.msg_start..self.msg_start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    pub fn put(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// A NUL-terminated string attribute.
    pub fn put_str(&mut self, ty: u16, s: &str) {
        let len = 4 + s.len() + 1;
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// Big-endian u32, as nf_tables attributes are.
    pub fn put_u32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    /// Big-endian u64.
    pub fn put_u64(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    pub fn put_u8(&mut self, ty: u16, v: u8) {
        self.put(ty, &[v]);
    }

    /// Opens a nested attribute; returns the token for [`Writer::end_nest`].
    pub fn begin_nest(&mut self, ty: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        start
    }

    pub fn end_nest(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// A received netlink message.
pub struct Msg<'a> {
    pub ty: u16,
    pub seq: u32,
    /// Everything after the nlmsghdr.
    pub payload: &'a [u8],
}

/// Splits a datagram into netlink messages.
pub fn messages(mut data: &[u8]) -> Result<Vec<Msg<'_>>, NftError> {
    let mut out = Vec::new();
    while data.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if len < NLMSG_HDRLEN || len > data.len() {
            return Err(NftError::Malformed(format!("netlink message length {len} of {} bytes", data.len())));
        }
        out.push(Msg {
            ty: u16::from_ne_bytes([data[4], data[5]]),
            seq: u32::from_ne_bytes([data[8], data[9], data[10], data[11]]),
            payload: &data[NLMSG_HDRLEN..len],
        });
        data = &data[align4(len).min(data.len())..];
    }
    Ok(out)
}

/// Iterates attributes of a buffer; malformed trailing bytes end the iteration with an error item.
pub struct Attrs<'a> {
    data: &'a [u8],
}

pub fn attrs(data: &[u8]) -> Attrs<'_> {
    Attrs { data }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), NftError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([self.data[0], self.data[1]]) as usize;
        let ty = u16::from_ne_bytes([self.data[2], self.data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > self.data.len() {
            self.data = &[];
            return Some(Err(NftError::Malformed(format!("attribute type {ty} length {len}"))));
        }
        let value = &self.data[4..len];
        self.data = &self.data[align4(len).min(self.data.len())..];
        Some(Ok((ty, value)))
    }
}

/// Collects the attributes of `data` into a table indexed by type (last one wins).
pub fn table(data: &[u8]) -> Result<Vec<Option<&[u8]>>, NftError> {
    let mut t: Vec<Option<&[u8]>> = Vec::new();
    for a in attrs(data) {
        let (ty, v) = a?;
        let i = ty as usize;
        if t.len() <= i {
            t.resize(i + 1, None);
        }
        t[i] = Some(v);
    }
    Ok(t)
}

pub fn get<'a>(t: &[Option<&'a [u8]>], ty: u16) -> Option<&'a [u8]> {
    t.get(ty as usize).copied().flatten()
}

pub fn as_str(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

pub fn as_u32(v: &[u8]) -> Result<u32, NftError> {
    let b: [u8; 4] =
        v.try_into().map_err(|_| NftError::Malformed(format!("u32 attribute of {} bytes", v.len())))?;
    Ok(u32::from_be_bytes(b))
}

pub fn as_u64(v: &[u8]) -> Result<u64, NftError> {
    let b: [u8; 8] =
        v.try_into().map_err(|_| NftError::Malformed(format!("u64 attribute of {} bytes", v.len())))?;
    Ok(u64::from_be_bytes(b))
}

/// nft's user-data TLVs: 1-byte type, 1-byte length, value (no padding).
pub fn udata_put(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    out.push(ty);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

pub fn udata_iter(mut data: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 2 {
            return None;
        }
        let (ty, len) = (data[0], data[1] as usize);
        if 2 + len > data.len() {
            data = &[];
            return None;
        }
        let v = &data[2..2 + len];
        data = &data[2 + len..];
        Some((ty, v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(w: &mut Writer, n: u32) {
        for seq in 0..n {
            w.begin_msg(0x0a00, 1, seq, 1, 0);
            let nest = w.begin_nest(1);
            w.put_str(2, &"x".repeat(seq as usize % 50));
            w.put_u32(3, seq);
            w.end_nest(nest);
            w.end_msg();
        }
    }

    /// A chunked writer holds the same bytes as a plain one, split only between messages, each
    /// chunk starting with a message once it is full.
    #[test]
    fn chunked_writer_splits_between_messages() {
        let mut plain = Writer::new();
        write(&mut plain, 200);
        let mut chunked = Writer::chunked(1000);
        write(&mut chunked, 200);
        let chunks = chunked.into_chunks();
        assert!(chunks.len() > 5, "{} chunks", chunks.len());
        assert_eq!(chunks.concat(), plain.buf);
        let mut seq = 0;
        for c in &chunks {
            assert!(c.len() >= 1000 || std::ptr::eq(c, chunks.last().unwrap()), "only the last is short");
            for m in messages(c).expect("whole messages") {
                assert_eq!(m.seq, seq);
                seq += 1;
            }
        }
        assert_eq!(seq, 200);
    }
}
