//! The test payload: a small header at the start of every UDP datagram the sender emits, so a
//! receiver can tell our packets from stray ones and spot duplicates.

/// Marks a datagram as ours.
pub const MAGIC: [u8; 4] = *b"RLTB";
/// Bytes of header: magic, sender id (u64 BE), sequence number (u64 BE). The smallest payload.
pub const HEADER_LEN: usize = 20;

/// What a datagram says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Unique per [`crate::send_udp`] call (process id and a counter).
    pub sender: u64,
    /// 0, 1, 2, ... in send order.
    pub seq: u64,
}

impl Header {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `buf`.
    pub fn write(&self, buf: &mut [u8]) {
        buf[..4].copy_from_slice(&MAGIC);
        buf[4..12].copy_from_slice(&self.sender.to_be_bytes());
        buf[12..20].copy_from_slice(&self.seq.to_be_bytes());
    }

    /// Reads a header, or `None` for a datagram that is not ours.
    pub fn read(buf: &[u8]) -> Option<Header> {
        if buf.len() < HEADER_LEN || buf[..4] != MAGIC {
            return None;
        }
        Some(Header {
            sender: u64::from_be_bytes(buf[4..12].try_into().ok()?),
            seq: u64::from_be_bytes(buf[12..20].try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_foreign() {
        let mut buf = [0u8; 32];
        let h = Header {
            sender: 0x0102_0304_0506_0708,
            seq: 42,
        };
        h.write(&mut buf);
        assert_eq!(Header::read(&buf), Some(h));
        assert_eq!(Header::read(&buf[..19]), None);
        buf[0] = b'X';
        assert_eq!(Header::read(&buf), None);
    }
}
