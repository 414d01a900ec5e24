//! Checks every authentic chitchat message before chitchat sees it, for what a member with the
//! key (compromised or buggy) could send to crash or corrupt chitchat here.
//!
//! chitchat 0.13 trusts what its peers send: a delta whose `SetMaxVersion` follows a key of a
//! higher version trips an assertion where the delta is applied (its gossip loop panics: each
//! such datagram stops gossip here until the loop is restarted); a delta about this host's own
//! node at a version near `u64::MAX` leaves its own max version there, so the next key this host
//! sets overflows or trips another assertion (the sync loop dies); and a key version or
//! heartbeat far ahead of anything real freezes the node it names (real updates look old for
//! ever). chitchat's own decoding is private to it, so this decodes the wire format again
//! (chitchat's public [`Deserializable`] impls for the primitives, zstd for its compressed
//! blocks), and [`check`] refuses, before chitchat applies anything, a message that:
//! - carries a delta about this host's own node (an honest peer never has a newer version of it
//!   than this host, so never sends one);
//! - sets a node's max version below a key version of the same node delta;
//! - names a version at or above [`MAX_VERSION`] or a heartbeat at or above [`MAX_HEARTBEAT`]
//!   (an honest member gets nowhere near: versions grow by the keys it changes, heartbeats by one
//!   per gossip round);
//! - cannot be decoded, or decompresses to more than [`MAX_DECOMPRESSED`] bytes.
//!
//! A message refused is dropped whole (chitchat never sees it) and counted
//! (`rejected{unsafe}`).

use chitchat::{ChitchatId, Deserializable};

/// Highest version (exclusive) a message may name: 2^56, more than 2 centuries at 10 million
/// key changes a second.
pub const MAX_VERSION: u64 = 1 << 56;
/// Highest heartbeat (exclusive) a digest may name: 2^48, more than 40,000 years at 200 gossip
/// rounds a second.
pub const MAX_HEARTBEAT: u64 = 1 << 48;
/// Most bytes a message's compressed streams may decompress to (16 MiB; chitchat's deltas fit a
/// 64 KiB datagram).
pub const MAX_DECOMPRESSED: usize = 16 << 20;

const MAGIC_NUMBER: u16 = 45_139;

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsafe {
    /// Not chitchat's format, as far as this decoder reads it.
    Undecodable,
    /// A delta about this host's own node.
    OwnState,
    /// A node's max version set below a key version of the same node delta.
    MaxVersionBelowKeys,
    /// A version at or above [`MAX_VERSION`].
    VersionTooLarge,
    /// A heartbeat at or above [`MAX_HEARTBEAT`].
    HeartbeatTooLarge,
    /// Another member's heartbeat ahead of what that member itself last reported here, by more
    /// than it can have advanced since ([`Heartbeats`]).
    HeartbeatAhead,
}

impl Unsafe {
    /// What it means, for the log.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Self::Undecodable => "not a chitchat message this agent can check",
            Self::OwnState => "a delta about this host's own node",
            Self::MaxVersionBelowKeys => "a max version below a key version of the same node",
            Self::VersionTooLarge => "a version no member can have reached",
            Self::HeartbeatTooLarge => "a heartbeat no member can have reached",
            Self::HeartbeatAhead => {
                "another member's heartbeat ahead of what that member itself reported"
            }
        }
    }
}

type R<T> = Result<T, Unsafe>;

fn de<T: Deserializable>(buf: &mut &[u8]) -> R<T> {
    T::deserialize(buf).map_err(|_| Unsafe::Undecodable)
}

fn version(v: u64) -> R<u64> {
    if v >= MAX_VERSION {
        Err(Unsafe::VersionTooLarge)
    } else {
        Ok(v)
    }
}

/// chitchat's block stream (`serialize::deserialize_stream`): tagged blocks, zstd-compressed
/// (1) or not (2), up to a 0 tag; returns the bytes they hold.
fn stream(buf: &mut &[u8], total: &mut usize) -> R<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let tag: u8 = de(buf)?;
        if tag == 0 {
            return Ok(out);
        }
        let len = usize::from(de::<u16>(buf)?);
        let block = buf.get(..len).ok_or(Unsafe::Undecodable)?;
        *buf = &buf[len..];
        match tag {
            1 => {
                let plain = zstd::bulk::decompress(block, usize::from(u16::MAX))
                    .map_err(|_| Unsafe::Undecodable)?;
                *total += plain.len();
                out.extend_from_slice(&plain);
            }
            2 => {
                *total += len;
                out.extend_from_slice(block);
            }
            _ => return Err(Unsafe::Undecodable),
        }
        if *total > MAX_DECOMPRESSED {
            return Err(Unsafe::Undecodable);
        }
    }
}

/// One digest entry: `(ChitchatId, heartbeat, last GC version, max version)`.
fn digest_entry(buf: &mut &[u8]) -> R<(ChitchatId, u64)> {
    let id: ChitchatId = de(buf)?;
    let heartbeat: u64 = de(buf)?;
    version(de(buf)?)?;
    version(de(buf)?)?;
    if heartbeat >= MAX_HEARTBEAT {
        return Err(Unsafe::HeartbeatTooLarge);
    }
    Ok((id, heartbeat))
}

fn digest(v1: bool, buf: &mut &[u8], total: &mut usize) -> R<Vec<(ChitchatId, u64)>> {
    let mut entries = Vec::new();
    if v1 {
        let bytes = stream(buf, total)?;
        let mut cursor = &bytes[..];
        while !cursor.is_empty() {
            entries.push(digest_entry(&mut cursor)?);
        }
    } else {
        let n: u16 = de(buf)?;
        for _ in 0..n {
            entries.push(digest_entry(buf)?);
        }
    }
    Ok(entries)
}

fn delta(buf: &mut &[u8], total: &mut usize, is_self: &impl Fn(&ChitchatId) -> bool) -> R<()> {
    let bytes = stream(buf, total)?;
    let mut cursor = &bytes[..];
    // The highest version named so far in the current node delta (keys strictly increase,
    // as chitchat's decoder requires; a `SetMaxVersion` sets it).
    let mut max: Option<u64> = None;
    while !cursor.is_empty() {
        let tag: u8 = de(&mut cursor)?;
        match tag {
            0 => {
                let id: ChitchatId = de(&mut cursor)?;
                if is_self(&id) {
                    return Err(Unsafe::OwnState);
                }
                version(de(&mut cursor)?)?;
                version(de(&mut cursor)?)?;
                max = Some(0);
            }
            1 => {
                let Some(m) = max else {
                    return Err(Unsafe::Undecodable);
                };
                let _key: String = de(&mut cursor)?;
                let _value: String = de(&mut cursor)?;
                let v = version(de(&mut cursor)?)?;
                let status: u8 = de(&mut cursor)?;
                if status > 2 || v <= m {
                    return Err(Unsafe::Undecodable);
                }
                max = Some(v);
            }
            2 => {
                let Some(m) = max else {
                    return Err(Unsafe::Undecodable);
                };
                let v = version(de(&mut cursor)?)?;
                if v < m {
                    return Err(Unsafe::MaxVersionBelowKeys);
                }
                max = Some(v);
            }
            _ => return Err(Unsafe::Undecodable),
        }
    }
    Ok(())
}

/// Checks chitchat message `msg` (plaintext, as chitchat's socket receives it); `is_self` tells
/// this host's own node id (its running incarnation). Returns the digest's `(id, heartbeat)`
/// entries, if it has one.
///
/// # Errors
/// Why the message must not reach chitchat (see the module docs).
pub fn check(msg: &[u8], is_self: impl Fn(&ChitchatId) -> bool) -> R<Vec<(ChitchatId, u64)>> {
    let mut buf = msg;
    let magic: u16 = de(&mut buf)?;
    let protocol: u8 = de(&mut buf)?;
    let kind: u8 = de(&mut buf)?;
    if magic != MAGIC_NUMBER || protocol > 1 {
        return Err(Unsafe::Undecodable);
    }
    let v1 = protocol == 1;
    let mut total = 0usize;
    match kind {
        0 => {
            let d = digest(v1, &mut buf, &mut total)?;
            let _cluster_id: String = de(&mut buf)?;
            Ok(d)
        }
        1 => {
            let d = digest(v1, &mut buf, &mut total)?;
            delta(&mut buf, &mut total, &is_self)?;
            Ok(d)
        }
        2 => {
            delta(&mut buf, &mut total, &is_self)?;
            Ok(Vec::new())
        }
        3 => Ok(Vec::new()),
        _ => Err(Unsafe::Undecodable),
    }
}

/// A digest may name another member's heartbeat at most this far ahead of what that member itself
/// last reported here, plus [`HEARTBEATS_PER_MS`] per millisecond since.
pub const HEARTBEAT_SLACK: u64 = 1_000;
/// How fast a member's heartbeat may advance, at most, per millisecond (chitchat adds one per
/// gossip round and per message received: about 0.2/ms at the default sync interval, 2/ms at the
/// smallest).
pub const HEARTBEATS_PER_MS: u64 = 4;
/// Most members whose own heartbeat is remembered (the least recently heard forgotten first).
pub const MAX_HEARTBEATS: usize = 1024;

/// Each member's heartbeat as it reported it itself (its own entry in the digest of a datagram
/// it sealed and sent from its address), and when. chitchat keeps the highest heartbeat any
/// digest names for a member; one named far ahead (by a member with the key) makes the real ones
/// look old, so chitchat's failure detector stops hearing that member and, once it is declared
/// dead and collected, never takes it back until its heartbeat catches up. [`Heartbeats::check`]
/// refuses a message naming another member's heartbeat more than [`HEARTBEAT_SLACK`] +
/// [`HEARTBEATS_PER_MS`] x the milliseconds since that member's own report ahead of it; a
/// member not heard directly yet is not judged.
#[derive(Debug, Default)]
pub struct Heartbeats(std::collections::HashMap<ChitchatId, (u64, u64)>);

impl Heartbeats {
    /// Checks the digest `entries` of a message whose sender's own id is the one `is_sender`
    /// tells, received at `now_ms` (a monotonic clock); on success records the sender's own
    /// heartbeat.
    ///
    /// # Errors
    /// [`Unsafe::HeartbeatAhead`] when another member's heartbeat is ahead of its own report.
    pub fn check(
        &mut self,
        entries: &[(ChitchatId, u64)],
        is_sender: impl Fn(&ChitchatId) -> bool,
        now_ms: u64,
    ) -> R<()> {
        for (id, heartbeat) in entries {
            if is_sender(id) {
                continue;
            }
            if let Some(&(own, at)) = self.0.get(id) {
                let allowed = own
                    .saturating_add(HEARTBEAT_SLACK)
                    .saturating_add(now_ms.saturating_sub(at).saturating_mul(HEARTBEATS_PER_MS));
                if *heartbeat > allowed {
                    return Err(Unsafe::HeartbeatAhead);
                }
            }
        }
        for (id, heartbeat) in entries.iter().filter(|(id, _)| is_sender(id)) {
            if self.0.len() >= MAX_HEARTBEATS && !self.0.contains_key(id) {
                if let Some(old) = self
                    .0
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
                {
                    self.0.remove(&old);
                }
            }
            let e = self.0.entry(id.clone()).or_insert((*heartbeat, now_ms));
            if *heartbeat >= e.0 {
                *e = (*heartbeat, now_ms);
            }
        }
        Ok(())
    }
}

/// Writes chitchat messages byte by byte (uncompressed blocks), for the tests: honest ones and
/// the crafted ones a member with the key could send.
#[cfg(test)]
pub mod craft {
    use chitchat::{ChitchatId, Serializable};

    /// One delta operation.
    pub enum Op<'a> {
        /// A node: its id, last GC version, from version (excluded).
        Node(&'a ChitchatId, u64, u64),
        /// A key: name, value, version.
        Kv(&'a str, &'a str, u64),
        /// `SetMaxVersion`.
        SetMax(u64),
    }

    fn block(body: &[u8], out: &mut Vec<u8>) {
        for chunk in body.chunks(usize::from(u16::MAX)) {
            out.push(2);
            u16::try_from(chunk.len()).unwrap().serialize(out);
            out.extend_from_slice(chunk);
        }
        out.push(0);
    }

    fn header(kind: u8) -> Vec<u8> {
        let mut out = Vec::new();
        super::MAGIC_NUMBER.serialize(&mut out);
        out.push(1);
        out.push(kind);
        out
    }

    fn digest(entries: &[(&ChitchatId, u64, u64)], out: &mut Vec<u8>) {
        let mut body = Vec::new();
        for (id, heartbeat, max_version) in entries {
            id.serialize(&mut body);
            heartbeat.serialize(&mut body);
            0u64.serialize(&mut body);
            max_version.serialize(&mut body);
        }
        block(&body, out);
    }

    fn delta(ops: &[Op<'_>], out: &mut Vec<u8>) {
        let mut body = Vec::new();
        for op in ops {
            match op {
                Op::Node(id, gc, from) => {
                    body.push(0);
                    id.serialize(&mut body);
                    gc.serialize(&mut body);
                    from.serialize(&mut body);
                }
                Op::Kv(k, v, version) => {
                    body.push(1);
                    k.serialize(&mut body);
                    v.serialize(&mut body);
                    version.serialize(&mut body);
                    body.push(0);
                }
                Op::SetMax(v) => {
                    body.push(2);
                    v.serialize(&mut body);
                }
            }
        }
        block(&body, out);
    }

    /// A Syn (protocol V1) with `entries` (`(id, heartbeat, max version)`).
    #[must_use]
    pub fn syn(entries: &[(&ChitchatId, u64, u64)], cluster_id: &str) -> Vec<u8> {
        let mut out = header(0);
        digest(entries, &mut out);
        cluster_id.serialize(&mut out);
        out
    }

    /// A `SynAck` (protocol V1).
    #[must_use]
    pub fn syn_ack(entries: &[(&ChitchatId, u64, u64)], ops: &[Op<'_>]) -> Vec<u8> {
        let mut out = header(1);
        digest(entries, &mut out);
        delta(ops, &mut out);
        out
    }

    /// An Ack (protocol V1).
    #[must_use]
    pub fn ack(ops: &[Op<'_>]) -> Vec<u8> {
        let mut out = header(2);
        delta(ops, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{craft::Op, *};

    fn id(name: &str, port: u16) -> ChitchatId {
        ChitchatId::new(name.to_string(), 7, ([192, 0, 2, 1], port).into())
    }

    /// The crafted messages of the review are refused, each for its reason; the same messages
    /// made consistent pass, and the digest's heartbeats are returned.
    #[test]
    fn crafted_deltas_that_would_crash_chitchat_are_refused() {
        let me = id("me", 1);
        let other = id("other", 2);
        let is_me = |i: &ChitchatId| *i == me;
        let ok = craft::ack(&[
            Op::Node(&other, 0, 0),
            Op::Kv("s", "1:1:1", 3),
            Op::Kv("t", "x", 4),
            Op::Node(&id("empty", 3), 0, 0),
            Op::SetMax(9),
        ]);
        assert_eq!(check(&ok, is_me), Ok(Vec::new()));
        // SetMaxVersion after a key of a higher version: chitchat's assertion.
        let below = craft::ack(&[
            Op::Node(&other, 0, 0),
            Op::Kv("s", "1:1:1", 10),
            Op::SetMax(5),
        ]);
        assert_eq!(check(&below, is_me), Err(Unsafe::MaxVersionBelowKeys));
        // A key of our own node at u64::MAX.
        let own = craft::ack(&[Op::Node(&me, 0, 0), Op::Kv("s", "x", 5)]);
        assert_eq!(check(&own, is_me), Err(Unsafe::OwnState));
        let huge = craft::ack(&[Op::Node(&other, 0, 0), Op::Kv("s", "x", u64::MAX)]);
        assert_eq!(check(&huge, is_me), Err(Unsafe::VersionTooLarge));
        // Digests: a heartbeat of u64::MAX for another member.
        let syn = craft::syn(&[(&other, 5, 3), (&me, 9, 9)], "c");
        assert_eq!(
            check(&syn, is_me),
            Ok(vec![(other.clone(), 5), (me.clone(), 9)])
        );
        let hb = craft::syn(&[(&other, u64::MAX, 3)], "c");
        assert_eq!(check(&hb, is_me), Err(Unsafe::HeartbeatTooLarge));
        let sa = craft::syn_ack(
            &[(&other, 5, 3)],
            &[Op::Node(&other, 0, 0), Op::Kv("k", "v", 1)],
        );
        assert_eq!(check(&sa, is_me), Ok(vec![(other.clone(), 5)]));
        // Truncated, junk, or a key before any node.
        assert_eq!(check(&ok[..ok.len() - 1], is_me), Err(Unsafe::Undecodable));
        assert_eq!(check(b"junk", is_me), Err(Unsafe::Undecodable));
        let orphan = craft::ack(&[Op::Kv("s", "x", 5)]);
        assert_eq!(check(&orphan, is_me), Err(Unsafe::Undecodable));
    }

    /// A member's heartbeat named by another sender far ahead of what the member itself last
    /// reported is refused; one within the slack (and what it may have gained since) passes; a
    /// member not heard directly is not judged; the sender's own report moves the mark.
    #[test]
    fn another_members_heartbeat_ahead_of_its_own_report_is_refused() {
        let (x, y) = (id("x", 1), id("y", 2));
        let mut h = Heartbeats::default();
        let from = |who: &ChitchatId| {
            let who = who.clone();
            move |i: &ChitchatId| *i == who
        };
        // Not heard from x yet: y may name any heartbeat for it.
        assert_eq!(
            h.check(&[(y.clone(), 5), (x.clone(), 1 << 40)], from(&y), 0),
            Ok(())
        );
        // x reports 100 itself.
        assert_eq!(h.check(&[(x.clone(), 100)], from(&x), 1_000), Ok(()));
        let ahead = 100 + HEARTBEAT_SLACK + 10 * HEARTBEATS_PER_MS;
        assert_eq!(h.check(&[(x.clone(), ahead)], from(&y), 1_010), Ok(()));
        assert_eq!(
            h.check(&[(x.clone(), ahead + 1)], from(&y), 1_010),
            Err(Unsafe::HeartbeatAhead)
        );
        assert_eq!(
            h.check(&[(x.clone(), u64::MAX)], from(&y), 1_010),
            Err(Unsafe::HeartbeatAhead)
        );
        // x itself may report any (it only concerns itself), and that moves the mark.
        assert_eq!(h.check(&[(x.clone(), 50_000)], from(&x), 2_000), Ok(()));
        assert_eq!(h.check(&[(x.clone(), 50_500)], from(&y), 2_000), Ok(()));
    }
}
