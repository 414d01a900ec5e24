//! The authenticated datagram format around chitchat's messages.
//!
//! Every datagram is sealed with ChaCha20-Poly1305 under the cluster key (see [`super::key`]),
//! with a fresh random 96-bit nonce, and carries its send time. The header (and the cluster id)
//! are the associated data, so nothing in the datagram can be changed without the tag failing.
//!
//! ```text
//! 0      4        5        9           17         29            len-16   len
//! | RLC1 | part   | msg id | unix ms   | nonce    | ciphertext   | tag    |
//!          hi nibble: index, lo nibble: count (1..=4)
//! ```
//! A chitchat message may be as large as a UDP datagram can be (65,507 bytes); with the 45 bytes
//! of header and tag that no longer fits, so a large message is split into parts, each sealed on
//! its own, and put back together by the receiver (bounded: a few messages in flight, 2 s each).
//! A datagram is refused as *stale* when its time is more than [`MAX_SKEW_MS`] away from ours
//! (peers need clocks within that of each other, which NTP gives) or when its nonce was already
//! accepted within that window (a replay).

use std::{
    collections::{HashMap, HashSet, VecDeque},
    net::SocketAddr,
};

use chacha20poly1305::{
    aead::{Aead, AeadCore, KeyInit, OsRng, Payload},
    ChaCha20Poly1305, Key, Nonce,
};

use super::key::ClusterKey;

const MAGIC: &[u8; 4] = b"RLC1";
/// Bytes before the ciphertext.
pub const HEADER_LEN: usize = 29;
/// Poly1305 tag length.
pub const TAG_LEN: usize = 16;
/// Largest datagram sent: fits IPv4's largest UDP payload (65,507 bytes).
pub const MAX_DATAGRAM: usize = 65_507;
/// Largest plaintext in one part.
const MAX_PART_PLAIN: usize = MAX_DATAGRAM - HEADER_LEN - TAG_LEN;
/// Most parts one message may be split into.
const MAX_PARTS: usize = 4;
/// Largest message that can be sealed.
pub const MAX_MESSAGE: usize = MAX_PART_PLAIN * MAX_PARTS;
/// Datagrams whose time differs from ours by more than this are stale.
pub const MAX_SKEW_MS: u64 = 30_000;
/// Accepted nonces remembered for replay detection (the window holds far fewer in practice: a
/// few hundred datagrams per second per host).
const REPLAY_CAPACITY: usize = 65_536;
/// Partly received messages kept at once.
const MAX_PENDING: usize = 16;
/// How long the parts of a message wait for the rest.
const PENDING_MS: u64 = 2_000;

/// Why a datagram was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Not our format: too short, wrong magic, impossible part numbers.
    Malformed,
    /// The tag does not verify: another key, another cluster id, or tampered with.
    Auth,
    /// Authentic but too old, from the future, or a replay.
    Stale,
}

/// Seals and opens datagrams; remembers nonces and partial messages.
pub struct Codec {
    cipher: ChaCha20Poly1305,
    cluster_id: Vec<u8>,
    replay: ReplayFilter,
    pending: HashMap<(SocketAddr, u32), Pending>,
    next_msg_id: u32,
}

struct Pending {
    first_ms: u64,
    parts: Vec<Option<Vec<u8>>>,
}

impl Codec {
    /// A codec for `key` and `cluster_id`.
    #[must_use]
    pub fn new(key: &ClusterKey, cluster_id: &str) -> Self {
        Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key.bytes())),
            cluster_id: cluster_id.as_bytes().to_vec(),
            replay: ReplayFilter::default(),
            pending: HashMap::new(),
            next_msg_id: rand_u32(),
        }
    }

    /// Seals `message` (sent at `now_ms`, Unix milliseconds) into one datagram, or a few when it
    /// is too large for one. `None` if it exceeds even [`MAX_MESSAGE`].
    pub fn seal(&mut self, message: &[u8], now_ms: u64) -> Option<Vec<Vec<u8>>> {
        if message.len() > MAX_MESSAGE {
            return None;
        }
        let count = message.len().div_ceil(MAX_PART_PLAIN).max(1);
        let msg_id = self.next_msg_id;
        self.next_msg_id = self.next_msg_id.wrapping_add(1);
        let mut out = Vec::with_capacity(count);
        for index in 0..count {
            let chunk = &message[(index * MAX_PART_PLAIN).min(message.len())
                ..((index + 1) * MAX_PART_PLAIN).min(message.len())];
            let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
            let mut datagram = Vec::with_capacity(HEADER_LEN + chunk.len() + TAG_LEN);
            datagram.extend_from_slice(MAGIC);
            #[expect(
                clippy::cast_possible_truncation,
                reason = "index < count <= MAX_PARTS = 4"
            )]
            datagram.push(((index as u8) << 4) | count as u8);
            datagram.extend_from_slice(&msg_id.to_le_bytes());
            datagram.extend_from_slice(&now_ms.to_le_bytes());
            datagram.extend_from_slice(&nonce);
            let aad = self.aad(&datagram[..HEADER_LEN]);
            let sealed = self
                .cipher
                .encrypt(
                    &nonce,
                    Payload {
                        msg: chunk,
                        aad: &aad,
                    },
                )
                .expect("ChaCha20-Poly1305 encryption cannot fail for in-range lengths");
            datagram.extend_from_slice(&sealed);
            out.push(datagram);
        }
        Some(out)
    }

    /// Opens a datagram from `from` received at `now_ms`: `Ok(Some(message))` when a whole
    /// message is complete, `Ok(None)` when a part was stored, `Err` when it is dropped.
    pub fn open(
        &mut self,
        datagram: &[u8],
        from: SocketAddr,
        now_ms: u64,
    ) -> Result<Option<Vec<u8>>, Reject> {
        if datagram.len() < HEADER_LEN + TAG_LEN || &datagram[..4] != MAGIC {
            return Err(Reject::Malformed);
        }
        let (index, count) = (
            usize::from(datagram[4] >> 4),
            usize::from(datagram[4] & 0x0f),
        );
        if count == 0 || count > MAX_PARTS || index >= count {
            return Err(Reject::Malformed);
        }
        let msg_id = u32::from_le_bytes(datagram[5..9].try_into().expect("4 bytes"));
        let sent_ms = u64::from_le_bytes(datagram[9..17].try_into().expect("8 bytes"));
        let nonce_bytes: [u8; 12] = datagram[17..29].try_into().expect("12 bytes");
        let aad = self.aad(&datagram[..HEADER_LEN]);
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(&nonce_bytes),
                Payload {
                    msg: &datagram[HEADER_LEN..],
                    aad: &aad,
                },
            )
            .map_err(|_| Reject::Auth)?;
        // Time and replay are checked only once the datagram is known to be authentic, so a
        // forger cannot fill the replay memory.
        if sent_ms.abs_diff(now_ms) > MAX_SKEW_MS || !self.replay.insert(nonce_bytes, now_ms) {
            return Err(Reject::Stale);
        }
        if count == 1 {
            return Ok(Some(plain));
        }
        self.pending
            .retain(|_, p| now_ms.saturating_sub(p.first_ms) <= PENDING_MS);
        if !self.pending.contains_key(&(from, msg_id)) && self.pending.len() >= MAX_PENDING {
            let oldest = self
                .pending
                .iter()
                .min_by_key(|(_, p)| p.first_ms)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.pending.remove(&k);
            }
        }
        let entry = self
            .pending
            .entry((from, msg_id))
            .or_insert_with(|| Pending {
                first_ms: now_ms,
                parts: vec![None; count],
            });
        if entry.parts.len() != count {
            self.pending.remove(&(from, msg_id));
            return Err(Reject::Malformed);
        }
        entry.parts[index] = Some(plain);
        if entry.parts.iter().all(Option::is_some) {
            let done = self.pending.remove(&(from, msg_id)).expect("present");
            return Ok(Some(done.parts.into_iter().flatten().flatten().collect()));
        }
        Ok(None)
    }

    fn aad(&self, header: &[u8]) -> Vec<u8> {
        let mut aad = Vec::with_capacity(header.len() + self.cluster_id.len());
        aad.extend_from_slice(header);
        aad.extend_from_slice(&self.cluster_id);
        aad
    }
}

fn rand_u32() -> u32 {
    let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
    u32::from_le_bytes(nonce[..4].try_into().expect("4 bytes"))
}

/// Nonces accepted within the last 2 x [`MAX_SKEW_MS`] (bounded by [`REPLAY_CAPACITY`]): a
/// datagram accepted at time T was sent at most `MAX_SKEW_MS` after T, so a replay of it arriving
/// later than T + 2 x `MAX_SKEW_MS` is refused as stale by its time alone.
#[derive(Default)]
struct ReplayFilter {
    seen: HashSet<[u8; 12]>,
    order: VecDeque<(u64, [u8; 12])>,
}

impl ReplayFilter {
    /// Records `nonce` (accepted at `now_ms`); false if it was already accepted.
    fn insert(&mut self, nonce: [u8; 12], now_ms: u64) -> bool {
        while let Some(&(t, n)) = self.order.front() {
            if now_ms.saturating_sub(t) > 2 * MAX_SKEW_MS || self.order.len() >= REPLAY_CAPACITY {
                self.order.pop_front();
                self.seen.remove(&n);
            } else {
                break;
            }
        }
        if !self.seen.insert(nonce) {
            return false;
        }
        self.order.push_back((now_ms, nonce));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec(secret: u8, cluster: &str) -> Codec {
        Codec::new(
            &ClusterKey::from_secret(&[secret; 32], cluster).unwrap(),
            cluster,
        )
    }

    const FROM: &str = "198.18.1.1:7946";

    #[test]
    fn round_trip_and_rejections() {
        let (mut a, mut b) = (codec(1, "c"), codec(1, "c"));
        let from: SocketAddr = FROM.parse().unwrap();
        let d = a.seal(b"hello", 1_000_000).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(b.open(&d[0], from, 1_000_100), Ok(Some(b"hello".to_vec())));
        // Replayed: stale.
        assert_eq!(b.open(&d[0], from, 1_000_200), Err(Reject::Stale));
        // Other key, other cluster id: auth.
        assert_eq!(
            codec(2, "c").open(&d[0], from, 1_000_100),
            Err(Reject::Auth)
        );
        assert_eq!(
            codec(1, "other").open(&d[0], from, 1_000_100),
            Err(Reject::Auth)
        );
        // Too old or from the future.
        let old = a.seal(b"x", 1_000_000 - MAX_SKEW_MS - 1).unwrap();
        assert_eq!(b.open(&old[0], from, 1_000_000), Err(Reject::Stale));
        let future = a.seal(b"x", 1_000_000 + MAX_SKEW_MS + 1).unwrap();
        assert_eq!(b.open(&future[0], from, 1_000_000), Err(Reject::Stale));
        // Tampered header (the time) or body: auth.
        let mut t = a.seal(b"x", 1_000_000).unwrap().remove(0);
        t[10] ^= 1;
        assert_eq!(b.open(&t, from, 1_000_000), Err(Reject::Auth));
        let mut t = a.seal(b"x", 1_000_000).unwrap().remove(0);
        *t.last_mut().unwrap() ^= 1;
        assert_eq!(b.open(&t, from, 1_000_000), Err(Reject::Auth));
        // Garbage.
        assert_eq!(b.open(b"junk", from, 1_000_000), Err(Reject::Malformed));
        let mut bad = a.seal(b"x", 1_000_000).unwrap().remove(0);
        bad[4] = 0x11;
        assert_eq!(b.open(&bad, from, 1_000_000), Err(Reject::Malformed));
    }

    #[test]
    fn large_messages_are_split_and_joined_in_any_order() {
        let (mut a, mut b) = (codec(3, "c"), codec(3, "c"));
        let from: SocketAddr = FROM.parse().unwrap();
        let message: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut parts = a.seal(&message, 5_000).unwrap();
        assert_eq!(parts.len(), 2);
        assert!(parts.iter().all(|p| p.len() <= MAX_DATAGRAM));
        parts.reverse();
        assert_eq!(b.open(&parts[0], from, 5_001), Ok(None));
        assert_eq!(b.open(&parts[1], from, 5_002), Ok(Some(message)));
        assert!(a.seal(&vec![0; MAX_MESSAGE + 1], 5_000).is_none());
    }

    #[test]
    fn pending_parts_are_bounded() {
        let (mut a, mut b) = (codec(4, "c"), codec(4, "c"));
        let from: SocketAddr = FROM.parse().unwrap();
        let message = vec![7u8; MAX_PART_PLAIN + 1];
        for i in 0..(MAX_PENDING as u64 * 3) {
            let parts = a.seal(&message, 10_000 + i).unwrap();
            assert_eq!(b.open(&parts[0], from, 10_000 + i), Ok(None));
        }
        assert!(b.pending.len() <= MAX_PENDING);
    }
}
