//! The authenticated datagram format around chitchat's messages.
//!
//! Every datagram is sealed with ChaCha20-Poly1305 under the cluster key (see [`super::key`]),
//! with a fresh random 96-bit nonce, and carries its send time and its sender's identity (a tag
//! of the sender's node id and generation, [`sender_tag`]). The associated data is the header,
//! the sender's and the receiver's gossip addresses, and the cluster id, so nothing in the
//! datagram can be changed without the tag failing, and it opens only at the address it was
//! sent to, coming from the address that sealed it: replayed to another host, or sent with
//! another source address, it fails authentication. The addresses are not carried (each end
//! knows them: its own, and the datagram's source or destination). The sender tag lets the
//! receiver tell which incarnation actually speaks from an address, so an id merely named in
//! gossip at another member's address is never taken for it.
//!
//! ```text
//! 0      4        5        9           17         25         37            len-16   len
//! | RLC3 | part   | msg id | unix ms   | sender   | nonce    | ciphertext   | tag    |
//!          hi nibble: index, lo nibble: count (1..=4)
//! associated data: header (37) | source addr (18) | destination addr (18) | cluster id
//!                  addr = IPv6 (an IPv4 address as ::ffff:a.b.c.d), port big endian
//! ```
//! A chitchat message may be as large as a UDP datagram can be (65,507 bytes); with the 45 bytes
//! of header and tag that no longer fits, so a large message is split into parts, each sealed on
//! its own, and put back together by the receiver (bounded: a few messages in flight, 2 s each).
//! A datagram is refused as *stale* when its time is more than [`MAX_SKEW_MS`] away from ours
//! (peers need clocks within that of each other, which NTP gives) or when its nonce was already
//! accepted within that window (a replay). The replay memory is bounded ([`REPLAY_CAPACITY`]) and
//! never forgets a nonce that could still be accepted: when it is full, new datagrams are refused
//! ([`Reject::ReplayFull`]) until the oldest entries age out.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    net::{IpAddr, SocketAddr},
};

use chacha20poly1305::{
    aead::{Aead, AeadCore, KeyInit, OsRng, Payload},
    ChaCha20Poly1305, Key, Nonce,
};

use super::key::ClusterKey;

/// Magic and wire version: `RLC3` carries the sender's identity, `RLC2` bound the addresses
/// (`RLC1` did not). Every agent of a cluster must speak the same version.
const MAGIC: &[u8; 4] = b"RLC3";
/// Bytes before the ciphertext.
pub const HEADER_LEN: usize = 37;

/// The tag of a sender's identity (node id and generation) carried in every datagram it seals:
/// the first 8 bytes of SHA-256 over a label, the node id and the generation.
#[must_use]
pub fn sender_tag(node_id: &str, generation: u64) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"ratelimit-cluster-sender\0");
    h.update(node_id.as_bytes());
    h.update([0]);
    h.update(generation.to_le_bytes());
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
}
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
/// Accepted nonces remembered for replay detection: at most this many authentic datagrams are
/// accepted per 2 x [`MAX_SKEW_MS`] (an average of 1,092/s over 60 s; a host receives a few hundred
/// per second at most, and a peer's backlog refused now is resent in a later round). About 3 MB.
pub const REPLAY_CAPACITY: usize = 65_536;
/// Of [`REPLAY_CAPACITY`], the most nonces one source address may hold (a quarter: 16,384 per
/// 2 x [`MAX_SKEW_MS`], an average of 273/s; a peer sends about 20-60/s at the default sync
/// interval). A member with the key flooding tiny authentic datagrams is refused past it, and
/// leaves the rest of the window to the others: it takes four addresses (four members, or a
/// member able to send from spoofed addresses) to fill the window.
pub const PER_SENDER_CAPACITY: usize = REPLAY_CAPACITY / 4;
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
    /// Authentic and fresh, but the replay memory (or the sender's quota of it,
    /// [`PER_SENDER_CAPACITY`]) is full of nonces still inside their lifetime: refused rather
    /// than forgetting one (which would let its replay through).
    ReplayFull,
}

/// Seals and opens datagrams; remembers nonces and partial messages.
pub struct Codec {
    cipher: ChaCha20Poly1305,
    cluster_id: Vec<u8>,
    /// Our gossip address: the source of what we seal, the destination of what we open.
    local: SocketAddr,
    /// Our identity's [`sender_tag`], sealed into every datagram.
    sender: u64,
    replay: ReplayFilter,
    pending: HashMap<(SocketAddr, u32), Pending>,
    next_msg_id: u32,
}

struct Pending {
    first_ms: u64,
    parts: Vec<Option<Vec<u8>>>,
}

impl Codec {
    /// A codec for `key` and `cluster_id`, at gossip address `local` (this host's advertised
    /// address: where peers send to, and where its datagrams come from).
    #[must_use]
    pub fn new(key: &ClusterKey, cluster_id: &str, local: SocketAddr) -> Self {
        Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key.bytes())),
            cluster_id: cluster_id.as_bytes().to_vec(),
            local,
            sender: 0,
            replay: ReplayFilter::default(),
            pending: HashMap::new(),
            next_msg_id: rand_u32(),
        }
    }

    /// Sets the identity ([`sender_tag`]) sealed into what is sealed from now on.
    pub fn set_sender(&mut self, tag: u64) {
        self.sender = tag;
    }

    /// Seals `message` for `to` (sent at `now_ms`, Unix milliseconds) into one datagram, or a few
    /// when it is too large for one. `None` if it exceeds even [`MAX_MESSAGE`].
    pub fn seal(&mut self, message: &[u8], to: SocketAddr, now_ms: u64) -> Option<Vec<Vec<u8>>> {
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
            datagram.extend_from_slice(&self.sender.to_le_bytes());
            datagram.extend_from_slice(&nonce);
            let aad = self.aad(&datagram[..HEADER_LEN], self.local, to);
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
        self.open_tagged(datagram, from, now_ms)
            .map(|m| m.map(|(message, _)| message))
    }

    /// [`Codec::open`], with the sender's identity ([`sender_tag`]) of a complete message.
    pub fn open_tagged(
        &mut self,
        datagram: &[u8],
        from: SocketAddr,
        now_ms: u64,
    ) -> Result<Option<(Vec<u8>, u64)>, Reject> {
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
        let sender = u64::from_le_bytes(datagram[17..25].try_into().expect("8 bytes"));
        let nonce_bytes: [u8; 12] = datagram[25..37].try_into().expect("12 bytes");
        let aad = self.aad(&datagram[..HEADER_LEN], from, self.local);
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
        if sent_ms.abs_diff(now_ms) > MAX_SKEW_MS {
            return Err(Reject::Stale);
        }
        self.replay.insert(nonce_bytes, from, now_ms)?;
        if count == 1 {
            return Ok(Some((plain, sender)));
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
            return Ok(Some((
                done.parts.into_iter().flatten().flatten().collect(),
                sender,
            )));
        }
        Ok(None)
    }

    fn aad(&self, header: &[u8], from: SocketAddr, to: SocketAddr) -> Vec<u8> {
        let mut aad = Vec::with_capacity(header.len() + 2 * ADDR_LEN + self.cluster_id.len());
        aad.extend_from_slice(header);
        push_addr(&mut aad, from);
        push_addr(&mut aad, to);
        aad.extend_from_slice(&self.cluster_id);
        aad
    }
}

const ADDR_LEN: usize = 18;

/// An address in the associated data: IPv4 as its IPv6-mapped form, so a dual-stack socket
/// (which reports IPv4 peers as `::ffff:a.b.c.d`) and an IPv4 one agree.
fn push_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    let ip = match addr.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    out.extend_from_slice(&ip.octets());
    out.extend_from_slice(&addr.port().to_be_bytes());
}

fn rand_u32() -> u32 {
    let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
    u32::from_le_bytes(nonce[..4].try_into().expect("4 bytes"))
}

/// Nonces accepted within the last 2 x [`MAX_SKEW_MS`], at most [`REPLAY_CAPACITY`]: a datagram
/// accepted at time T was sent at most `MAX_SKEW_MS` after T, so a replay of it arriving later
/// than T + 2 x `MAX_SKEW_MS` is refused as stale by its time alone, and until then its nonce is
/// kept whatever the load (when full, new datagrams are refused instead). Each source address
/// holds at most [`PER_SENDER_CAPACITY`] of them: one sender's flood is refused on its own.
#[derive(Default)]
struct ReplayFilter {
    seen: HashSet<[u8; 12]>,
    order: VecDeque<(u64, [u8; 12], SocketAddr)>,
    /// Live nonces per source address (addresses holding none are removed).
    per_sender: HashMap<SocketAddr, usize>,
}

impl ReplayFilter {
    /// Records `nonce` (from `from`, accepted at `now_ms`): `Stale` if it was already accepted,
    /// `ReplayFull` if `from` holds [`PER_SENDER_CAPACITY`] live nonces or the memory holds
    /// [`REPLAY_CAPACITY`] nonces that are all still live.
    fn insert(&mut self, nonce: [u8; 12], from: SocketAddr, now_ms: u64) -> Result<(), Reject> {
        // Only entries past their lifetime are forgotten. A wall clock stepping back keeps them
        // longer (refusing more, never less); stepping forward ages them and every datagram
        // sent before the step alike, by the same clock.
        while let Some(&(t, n, a)) = self.order.front() {
            if now_ms.saturating_sub(t) <= 2 * MAX_SKEW_MS {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&n);
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.per_sender.entry(a) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        if self.seen.contains(&nonce) {
            return Err(Reject::Stale);
        }
        if self.order.len() >= REPLAY_CAPACITY
            || self.per_sender.get(&from).copied().unwrap_or(0) >= PER_SENDER_CAPACITY
        {
            return Err(Reject::ReplayFull);
        }
        self.seen.insert(nonce);
        self.order.push_back((now_ms, nonce, from));
        *self.per_sender.entry(from).or_insert(0) += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FROM: &str = "198.18.1.1:7946";
    const TO: &str = "198.18.1.2:7946";
    const OTHER: &str = "198.18.1.3:7946";

    fn addr(a: &str) -> SocketAddr {
        a.parse().unwrap()
    }

    /// A codec at gossip address `local`.
    fn codec_at(secret: u8, cluster: &str, local: &str) -> Codec {
        Codec::new(
            &ClusterKey::from_secret(&[secret; 32], cluster).unwrap(),
            cluster,
            addr(local),
        )
    }

    /// The sender's codec (at `FROM`) for `codec(..)`'s receiver.
    fn sender(secret: u8, cluster: &str) -> Codec {
        codec_at(secret, cluster, FROM)
    }

    /// A receiver at `TO`.
    fn codec(secret: u8, cluster: &str) -> Codec {
        codec_at(secret, cluster, TO)
    }

    /// The sender's identity travels sealed: it comes out as it went in, and a datagram whose
    /// identity was changed on the way fails authentication.
    #[test]
    fn the_senders_identity_is_carried_and_authenticated() {
        let (mut a, mut b) = (sender(1, "c"), codec(1, "c"));
        let (from, to) = (addr(FROM), addr(TO));
        let me = sender_tag("host/198.18.1.1:7946", 1_000);
        assert_ne!(me, sender_tag("host/198.18.1.1:7946", 1_001));
        assert_ne!(me, sender_tag("other/198.18.1.1:7946", 1_000));
        a.set_sender(me);
        let d = a.seal(b"hello", to, 1_000_000).unwrap().remove(0);
        assert_eq!(
            b.open_tagged(&d, from, 1_000_000),
            Ok(Some((b"hello".to_vec(), me)))
        );
        let mut forged = a.seal(b"hello", to, 1_000_000).unwrap().remove(0);
        forged[17..25].copy_from_slice(&sender_tag("impostor", 2_000).to_le_bytes());
        assert_eq!(b.open_tagged(&forged, from, 1_000_000), Err(Reject::Auth));
    }

    /// Every datagram shorter than a header and a tag is malformed, whatever its first bytes (a
    /// real datagram cut short included), never read past its end (found missed by
    /// cargo-mutants: the length check with `-` for `+`).
    #[test]
    fn a_datagram_shorter_than_header_and_tag_is_malformed() {
        let (mut a, mut b) = (sender(1, "c"), codec(1, "c"));
        let whole = a.seal(b"hello", addr(TO), 1_000_000).unwrap().remove(0);
        assert!(whole.len() >= HEADER_LEN + TAG_LEN);
        for len in 0..HEADER_LEN + TAG_LEN {
            assert_eq!(
                b.open(&whole[..len], addr(FROM), 1_000_000),
                Err(Reject::Malformed),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn round_trip_and_rejections() {
        let (mut a, mut b) = (sender(1, "c"), codec(1, "c"));
        let (from, to) = (addr(FROM), addr(TO));
        let d = a.seal(b"hello", to, 1_000_000).unwrap();
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
        let old = a.seal(b"x", to, 1_000_000 - MAX_SKEW_MS - 1).unwrap();
        assert_eq!(b.open(&old[0], from, 1_000_000), Err(Reject::Stale));
        let future = a.seal(b"x", to, 1_000_000 + MAX_SKEW_MS + 1).unwrap();
        assert_eq!(b.open(&future[0], from, 1_000_000), Err(Reject::Stale));
        // Tampered header (the time) or body: auth.
        let mut t = a.seal(b"x", to, 1_000_000).unwrap().remove(0);
        t[10] ^= 1;
        assert_eq!(b.open(&t, from, 1_000_000), Err(Reject::Auth));
        let mut t = a.seal(b"x", to, 1_000_000).unwrap().remove(0);
        *t.last_mut().unwrap() ^= 1;
        assert_eq!(b.open(&t, from, 1_000_000), Err(Reject::Auth));
        // Garbage.
        assert_eq!(b.open(b"junk", from, 1_000_000), Err(Reject::Malformed));
        let mut bad = a.seal(b"x", to, 1_000_000).unwrap().remove(0);
        bad[4] = 0x11;
        assert_eq!(b.open(&bad, from, 1_000_000), Err(Reject::Malformed));
    }

    #[test]
    fn large_messages_are_split_and_joined_in_any_order() {
        let (mut a, mut b) = (sender(3, "c"), codec(3, "c"));
        let (from, to) = (addr(FROM), addr(TO));
        let message: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut parts = a.seal(&message, to, 5_000).unwrap();
        assert_eq!(parts.len(), 2);
        assert!(parts.iter().all(|p| p.len() <= MAX_DATAGRAM));
        parts.reverse();
        assert_eq!(b.open(&parts[0], from, 5_001), Ok(None));
        assert_eq!(b.open(&parts[1], from, 5_002), Ok(Some(message)));
        assert!(a.seal(&vec![0; MAX_MESSAGE + 1], to, 5_000).is_none());
    }

    #[test]
    fn pending_parts_are_bounded() {
        let (mut a, mut b) = (sender(4, "c"), codec(4, "c"));
        let (from, to) = (addr(FROM), addr(TO));
        let message = vec![7u8; MAX_PART_PLAIN + 1];
        for i in 0..(MAX_PENDING as u64 * 3) {
            let parts = a.seal(&message, to, 10_000 + i).unwrap();
            assert_eq!(b.open(&parts[0], from, 10_000 + i), Ok(None));
        }
        assert!(b.pending.len() <= MAX_PENDING);
    }

    #[test]
    fn bound_to_the_receiver_and_the_sender() {
        let mut a = sender(5, "c");
        let (from, to) = (addr(FROM), addr(TO));
        let d = a.seal(b"for TO", to, 1_000_000).unwrap().remove(0);
        // Replayed to another host of the cluster (same key), from the real sender's address.
        assert_eq!(
            codec_at(5, "c", OTHER).open(&d, from, 1_000_001),
            Err(Reject::Auth)
        );
        // Delivered to TO but with another source address (spoofed, to reflect the reply).
        let mut b = codec(5, "c");
        assert_eq!(b.open(&d, addr(OTHER), 1_000_001), Err(Reject::Auth));
        // A failed open remembers nothing: the genuine delivery still opens, from FROM at TO, and
        // a dual-stack socket's `::ffff:a.b.c.d` is the same address.
        assert_eq!(b.open(&d, from, 1_000_002), Ok(Some(b"for TO".to_vec())));
        let d = a.seal(b"v6", to, 1_000_000).unwrap().remove(0);
        assert_eq!(
            b.open(&d, addr("[::ffff:198.18.1.1]:7946"), 1_000_003),
            Ok(Some(b"v6".to_vec()))
        );
        // Another port of the same host is another address.
        let d = a
            .seal(b"x", addr("198.18.1.2:7947"), 1_000_000)
            .unwrap()
            .remove(0);
        assert_eq!(b.open(&d, from, 1_000_004), Err(Reject::Auth));
    }

    /// The window full of live nonces (four senders at their quota): a new datagram, from any
    /// of them or another, is refused, and no live nonce is forgotten.
    #[test]
    fn a_full_replay_window_refuses_new_datagrams_and_forgets_no_live_one() {
        let (mut a, mut b) = (sender(6, "c"), codec(6, "c"));
        let (from, to) = (addr(FROM), addr(TO));
        let t0 = 1_000_000;
        let first = a.seal(b"first", to, t0).unwrap().remove(0);
        assert_eq!(b.open(&first, from, t0), Ok(Some(b"first".to_vec())));
        let others = ["198.18.1.4:7946", "198.18.1.5:7946", "198.18.1.6:7946"];
        for (i, at) in std::iter::once(FROM).chain(others).enumerate() {
            let mut s = codec_at(6, "c", at);
            for _ in usize::from(i == 0)..PER_SENDER_CAPACITY {
                let d = s.seal(b"", to, t0 + 1).unwrap().remove(0);
                assert_eq!(b.open(&d, addr(at), t0 + 1), Ok(Some(Vec::new())));
            }
        }
        assert_eq!(b.replay.order.len(), REPLAY_CAPACITY);
        // Full of live nonces: a new datagram is refused, and the oldest stays remembered.
        let late = a.seal(b"late", to, t0 + 2).unwrap().remove(0);
        assert_eq!(b.open(&late, from, t0 + 2), Err(Reject::ReplayFull));
        let mut fifth = codec_at(6, "c", OTHER);
        let d = fifth.seal(b"", to, t0 + 2).unwrap().remove(0);
        assert_eq!(b.open(&d, addr(OTHER), t0 + 2), Err(Reject::ReplayFull));
        let live = t0 + MAX_SKEW_MS; // `first` is still within its time window here
        assert_eq!(b.open(&first, from, live), Err(Reject::Stale));
        assert_eq!(b.replay.order.len(), REPLAY_CAPACITY);
        // Once `first` is past its lifetime it is forgotten (its time alone refuses a replay),
        // which makes room.
        let after = t0 + 2 * MAX_SKEW_MS + 1;
        let next = a.seal(b"next", to, after).unwrap().remove(0);
        assert_eq!(b.open(&next, from, after), Ok(Some(b"next".to_vec())));
        assert_eq!(b.open(&first, from, after), Err(Reject::Stale));
        assert_eq!(b.replay.order.len(), REPLAY_CAPACITY);
    }

    /// A member with the key floods tiny authentic datagrams: past its quota
    /// ([`PER_SENDER_CAPACITY`]) it alone is refused, and another peer's datagrams are still
    /// accepted (before, one sender filled the shared window and every peer was refused).
    #[test]
    fn one_senders_flood_is_refused_and_leaves_the_window_to_the_others() {
        let (mut flood, mut b) = (sender(7, "c"), codec(7, "c"));
        let mut honest = codec_at(7, "c", OTHER);
        let to = addr(TO);
        let t0 = 1_000_000;
        let mut refused = 0;
        for i in 0..REPLAY_CAPACITY {
            let d = flood.seal(b"", to, t0 + 1).unwrap().remove(0);
            match b.open(&d, addr(FROM), t0 + 1) {
                Ok(_) => assert!(i < PER_SENDER_CAPACITY),
                Err(Reject::ReplayFull) => refused += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(refused, REPLAY_CAPACITY - PER_SENDER_CAPACITY);
        for i in 0..100 {
            let d = honest.seal(b"gossip", to, t0 + 2 + i).unwrap().remove(0);
            assert_eq!(
                b.open(&d, addr(OTHER), t0 + 2 + i),
                Ok(Some(b"gossip".to_vec()))
            );
        }
        // Once its nonces are past their lifetime, the flooding sender is accepted again.
        let after = t0 + 1 + 2 * MAX_SKEW_MS + 1;
        let d = flood.seal(b"again", to, after).unwrap().remove(0);
        assert_eq!(b.open(&d, addr(FROM), after), Ok(Some(b"again".to_vec())));
    }
}
