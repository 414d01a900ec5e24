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
//! - names a node id longer than [`MAX_NODE_ID_LEN`] bytes (an agent's own is its hostname, at
//!   most 64 bytes, a `/` and its gossip address, at most 58: a Syn naming a few ids of 60 KB
//!   each made this host's own digest too large for a datagram, cutting it off from the cluster
//!   until chitchat forgot them, 5 minutes later);
//! - cannot be decoded, or decompresses to more than [`MAX_DECOMPRESSED`] bytes.
//!
//! chitchat also creates a node state for every id a digest names, which stays in its own digest
//! for 5 minutes and in its memory for 10: ids merely named, however short, would grow this
//! host's memory, its per-round work and its digest without bound. [`Introductions`] admits the
//! ids a digest names within fixed bounds, and [`strip`] removes the others from the digest
//! before chitchat sees it (the rest of the message goes through).
//!
//! A message refused is dropped whole (chitchat never sees it) and counted
//! (`rejected{unsafe}`).

mod heartbeats;
mod introductions;
mod rewrite;
#[cfg(test)]
mod tests;

/// Writes chitchat messages byte by byte (uncompressed blocks), for the tests: honest ones and
/// the crafted ones a member with the key could send.
#[cfg(test)]
pub mod craft;

use chitchat::{ChitchatId, Deserializable};

pub use self::{
    heartbeats::{Heartbeats, HEARTBEATS_PER_MS, HEARTBEAT_SLACK, MAX_HEARTBEATS},
    introductions::{
        Introductions, FORGET_MS, INTRODUCED_PER_IP, MAX_INTRODUCED, MAX_OWN_IDS, OWN_IDS_PER_IP,
    },
    rewrite::{rewrite, strip},
};

/// Highest version (exclusive) a message may name: 2^56, more than 2 centuries at 10 million
/// key changes a second.
pub const MAX_VERSION: u64 = 1 << 56;
/// Highest heartbeat (exclusive) a digest may name: 2^48, more than 40,000 years at 200 gossip
/// rounds a second.
pub const MAX_HEARTBEAT: u64 = 1 << 48;
/// Most bytes a message's compressed streams may decompress to (16 MiB; chitchat's deltas fit a
/// 64 KiB datagram).
pub const MAX_DECOMPRESSED: usize = 16 << 20;
/// Longest node id (bytes) a message may name: an agent's own is `hostname/gossip address`,
/// at most 64 + 1 + 58 bytes.
pub const MAX_NODE_ID_LEN: usize = 128;

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
    /// A node id longer than [`MAX_NODE_ID_LEN`].
    NodeIdTooLong,
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
            Self::NodeIdTooLong => "a node id longer than any agent's",
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

fn node(buf: &mut &[u8]) -> R<ChitchatId> {
    let id: ChitchatId = de(buf)?;
    if id.node_id.len() > MAX_NODE_ID_LEN {
        return Err(Unsafe::NodeIdTooLong);
    }
    Ok(id)
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
    let id = node(buf)?;
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

/// How far beyond this host's own max version another member's view of this host's own state
/// may go before this host takes it as forged: an honest peer never holds more of this host's
/// state than it published (chitchat only relays it), except one version that
/// `trim_peer_states` may add to a state it cannot trim otherwise.
pub const OWN_STATE_AHEAD: u64 = 8;

fn delta(
    buf: &mut &[u8],
    total: &mut usize,
    is_self: &impl Fn(&ChitchatId) -> bool,
    own_max: &mut Option<u64>,
) -> R<()> {
    let bytes = stream(buf, total)?;
    let mut cursor = &bytes[..];
    // The highest version named so far in the current node delta (keys strictly increase,
    // as chitchat's decoder requires; a `SetMaxVersion` sets it).
    let mut max: Option<u64> = None;
    // Whether the current node delta is about this host's own node, and whether any was.
    let (mut in_own, mut own) = (false, false);
    let mut note_own = |in_own: bool, max: Option<u64>| {
        if let (true, Some(m)) = (in_own, max) {
            *own_max = Some(own_max.map_or(m, |o| o.max(m)));
        }
    };
    while !cursor.is_empty() {
        let tag: u8 = de(&mut cursor)?;
        match tag {
            0 => {
                note_own(in_own, max);
                let id = node(&mut cursor)?;
                version(de(&mut cursor)?)?;
                version(de(&mut cursor)?)?;
                in_own = is_self(&id);
                own |= in_own;
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
    note_own(in_own, max);
    if own {
        return Err(Unsafe::OwnState);
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
    check_own(msg, is_self, &mut None)
}

/// [`check`], also telling in `own_max` the highest version a delta about this host's own node
/// names, if the message has one (it is then refused as [`Unsafe::OwnState`]). More than
/// [`OWN_STATE_AHEAD`] beyond this host's own max version: the sender holds this host's state
/// ahead of anything it published, which a member with the key forged (under this host's id,
/// at the sender or before it); chitchat there then takes none of this host's later updates
/// until they pass it (with a version near [`MAX_VERSION`], never), and sends this host its
/// own node in every reply, which this host refuses whole.
///
/// # Errors
/// As [`check`].
pub fn check_own(
    msg: &[u8],
    is_self: impl Fn(&ChitchatId) -> bool,
    own_max: &mut Option<u64>,
) -> R<Vec<(ChitchatId, u64)>> {
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
            delta(&mut buf, &mut total, &is_self, own_max)?;
            Ok(d)
        }
        2 => {
            delta(&mut buf, &mut total, &is_self, own_max)?;
            Ok(Vec::new())
        }
        3 => Ok(Vec::new()),
        _ => Err(Unsafe::Undecodable),
    }
}
